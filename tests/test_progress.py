"""Without a terminal the sweep prints a progress line every so often instead of drawing bars."""

from __future__ import annotations

import io

from rich.console import Console

from plora_hpo.progress import RichPackProgress


def test_without_a_terminal_a_line_every_period_with_trials_steps_and_eta(clock):
    out = io.StringIO()
    progress = RichPackProgress(Console(file=out, force_terminal=False, width=200), period=60, clock=clock)
    with progress:
        progress.add_trials(8)
        progress.pack_started("pack-0", 4, 80)
        for step in range(1, 41):  # two minutes for half of the first four trials' steps
            clock.now += 3.0
            progress.pack_update("pack-0", step, 80, 4)
        progress.evaluating("pack-gone")  # an unknown pack is ignored, not a KeyError
        progress.pack_finished("pack-gone")
    lines = [line for line in out.getvalue().splitlines() if "trials" in line]
    assert len(lines) == 2  # at 60 s and at 120 s, not one per step
    assert lines[-1].startswith("[0:02:00] trials 0/8 done; pack-0 step 40/80 (4 adapters)")
    assert lines[-1].endswith("ETA 0:06:00")  # 2 of 8 trials' worth done in 2 minutes


def test_on_a_terminal_no_lines_are_printed_between_trials(clock):
    out = io.StringIO()
    progress = RichPackProgress(Console(file=out, force_terminal=True, width=200), period=60, clock=clock)
    progress.add_trials(1)
    progress.pack_started("pack-0", 1, 10)
    clock.now += 600
    progress.pack_update("pack-0", 5, 10, 1)
    assert "ETA" not in out.getvalue()
