"""Progress of a sweep: trials done, and the steps of each pack in flight.

On a terminal these are rich progress bars. Without one (output redirected to a file, a batch
job) bars are not drawn, so a line is printed at most every ``period`` seconds instead: trials
done, each pack's steps, adapters and tokens per second, and an estimate of the time left.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TaskID, TextColumn, TimeElapsedColumn

from plora_hpo.trials import PackProgress, TrialOutcome


class RichPackProgress(PackProgress):
    """A bar of the sweep's trials, a bar of steps per pack in flight, a line per finished trial."""

    def __init__(
        self, console: Console | None = None, *, period: float = 60.0, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.console = console or Console(stderr=True)
        self._progress = Progress(
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TextColumn("{task.fields[info]}"),
            console=self.console,
            disable=not self.console.is_terminal,
        )
        self._trials = self._progress.add_task("trials", total=0, info="")
        self._packs: dict[str, TaskID] = {}  # one steps bar per pack in flight (one per device)
        self._lines = None if self.console.is_terminal else _ProgressLines(self.console, period, clock)

    def __enter__(self) -> RichPackProgress:
        self._progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._progress.stop()

    def note(self, message: str) -> None:
        self._progress.console.log(message)

    def add_trials(self, n: int) -> None:
        total = self._progress.tasks[self._trials].total or 0
        self._progress.update(self._trials, total=total + n)
        if self._lines is not None:
            self._lines.total += n

    def pack_started(self, pack_id: str, n_adapters: int, total_steps: int) -> None:
        self._packs[pack_id] = self._progress.add_task(
            f"{pack_id} steps", total=total_steps, info=f"{n_adapters} adapters"
        )

    def pack_update(self, pack_id: str, steps: int, total_steps: int, n_adapters: int) -> None:
        # the total grows when a freed slot takes a new trial (refill)
        if pack_id in self._packs:
            self._progress.update(
                self._packs[pack_id], completed=steps, total=total_steps, info=f"{n_adapters} adapters"
            )
        if self._lines is not None:
            self._lines.update(pack_id, steps, total_steps, n_adapters)

    def evaluating(self, pack_id: str) -> None:
        if pack_id in self._packs:
            self._progress.update(self._packs[pack_id], info="evaluating")

    def trial_finished(self, outcome: TrialOutcome) -> None:
        self._progress.advance(self._trials)
        if self._lines is not None:
            self._lines.done += 1
        config = outcome.request.config.label()
        if outcome.failed:
            result = f"FAILED ({outcome.fail_reason})"
        elif outcome.pruned:
            result = f"pruned at step {outcome.pruned_at} ({outcome.value:.4f})"
        else:
            result = f"{outcome.value:.4f}"
        resumed = f", resumed from step {outcome.resumed_from}" if outcome.resumed_from else ""
        self._progress.console.log(f"{outcome.pack_id}: trial {outcome.request.number} {config} = {result}{resumed}")
        if self._lines is not None and outcome.tokens_per_second:
            self._lines.tokens_per_second[outcome.pack_id] = outcome.tokens_per_second

    def pack_finished(self, pack_id: str) -> None:
        task = self._packs.pop(pack_id, None)
        if task is not None:
            self._progress.remove_task(task)
        if self._lines is not None:
            self._lines.packs.pop(pack_id, None)


class _ProgressLines:
    """One plain progress line at most every ``period`` seconds, for output without a terminal."""

    def __init__(self, console: Console, period: float, clock: Callable[[], float]) -> None:
        self.console, self.period, self.clock = console, period, clock
        self.started = self.last = clock()
        self.total = 0
        self.done = 0
        self.packs: dict[str, tuple[int, int, int]] = {}  # pack -> (steps, total steps, adapters)
        self.tokens_per_second: dict[str, float] = {}

    def update(self, pack_id: str, steps: int, total_steps: int, n_adapters: int) -> None:
        self.packs[pack_id] = (steps, total_steps, n_adapters)
        now = self.clock()
        if now - self.last >= self.period:
            self.last = now
            self.console.print(self.line(now), soft_wrap=True, highlight=False)

    def line(self, now: float) -> str:
        elapsed = now - self.started
        packs = ", ".join(
            f"{pack} step {steps}/{total} ({n} adapters"
            + (f", {self.tokens_per_second[pack]:,.0f} tok/s" if pack in self.tokens_per_second else "")
            + ")"
            for pack, (steps, total, n) in sorted(self.packs.items())
        )
        in_flight = sum(n * steps / total for steps, total, n in self.packs.values() if total)  # trials' worth
        fraction = min(1.0, (self.done + in_flight) / self.total) if self.total else 0.0
        eta = f"ETA {_duration(elapsed * (1 - fraction) / fraction)}" if fraction > 0 else "ETA unknown"
        return f"[{_duration(elapsed)}] trials {self.done}/{self.total} done; {packs or 'no pack training'}; {eta}"


def _duration(seconds: float) -> str:
    minutes, secs = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}"
