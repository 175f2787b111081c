"""What flows between the study layer and the device workers: requests, tickets, outcomes, and
the pool of trials proposed but not yet training.

Kept free of Optuna, MLflow and lm-eval so that the workers (and the GPU benchmarks that drive
them) import with torch alone.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from plora_hpo.adapter import AdapterConfig


class PackProgress:
    """Hooks a front end (the CLI's progress bars) gets called with; the default does nothing."""

    def note(self, message: str) -> None: ...

    def add_trials(self, n: int) -> None: ...

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
        """The adapter's name (folder, MLflow run, pack member), e.g. ``mrpc-t3-r16-a16-lr2e-04-b2``:
        the task, the trial lineage (a retry keeps its predecessor's) and the config, with a
        decimal point written ``p`` (``a25p6``): module names cannot hold dots."""
        return f"{self.task}-t{self.lineage}-{self.config.label()}".replace(".", "p")


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
    """A queued request and, once a worker is done with it, its outcome or error.

    A ticket is withdrawn (:meth:`withdraw`) when its trial is no longer this process's to train:
    another process finished it (failed it as stale and trains its retry). The worker holding it
    lets it go at its next step boundary, writing nothing of it: no checkpoint, no MLflow report,
    no adapter, since the retry continues that lineage and that run.
    """

    def __init__(self, request: TrialRequest) -> None:
        self.request = request
        self.outcome: TrialOutcome | None = None
        self.error: BaseException | None = None
        self.withdrawn: str | None = None
        """Why the trial is not this process's any more (None: it is)."""
        self._done = threading.Event()

    def finish(self, outcome: TrialOutcome) -> None:
        self.outcome = outcome
        self._done.set()

    def fail(self, error: BaseException) -> None:
        self.error = error
        self._done.set()

    def withdraw(self, reason: str) -> None:
        self.withdrawn = reason

    def done(self, timeout: float | None = None) -> bool:
        """Whether the outcome or error is in, waiting up to ``timeout`` seconds for it."""
        return self._done.wait(timeout)

    def wait(self) -> TrialOutcome:
        self._done.wait()
        if self.error is not None:
            raise self.error
        assert self.outcome is not None
        return self.outcome


class TrialInterrupted(Exception):
    """A trial was queued or training when the sweep closed; its checkpoint lets a rerun resume it."""


class TrialWithdrawn(Exception):
    """Another process finished the trial while this one held it (:meth:`TrialTicket.withdraw`)."""


class PoolClosed(Exception):
    """The sweep is closing: no more trials will be handed out."""


class TrialPool:
    """Trials proposed and not yet training, shared by every device worker.

    Workers do not pop in arrival order: each hands the whole waiting list to its admission
    policy and takes the trials it chose (:meth:`take`), atomically, so two workers never take
    one trial. A plan made for several idle workers at once leaves their packs reserved here
    until each claims one (:meth:`claim`). :attr:`version` counts changes, so a worker re-plans
    only when the pool changed.
    """

    def __init__(self) -> None:
        self._waiting: list[TrialTicket] = []
        self._reserved: list[list[TrialTicket]] = []  # packs planned for idle workers, not yet claimed
        self._cond = threading.Condition()
        self._closed = False
        self._idle = 0
        self.version = 0
        self.last_round = False  # every trial left to train has been proposed: those waiting are all there will be

    @property
    def closed(self) -> bool:
        with self._cond:
            return self._closed

    @property
    def idle_workers(self) -> int:
        """Workers blocked in :meth:`wait` right now (devices waiting for trials)."""
        with self._cond:
            return self._idle

    def put(self, ticket: TrialTicket) -> None:
        with self._cond:
            if self._closed:
                ticket.fail(TrialInterrupted(f"{ticket.request.adapter_id}: the sweep stopped before it started"))
                return
            self._waiting.append(ticket)
            self.version += 1
            self._cond.notify_all()

    def wait(self, *, at_least: int = 1, timeout: float | None = None) -> int:
        """Block until ``at_least`` trials wait or ``timeout`` passes; returns how many wait.

        Raises:
            PoolClosed: the sweep is closing.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while not self._closed and not self._reserved and len(self._waiting) < at_least:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    break
                self._idle += 1
                try:
                    self._cond.wait(left)
                finally:
                    self._idle -= 1
            if self._closed:
                raise PoolClosed
            return len(self._waiting)

    def take(
        self, choose: Callable[[Sequence[TrialTicket]], tuple[Sequence[int], Sequence[Sequence[int]]]]
    ) -> list[TrialTicket]:
        """Remove and return the waiting tickets ``choose`` picks; ``choose`` gets the waiting list
        and returns (indices for the caller, index groups to reserve as packs for idle workers).

        Raises:
            PoolClosed: the sweep is closing.
        """
        with self._cond:
            if self._closed:
                raise PoolClosed
            if not self._waiting:
                return []
            mine, groups = choose(list(self._waiting))
            picked = list(dict.fromkeys(mine))
            taken = [self._waiting[i] for i in picked]
            seen = set(picked)
            for group in groups:
                group = [i for i in dict.fromkeys(group) if i not in seen]
                seen.update(group)
                if group:
                    self._reserved.append([self._waiting[i] for i in group])
            for i in sorted(seen, reverse=True):
                del self._waiting[i]
            if seen:
                self.version += 1
                self._cond.notify_all()
            return taken

    def waiting(self) -> list[TrialTicket]:
        """The tickets waiting now, oldest first (a snapshot)."""
        with self._cond:
            return list(self._waiting)

    def take_ticket(self, ticket: TrialTicket) -> bool:
        """Take this waiting ticket; False if it waits no more (another worker took it).

        Raises:
            PoolClosed: the sweep is closing.
        """
        return bool(self.take(lambda waiting: ([i for i, t in enumerate(waiting) if t is ticket], [])))

    def withdraw(self, ticket: TrialTicket, reason: str) -> None:
        """Let go of a trial that another process took over: at once if it still waits here (its
        ticket gets :class:`TrialWithdrawn`), else at its worker's next step boundary
        (:meth:`TrialTicket.withdraw`)."""
        ticket.withdraw(reason)
        with contextlib.suppress(PoolClosed):  # closing: the sweep fails the tickets still waiting
            if self.take_ticket(ticket):
                ticket.fail(TrialWithdrawn(f"{ticket.request.adapter_id}: {reason}"))

    def claim(self) -> list[TrialTicket]:
        """A pack reserved for an idle worker (oldest first), or ``[]``.

        Raises:
            PoolClosed: the sweep is closing.
        """
        with self._cond:
            if self._closed:
                raise PoolClosed
            if not self._reserved:
                return []
            self.version += 1
            return self._reserved.pop(0)

    def close(self) -> list[TrialTicket]:
        """Stop handing out trials; returns (and forgets) the ones still waiting."""
        with self._cond:
            self._closed = True
            left, self._waiting = [t for group in self._reserved for t in group] + self._waiting, []
            self._reserved = []
            self._cond.notify_all()
            return left

    def reopen(self) -> None:
        with self._cond:
            self._closed = False
