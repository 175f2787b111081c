"""Gantt chart of a schedule: one row per GPU, one bar per pack, so gaps and tails are visible.

Bars carry only the pack number (``P3``): a pack's configs do not fit on a bar. A legend below the
chart, keyed by the same numbers and in the bars' colours, names each pack's configs summarised by
config type (rank and batch size, what the planner's cost model tells apart), e.g.
``P2: 6 × r32 a8/32 lr2e-5/1e-4/2e-4/4e-4 b2, 1 × r8 a2 lr2e-5 b8``.
"""

from __future__ import annotations

import textwrap
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path

from plora_hpo.adapter import AdapterConfig
from plora_hpo.planner.schedule import Schedule

_FIG_INCHES = 12.0  # figure width
_LEFT, _RIGHT = 0.75, 0.25  # chart margins in inches (GPU names on the left)
_KEY_MARGIN = 0.15  # the legend spans the figure less this on either side
_FONT = 7.5  # legend font size (monospace)
_CHAR_INCHES = 0.67 * _FONT / 72  # a monospace character is 0.6 em, drawn a little wider at 120 dpi
_LINE_INCHES = 0.17
_SWATCH_INCHES = 0.15  # colour square and gap before each legend line
_GAP_INCHES = 0.25  # between legend columns
LEGEND_MAX_ROWS = 48  # rows per column; a longer legend ends with how many packs it left out


def short_number(value: float) -> str:
    """Learning rates and the like, short: 2e-4, 1.5e-4; 0.01 gives 1e-2."""
    mantissa, exponent = f"{value:.2e}".split("e")
    mantissa = mantissa.rstrip("0").rstrip(".")
    return f"{mantissa}e{int(exponent)}"


