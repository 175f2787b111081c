"""What flows between the study layer and the device workers: requests, tickets, outcomes.

Kept free of Optuna, MLflow and lm-eval so that the workers (and the GPU benchmarks that drive
them) import with torch alone.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from plora_hpo.adapter import AdapterConfig


class PackProgress:
    """Hooks a front end (the CLI's progress bars) gets called with; the default does nothing."""

    def pack_started(self, pack_id: str, n_adapters: int, total_steps: int) -> None: ...

    def pack_update(self, pack_id: str, steps: int, total_steps: int, n_adapters: int) -> None: ...

    def evaluating(self, pack_id: str) -> None: ...

    def trial_finished(self, outcome: TrialOutcome) -> None: ...

    def pack_finished(self, pack_id: str) -> None: ...


@dataclass
class TrialRequest:
    """One Optuna trial to train, and the hooks through which it talks back to its trial.

    Attributes:
        lineage: the trial this one continues after a crash (its checkpoint key); itself if new.
        run_id: an MLflow run to continue (the crashed predecessor's), if any.
        should_prune: reports an intermediate score at a step; True stops the trial.
        on_started: gets the trial's MLflow run id as soon as it joins a pack.
    """

    task: str
    number: int
    config: AdapterConfig
    lineage: int | None = None
    run_id: str | None = None
    should_prune: Callable[[int, float], bool] | None = None
    on_started: Callable[[str], None] | None = None

    def __post_init__(self) -> None:
        if self.lineage is None:
            self.lineage = self.number

    @property
    def adapter_id(self) -> str:
        return f"{self.task}-t{self.number}"


@dataclass
class TrialOutcome:
    """One trial's result: completed (value and metrics), pruned (``pruned_at``) or failed
    (``fail_reason``; value NaN, no adapter: it left its pack at a non-finite step)."""

    request: TrialRequest
    value: float
    metrics: dict[str, float]
    losses: list[float]
    run_id: str
    adapter_dir: Path | None
    pack_id: str
    tokens_per_second: float
    fail_reason: str | None = None
    pruned_at: int | None = None
    resumed_from: int = 0  # the step a crashed predecessor's checkpoint restarted it from
    intermediate: list[tuple[int, float]] = field(default_factory=list)

    @property
    def failed(self) -> bool:
        return self.fail_reason is not None

    @property
    def pruned(self) -> bool:
        return self.pruned_at is not None


class TrialTicket:
    """A queued request and, once a worker is done with it, its outcome or error."""

    def __init__(self, request: TrialRequest) -> None:
        self.request = request
        self.outcome: TrialOutcome | None = None
        self.error: BaseException | None = None
        self._done = threading.Event()

    def finish(self, outcome: TrialOutcome) -> None:
        self.outcome = outcome
        self._done.set()

    def fail(self, error: BaseException) -> None:
        self.error = error
        self._done.set()

    def wait(self) -> TrialOutcome:
        self._done.wait()
        if self.error is not None:
            raise self.error
        assert self.outcome is not None
        return self.outcome


class TrialInterrupted(Exception):
    """A trial was queued or training when the sweep closed; its checkpoint lets a rerun resume it."""
