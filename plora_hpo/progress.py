"""Rich progress bars for a sweep: trials done, and the steps of each pack in flight."""

from __future__ import annotations

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TaskID, TextColumn, TimeElapsedColumn

from plora_hpo.trials import PackProgress, TrialOutcome


class RichPackProgress(PackProgress):
    """A bar of the sweep's trials, a bar of steps per pack in flight, a line per finished trial."""

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
        self._packs: dict[str, TaskID] = {}  # one steps bar per pack in flight (one per device)

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

    def pack_started(self, pack_id: str, n_adapters: int, total_steps: int) -> None:
        self._packs[pack_id] = self._progress.add_task(
            f"{pack_id} steps", total=total_steps, info=f"{n_adapters} adapters"
        )

    def pack_update(self, pack_id: str, steps: int, total_steps: int, n_adapters: int) -> None:
        # the total grows when a freed slot takes a new trial (refill)
        self._progress.update(self._packs[pack_id], completed=steps, total=total_steps, info=f"{n_adapters} adapters")

    def evaluating(self, pack_id: str) -> None:
        self._progress.update(self._packs[pack_id], info="evaluating")

    def trial_finished(self, outcome: TrialOutcome) -> None:
        self._progress.advance(self._trials)
        config = outcome.request.config.label()
        if outcome.failed:
            result = f"FAILED ({outcome.fail_reason})"
        elif outcome.pruned:
            result = f"pruned at step {outcome.pruned_at} ({outcome.value:.4f})"
        else:
            result = f"{outcome.value:.4f}"
        resumed = f", resumed from step {outcome.resumed_from}" if outcome.resumed_from else ""
        self._progress.console.log(f"{outcome.pack_id}: trial {outcome.request.number} {config} = {result}{resumed}")

    def pack_finished(self, pack_id: str) -> None:
        self._progress.remove_task(self._packs.pop(pack_id))