def _short_alpha(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else f"{value:.3g}"


def _values(values: set[float], fmt) -> str:
    """``2/8/32`` for a few values, ``10.9–391`` (the range) for more, as sampled spaces give."""
    ordered = sorted(values)
    if len(ordered) > 4:
        return f"{fmt(ordered[0])}–{fmt(ordered[-1])}"
    return "/".join(fmt(v) for v in ordered)


def describe_configs(configs: Sequence[AdapterConfig]) -> str:
    """One pack's configs by config type (rank, batch size), largest group first.

    Each group lists the alphas and learning rates its configs take (``a2/8/32``, or their range
    when there are more than four); the count says how many configs share the type:
    ``12 × r8 a2/8/32 lr2e-5/1e-4/2e-4/4e-4 b2, 1 × r64 a16 lr2e-4 b8``.
    """
    groups: dict[tuple[int, int, bool], list[AdapterConfig]] = defaultdict(list)
    for c in configs:
        groups[(int(c.rank), int(c.batch_size), bool(c.use_rslora))].append(c)
    parts = []
    for (rank, batch, rslora), members in sorted(groups.items(), key=lambda kv: (-len(kv[1]), kv[0])):
        alphas = _values({c.alpha for c in members}, _short_alpha)
        rates = _values({c.learning_rate for c in members}, short_number)
        parts.append(f"{len(members)} × r{rank} a{alphas} lr{rates} b{batch}" + (" rsLoRA" if rslora else ""))
    return ", ".join(parts)


def legend_entries(schedule: Schedule, configs: Sequence[AdapterConfig] | None) -> list[str]:
    """One line per pack, ``P<id>: <its configs by type>``; without ``configs`` only their number."""
    entries = []
    for pack in schedule.packs:
        where = f" on {pack.degree} GPUs" if pack.degree > 1 else ""
        if configs is None:
            body = f"{len(pack.configs)} configs"
        else:
            body = describe_configs([configs[i] for i in pack.configs])
        entries.append(f"P{pack.pack_id}{where}: {body}")
    return entries


def _wrap(entry: str, width: int) -> list[str]:
    """Break a legend entry between its config groups (``, ``), within a group only if it must."""
    lines: list[str] = []
    for group in entry.split(", "):
        if lines and len(lines[-1]) + 2 + len(group) <= width:
            lines[-1] += ", " + group
        else:
            if lines:
                lines[-1] += ","
            lines += textwrap.wrap(group, width, initial_indent="    " if lines else "", subsequent_indent="    ")
    return lines


def _legend_layout(entries: list[str]) -> tuple[list[list[tuple[int, str]]], int]:
    """Lay the entries out in one column, or two when there are many.

    Returns the columns, each a list of rows ``(entry index, or -1 for a continuation, text)``,
    and the rows of the longest column. Lines wider than a column wrap; past ``LEGEND_MAX_ROWS``
    rows a column ends the legend with how many packs it leaves out (whole packs only).
    """
    key_inches = _FIG_INCHES - 2 * _KEY_MARGIN

    def chars(ncols: int) -> int:
        return int((key_inches / ncols - _SWATCH_INCHES - _GAP_INCHES) / _CHAR_INCHES)

    ncols = 2 if len(entries) > LEGEND_MAX_ROWS // 2 else 1
    wrapped = [_wrap(e, chars(ncols)) for e in entries]
    rows = [(i if k == 0 else -1, line) for i, lines in enumerate(wrapped) for k, line in enumerate(lines)]
    capacity = ncols * LEGEND_MAX_ROWS
    if len(rows) > capacity:
        cut = capacity - 1
        while rows[cut][0] == -1:  # never split one pack's lines
            cut -= 1
        shown = sum(1 for i, _ in rows[:cut] if i >= 0)
        rows = [*rows[:cut], (-1, f"… and {len(entries) - shown} more packs (the plan's table lists them all)")]
    per_column = -(-len(rows) // ncols)
    columns = [rows[k * per_column : (k + 1) * per_column] for k in range(ncols)]
    return [c for c in columns if c], per_column


def _runs(gpus: Sequence[int]) -> list[tuple[int, int]]:
    """[0, 1, 3] → [(0, 1), (3, 3)]: the runs of adjacent GPU ids, first and last of each."""
    runs: list[tuple[int, int]] = []
    for g in sorted(gpus):
        if runs and g == runs[-1][1] + 1:
            runs[-1] = (runs[-1][0], g)
        else:
            runs.append((g, g))
    return runs


def gantt_figure(schedule: Schedule, *, title: str = "", configs: Sequence[AdapterConfig] | None = None):
    """The chart as a matplotlib figure (Agg backend): bars above, the pack legend below the axes."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle

    colors = plt.get_cmap("tab20").colors
    columns, rows = _legend_layout(legend_entries(schedule, configs))
    headline = (title + "\n" if title else "") + (
        f"makespan {schedule.makespan:.0f} s, {schedule.speedups()['min_gpu']:.2f}× faster than Min GPU, "
        f"approximation ratio {schedule.approximation_ratio:.3f}"
    )
    # heights in inches, top to bottom: title, bars, x axis (ticks and label), legend
    title_h = 0.2 + 0.2 * (headline.count("\n") + 1)
    chart_h = max(1.2, 0.35 * schedule.num_gpus + 0.2)
    axis_h = 0.55
    key_h = (rows + 1.0) * _LINE_INCHES
    width, height = _FIG_INCHES, title_h + chart_h + axis_h + key_h
    fig = plt.figure(figsize=(width, height))
    ax = fig.add_axes(((_LEFT / width), (key_h + axis_h) / height, 1 - (_LEFT + _RIGHT) / width, chart_h / height))
    key = fig.add_axes((_KEY_MARGIN / width, 0, 1 - 2 * _KEY_MARGIN / width, key_h / height))

    b = schedule.baselines
    x_end = max(schedule.makespan, b.lower_bound) * 1.02
    inches_per_second = (width - _LEFT - _RIGHT) / x_end
    for pack in schedule.packs:
        span = pack.end - pack.start
        color = colors[pack.pack_id % len(colors)]
        for first, last in _runs(pack.gpus):  # one block per run of adjacent GPUs
            rows_high = last - first + 0.8
            ax.broken_barh(
                [(pack.start, span)], (first - 0.4, rows_high), facecolors=color, edgecolors="black", linewidth=0.4
            )
            label, wide, high = f"P{pack.pack_id}", span * inches_per_second, rows_high * 0.35
            middle = (pack.start + span / 2, (first + last) / 2)
            if wide > len(label) * 0.065 + 0.05:
                ax.text(*middle, label, ha="center", va="center", fontsize=7)
            elif wide > 0.11 and high > len(label) * 0.055 + 0.04:  # narrow bar: the label upright
                ax.text(*middle, label, ha="center", va="center", fontsize=6, rotation=90)
    ax.axvline(b.lower_bound, color="grey", linestyle="--", linewidth=1, label=f"lower bound {b.lower_bound:.0f} s")
    ax.set_xlim(0, x_end)
    ax.set_ylim(-0.6, schedule.num_gpus - 0.4)
    ax.set_yticks(range(schedule.num_gpus))
    ax.set_yticklabels([f"GPU {g}" for g in range(schedule.num_gpus)])
    ax.invert_yaxis()
    ax.set_xlabel("predicted seconds")
    ax.set_title(headline, fontsize=10)
    # above the axes' right corner, beside the title: it never covers a bar
    ax.legend(loc="lower right", bbox_to_anchor=(1.0, 1.0), fontsize=8, frameon=False, borderaxespad=0.2)

    key.axis("off")
    key_inches = width - 2 * _KEY_MARGIN  # the legend's x coordinates are inches
    key.set_xlim(0, key_inches)
    key.set_ylim(rows + 1.0, 0)
    for c, column in enumerate(columns):
        x = c * key_inches / len(columns)
        for r, (index, line) in enumerate(column, start=1):
            if index >= 0:
                color = colors[schedule.packs[index].pack_id % len(colors)]
                swatch = Rectangle((x, r - 0.35), 0.09, 0.7, facecolor=color, edgecolor="black", linewidth=0.3)
                key.add_patch(swatch)
            key.text(x + _SWATCH_INCHES, r, line, va="center", ha="left", fontsize=_FONT, family="monospace")
    return fig


def write_gantt(
    schedule: Schedule, path: str | Path, *, title: str = "", configs: Sequence[AdapterConfig] | None = None
) -> Path:
    """Draw ``schedule`` to a PNG at ``path``; returns the path.

    ``configs`` are the planned configs (the packs hold indices into them): given, the legend names
    each pack's configs; without them it gives only how many configs each pack holds.
    """
    path = Path(path)
    fig = gantt_figure(schedule, title=title, configs=configs)
    import matplotlib.pyplot as plt  # after gantt_figure chose the Agg backend

    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
