"""The record of a sweep's pack decisions: a JSON file and a Gantt chart of what ran.

Each :class:`~plora_hpo.reporting.PackSegment` is one stretch of a pack with fixed members.
The chart draws one row per device: the bar is what ran (measured start and end), and a thin
bar inside it is what the cost model planned for the same steps (predicted step time × steps),
so a pack slower or faster than predicted shows at a glance.

Worker processes each write their own record (``packs/<label>/``) on their own clock, whose
zero is in the file (``started_at``, Unix seconds); :func:`gather_pack_records` puts them on
one clock, so one chart shows every GPU of the sweep.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

from plora_hpo.reporting import PackSegment

log = logging.getLogger(__name__)


def summarise(segments: Sequence[PackSegment]) -> dict:
    """Per-sweep figures: segments, devices, makespan, and how far predictions were off."""
    ends = [s.end for s in segments if s.end is not None]
    ratios = [
        s.measured_step_seconds / s.predicted_step_seconds
        for s in segments
        if s.measured_step_seconds and s.predicted_step_seconds
    ]
    ratios.sort()
    return {
        "segments": len(segments),
        "packs": len({s.pack_id for s in segments}),
        "devices": sorted({s.device for s in segments}),
        "makespan_seconds": max(ends, default=0.0) - min((s.start for s in segments), default=0.0),
        "policies": sorted({s.policy for s in segments}),
        "solvers": sorted({s.solver for s in segments if s.solver}),
        "plan_seconds_max": max((s.plan_seconds for s in segments), default=0.0),
        "measured_over_predicted_step_median": ratios[len(ratios) // 2] if ratios else None,
    }


def write_pack_record(segments: Sequence[PackSegment], folder: Path, *, started_at: float, title: str = "") -> Path:
    """Write ``packs.json`` and ``packs.png`` into ``folder``; returns the folder.

    ``started_at``: the Unix time the segments' seconds count from."""
    folder.mkdir(parents=True, exist_ok=True)
    data = {"summary": summarise(segments), "started_at": started_at, "segments": [s.to_dict() for s in segments]}
    (folder / "packs.json").write_text(json.dumps(data, indent=2))
    draw_gantt(segments, folder / "packs.png", title=title)
    return folder


def gather_pack_records(folder: Path, *, since: float) -> list[PackSegment]:
    """The segments of the worker records ``folder/<label>/packs.json`` that started at Unix time
    ``since`` or later (not an earlier run's), in seconds since ``since``; each device is named
    ``<device>@<label>``, as the pack ids name their process."""
    segments = []
    for path in sorted(folder.glob("*/packs.json")):
        try:
            data = json.loads(path.read_text())
            theirs = [PackSegment(**row) for row in data["segments"]]
        except (ValueError, KeyError, TypeError) as err:  # a process killed while it wrote the file
            log.warning("%s: not a pack record (%s); left out of the sweep's", path, err)
            continue
        if data.get("started_at") is None or data["started_at"] < since:
            continue
        segments += shifted(theirs, data["started_at"] - since, label=path.parent.name)
    return segments


def shifted(segments: Sequence[PackSegment], seconds: float, *, label: str | None = None) -> list[PackSegment]:
    """``segments`` ``seconds`` later, their devices named ``<device>@<label>`` if a label is given."""
    return [
        dataclasses.replace(
            s,
            device=s.device if label is None else f"{s.device}@{label}",
            start=s.start + seconds,
            end=None if s.end is None else s.end + seconds,
        )
        for s in segments
    ]


LEGEND_LINE_PT = 10
"""Height of one pack's line in the chart's legend."""


def import_pyplot() -> ModuleType:
    """matplotlib's pyplot, drawing to files. Its first import (fonts included) takes about a
    second: a process that waits for others before it draws can import it while it waits."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def draw_gantt(segments: Sequence[PackSegment], path: Path, *, title: str = "") -> Path:
    """One row per device; a bar per pack segment as it ran, a thin bar for its planned length."""
    from matplotlib.transforms import offset_copy

    plt = import_pyplot()

    devices = sorted({s.device for s in segments})
    packs = sorted({s.pack_id for s in segments}, key=lambda p: (len(p), p))
    colors = plt.get_cmap("tab20").colors
    legend_lines = min(len(packs), 25)
    height = max(2.5, 0.6 * len(devices) + 1.5, (legend_lines * LEGEND_LINE_PT + 60) / 72)
    fig, (ax, legend_ax) = plt.subplots(1, 2, figsize=(13, height), gridspec_kw={"width_ratios": [3, 1]})
    for seg in segments:
        row = devices.index(seg.device)
        end = seg.end if seg.end is not None else seg.start
        color = colors[packs.index(seg.pack_id) % len(colors)]
        ax.broken_barh([(seg.start, end - seg.start)], (row - 0.35, 0.7), facecolors=color, edgecolors="black", lw=0.4)
        if seg.predicted_step_seconds and seg.steps:
            planned = seg.predicted_step_seconds * seg.steps
            ax.broken_barh([(seg.start, planned)], (row - 0.08, 0.16), facecolors="black", alpha=0.6)
    ax.set_yticks(range(len(devices)))
    ax.set_yticklabels(devices)
    ax.invert_yaxis()
    ax.set_xlabel("seconds since the sweep started (thin bar: planned length of the same steps)")
    ax.set_title(title or "packs as they ran")
    legend_ax.axis("off")
    lines = []
    for pack in packs[:24]:
        members = sorted({label for s in segments if s.pack_id == pack for label in s.labels})
        shown = ", ".join(members[:4]) + (f" +{len(members) - 4}" if len(members) > 4 else "")
        lines.append(f"{pack}: {shown}")
    if len(packs) > 24:
        lines.append(f"… {len(packs) - 24} more packs")
    for i, line in enumerate(lines):
        where = offset_copy(legend_ax.transAxes, fig=fig, y=-i * LEGEND_LINE_PT, units="points")
        legend_ax.text(0, 1, "■", color=colors[i % len(colors)], transform=where, va="top")
        legend_ax.text(0.06, 1, line, fontsize=7, transform=where, va="top")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
