"""Gantt chart of a schedule: one row per GPU, one bar per pack, so gaps and tails are visible."""

from __future__ import annotations

from pathlib import Path

from plora_hpo.planner.schedule import Schedule


def write_gantt(schedule: Schedule, path: str | Path, *, title: str = "") -> Path:
    """Draw ``schedule`` to a PNG at ``path`` (matplotlib, Agg backend); returns the path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = Path(path)
    colors = plt.get_cmap("tab20").colors
    height = max(2.5, 0.35 * schedule.num_gpus + 1.5)
    fig, ax = plt.subplots(figsize=(12, height))
    for pack in schedule.packs:
        width = pack.end - pack.start
        color = colors[pack.pack_id % len(colors)]
        for gpu in pack.gpus:
            ax.broken_barh([(pack.start, width)], (gpu - 0.4, 0.8), facecolors=color, edgecolors="black", linewidth=0.4)
        if width > 0.03 * schedule.makespan:
            middle = (min(pack.gpus) + max(pack.gpus)) / 2
            label = f"{pack.pack_id}: {len(pack.configs)}×" + (f" d{pack.degree}" if pack.degree > 1 else "")
            ax.text(pack.start + width / 2, middle, label, ha="center", va="center", fontsize=7)
    b = schedule.baselines
    ax.axvline(b.lower_bound, color="grey", linestyle="--", linewidth=1, label=f"lower bound {b.lower_bound:.0f} s")
    ax.set_xlim(0, max(schedule.makespan, b.lower_bound) * 1.02)
    ax.set_ylim(-0.6, schedule.num_gpus - 0.4)
    ax.set_yticks(range(schedule.num_gpus))
    ax.set_yticklabels([f"GPU {g}" for g in range(schedule.num_gpus)])
    ax.invert_yaxis()
    ax.set_xlabel("predicted seconds")
    speedup = schedule.speedups()["min_gpu"]
    ax.set_title(
        (title + "\n" if title else "") + f"makespan {schedule.makespan:.0f} s, {speedup:.2f}× faster than Min GPU, "
        f"approximation ratio {schedule.approximation_ratio:.3f}",
        fontsize=10,
    )
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
