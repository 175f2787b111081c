"""Rich progress bars for a sweep: trials done, and the steps of the pack in flight."""

from __future__ import annotations

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from plora_hpo.sweep import PackProgress, TrialOutcome


class RichPackProgress(PackProgress):
    """Two bars: trials of the sweep, and optimizer steps of the current pack."""

    def __init__(self, console: Console | None = None) -> None:
        self.console = console or Console(stderr=True)
        self._progress = Progress(
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TextColumn("{task.fields[info]}"),
            console=self.console,
        )
        self._trials = self._progress.add_task("trials", total=0, info="")
        self._steps = self._progress.add_task("pack steps", total=0, info="", visible=False)

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

    def pack_started(self, pack_id: str, n_adapters: int, steps: int) -> None:
        self._progress.reset(self._steps, total=steps, visible=True, info=f"{pack_id}: {n_adapters} adapters")

    def step_done(self) -> None:
        self._progress.advance(self._steps)

    def evaluating(self, pack_id: str) -> None:
        self._progress.update(self._steps, info=f"{pack_id}: evaluating")

    def pack_finished(self, pack_id: str, outcomes: list[TrialOutcome]) -> None:
        self._progress.advance(self._trials, len(outcomes))
        best = max(outcomes, key=lambda o: o.value)
        self._progress.console.log(
            f"{pack_id}: {len(outcomes)} adapters, {outcomes[0].tokens_per_second:,.0f} tokens/s, "
            f"best {best.request.config.label()} = {best.value:.4f}"
        )
