"""The plan's Gantt chart: bars keyed P<n>, a legend below the bars naming each pack's configs."""

from __future__ import annotations

import argparse
import itertools
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import pytest

from plora_hpo.adapter import AdapterConfig
from plora_hpo.planner import gantt
from plora_hpo.planner.cli import add_plan_arguments, run_plan
from plora_hpo.planner.cost_model import GpuSpec
from plora_hpo.planner.gantt import describe_configs, gantt_figure, legend_entries, short_number, write_gantt
from plora_hpo.planner.plan import plan_packs

SPACES = Path(__file__).resolve().parents[2] / "search_spaces"


def grid() -> list[AdapterConfig]:
    """Two ranks × two alphas × two learning rates × two batch sizes: 16 configs, 4 config types."""
    return [
        AdapterConfig(rank=r, alpha=r * m, learning_rate=lr, batch_size=b)
        for r, m, lr, b in itertools.product((8, 64), (1, 4), (1e-4, 2e-4), (2, 8))
    ]


def schedule_of(configs, num_gpus: int = 2):
    return plan_packs(configs, shape="qwen2.5-1.5b", seq_len=512, gpu=GpuSpec("H200", 80), num_gpus=num_gpus, steps=50)


def legend_of(fig) -> list[str]:
    """The legend's entries, wrapped lines joined again."""
    entries: list[str] = []
    for t in fig.axes[1].texts:
        line = t.get_text()
        if line.startswith("    "):
            entries[-1] += " " + line.strip()
        else:
            entries.append(line)
    return entries


def assert_legend_clear(fig) -> None:
    """The legend lies below the chart (axes, tick labels, x label), inside the figure, its columns
    apart; the lower-bound key lies above the bars."""
    chart, key = fig.axes
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    boxes = [(t.get_position()[0], t.get_window_extent(renderer)) for t in key.texts]
    chart_bottom = chart.get_tightbbox(renderer).y0
    assert all(box.y1 <= chart_bottom and box.y0 >= 0 and box.x1 <= fig.bbox.x1 for _, box in boxes)
    column_starts = sorted({x for x, _ in boxes})
    for left, right in itertools.pairwise(column_starts):
        right_x0 = min(box.x0 for x, box in boxes if x == right)
        assert all(box.x1 < right_x0 for x, box in boxes if x == left)
    assert chart.get_legend().get_window_extent(renderer).y0 >= chart.get_window_extent(renderer).y1


def entry(pack, configs) -> str:
    where = f" on {pack.degree} GPUs" if pack.degree > 1 else ""
    return f"P{pack.pack_id}{where}: {describe_configs([configs[i] for i in pack.configs])}"


def test_configs_are_summarised_by_type():
    configs = grid()
    assert describe_configs(configs[:8]) == "4 × r8 a8/32 lr1e-4/2e-4 b2, 4 × r8 a8/32 lr1e-4/2e-4 b8"
    one = AdapterConfig(rank=64, alpha=16, learning_rate=2e-4, batch_size=8)
    mixed = describe_configs([*configs[:4], one])
    assert mixed == "2 × r8 a8 lr1e-4/2e-4 b2, 2 × r8 a8 lr1e-4/2e-4 b8, 1 × r64 a16 lr2e-4 b8"
    sampled = [AdapterConfig(rank=16, alpha=1.5 + i, learning_rate=1e-5 * (i + 1), batch_size=4) for i in range(6)]
    assert describe_configs(sampled) == "6 × r16 a1.5–6.5 lr1e-5–6e-5 b4"  # many values: their range
    assert [short_number(v) for v in (2e-4, 1.5e-4, 0.01, 3.0)] == ["2e-4", "1.5e-4", "1e-2", "3e0"]


def test_the_legend_names_every_packs_configs_below_the_bars():
    configs = grid()
    schedule = schedule_of(configs)
    fig = gantt_figure(schedule, title="t", configs=configs)
    try:
        labels = legend_of(fig)
        chart = fig.axes[0]
        assert labels == [entry(pack, configs) for pack in schedule.packs]
        for config in configs:  # every config's type appears in some pack's legend line
            assert any(f"× r{config.rank} " in t and f" b{config.batch_size}" in t for t in labels)
        bar_labels = [t.get_text() for t in chart.texts]
        assert bar_labels and all(label.startswith("P") and ":" not in label for label in bar_labels)
        assert_legend_clear(fig)
    finally:
        plt.close(fig)


def test_without_configs_the_legend_counts_them(tmp_path):
    schedule = schedule_of(grid())
    assert legend_entries(schedule, None)[0].endswith(f": {len(schedule.packs[0].configs)} configs")
    path = write_gantt(schedule, tmp_path / "sub" / "g.png")
    assert path.stat().st_size > 10_000


def test_a_long_legend_keeps_whole_packs_and_says_how_many_it_left_out():
    entries = [f"P{i}: 1 × r8 a8 lr1e-4 b2" for i in range(150)]
    columns, rows = gantt._legend_layout(entries)
    assert len(columns) == 2 and rows == gantt.LEGEND_MAX_ROWS
    lines = [line for column in columns for _, line in column]
    assert lines[-1] == "… and 55 more packs (the plan's table lists them all)"
    long = "P0: " + ", ".join(f"1 × r{r} a{r} lr1e-4 b2" for r in range(8, 400, 8))
    (column,), _ = gantt._legend_layout([long])
    assert len(column) > 1 and all(line.endswith(",") for _, line in column[:-1])  # broken between groups
    assert [i for i, _ in column] == [0] + [-1] * (len(column) - 1)


def test_plan_command_draws_the_configs_into_its_chart(monkeypatch, tmp_path, capsys):
    drawn = []

    def keep(schedule, **kwargs):
        fig = gantt_figure(schedule, **kwargs)
        assert_legend_clear(fig)  # two columns here
        drawn.append((schedule, kwargs["configs"], legend_of(fig)))
        return fig

    monkeypatch.setattr(gantt, "gantt_figure", keep)
    parser = argparse.ArgumentParser()
    add_plan_arguments(parser)
    argv = [str(SPACES / "paper120.yaml"), "--model", "qwen2.5-7b", "--gpus", "8", "--gpu-memory-gib", "80"]
    assert run_plan(parser.parse_args([*argv, "--gantt", str(tmp_path / "g.png")])) == 0
    ((schedule, configs, labels),), out = drawn, capsys.readouterr().out
    assert len(configs) == 120 and "gantt chart" in out
    assert labels == [entry(pack, configs) for pack in schedule.packs]
    assert any(" × r8 a2/8/32 lr2e-5/1e-4/2e-4/4e-4 b" in t for t in labels)  # the grid's values, shortened
    assert (tmp_path / "g.png").stat().st_size > 10_000


@pytest.mark.parametrize(("gpus", "runs"), [([0, 1], [(0, 1)]), ([3], [(3, 3)]), ([2, 0, 1, 5], [(0, 2), (5, 5)])])
def test_gpu_runs(gpus, runs):
    assert gantt._runs(gpus) == runs
