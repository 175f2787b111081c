"""Reporters: where a trial's life and the pack decisions are recorded.

Device workers report through the :class:`TrialReporter` protocol and never see MLflow:
:class:`MlflowReporter` writes one child run per trial (params, loss curve, metrics, adapter)
under the sweep's parent run; :class:`NullReporter` records nothing, for benchmarks and tests
that drive workers without a tracking store. Both keep the pack decisions
(:class:`PackSegment`) that the sweep writes out at the end.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from plora_hpo.errors import first_line
from plora_hpo.pacing import SharePacer
from plora_hpo.timeline import phase
from plora_hpo.trials import TrialRequest

if TYPE_CHECKING:
    from plora_hpo.engine import PackStats
    from plora_hpo.tracking import SweepTracker

log = logging.getLogger(__name__)

LIVE_SHARE = 0.01
"""The largest share of a process's time that delivering live loss curves may take. Delivery is
Python on the process's own interpreter, and the training loop waits for the interpreter lock
while it runs; a live update that would exceed this share is skipped (a later one, or the run's
last report, logs the steps it held). A trial's curve at the end of its training is sent whatever
the share: the run's last report would log those rows anyway, later."""


class TrialRecord(Protocol):
    """What a reporter reads of a trial in a pack."""

    @property
    def request(self) -> TrialRequest: ...

    run_id: str
    curve: list[tuple[int, float, float]]  # (step, loss, lr)
    intermediate: list[tuple[int, float]]  # (step, score)
    resumed_from: int


@dataclass
class PackSegment:
    """A stretch of one pack with fixed membership: what admission decided and what it measured.

    Times are seconds since the sweep started. ``predicted_*`` come from the worker's cost
    model when the composition formed; ``measured_*`` from the steps it ran (``None`` before
    two steps, or on the CPU for memory). ``memory_limit_gib`` is the memory admission could
    fill on the device then: a share of what the process holds plus what nobody holds, so a
    pack smaller than the planner's shows whether the device had less room or the model
    predicted more.
    """

    pack_id: str
    device: str
    policy: str
    solver: str
    plan_seconds: float
    members: list[str]
    labels: list[str]
    joined: list[str]
    start: float
    end: float | None = None
    steps: int = 0
    predicted_step_seconds: float | None = None
    predicted_peak_gib: float | None = None
    memory_limit_gib: float | None = None
    measured_step_seconds: float | None = None
    measured_peak_gib: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class TrialReporter(Protocol):
    """The calls a device worker makes about its trials and packs."""

    def trial_started(self, request: TrialRequest, run_id: str | None, pack_id: str) -> str:
        """Open (or reopen ``run_id``, a crashed predecessor's) the trial's run; returns its id."""
        ...

    def trial_completed(
        self, record: TrialRecord, pack_id: str, metrics: dict[str, float], adapter_dir: Path, stats: PackStats
    ) -> Path:
        """Curve, intermediate scores, final metrics and the adapter artifact; the run ends FINISHED.

        Returns where the exported ``adapter_dir`` is kept from now on (the tracker may move it
        into its artifact store, so that it is stored once).
        """
        ...

    def trial_progress(self, record: TrialRecord) -> None:
        """The trial's curve so far, while it trains (steps already reported are not repeated)."""
        ...

    def trial_trained(self, record: TrialRecord) -> None:
        """Its training ended and its scoring comes next: the whole curve may go out now, beside
        the scoring, instead of with the run's last report after it."""
        ...

    def trial_pruned(self, record: TrialRecord, pack_id: str, step: int, metric: str) -> None: ...

    def trial_failed(self, record: TrialRecord, pack_id: str, reason: str) -> None: ...

    def trial_abandoned(self, run_id: str) -> None:
        """A trial met an unexpected error: its run ends FAILED (the trial gets the error)."""
        ...

    def trial_interrupted(self, record: TrialRecord) -> None:
        """The sweep stopped mid-trial (its checkpoint is saved): the curve so far, and the run
        ends KILLED until the trial's retry continues it."""
        ...

    def pack_segment(self, segment: PackSegment) -> None:
        """A pack composition ended (members joined or left, or the pack finished)."""
        ...


class _SegmentLog:
    """Thread-safe list of the sweep's pack segments, in the order they ended."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.segments: list[PackSegment] = []

    def pack_segment(self, segment: PackSegment) -> None:
        with self._lock:
            self.segments.append(segment)

    def close(self) -> None:
        """Deliver what is still pending (the sweep is done with this reporter)."""


class NullReporter(_SegmentLog):
    """Records pack segments only; trial runs get stand-in ids (``null-<adapter id>``)."""

    def trial_started(self, request: TrialRequest, run_id: str | None, pack_id: str) -> str:
        return run_id or f"null-{request.adapter_id}"

    def trial_completed(
        self, record: TrialRecord, pack_id: str, metrics: dict[str, float], adapter_dir: Path, stats: PackStats
    ) -> Path:
        return adapter_dir

    def trial_progress(self, record: TrialRecord) -> None:
        pass

    def trial_trained(self, record: TrialRecord) -> None:
        pass

    def trial_pruned(self, record: TrialRecord, pack_id: str, step: int, metric: str) -> None:
        pass

    def trial_failed(self, record: TrialRecord, pack_id: str, reason: str) -> None:
        pass

    def trial_abandoned(self, run_id: str) -> None:
        pass

    def trial_interrupted(self, record: TrialRecord) -> None:
        pass


class MlflowReporter(_SegmentLog):
    """One MLflow child run per trial under the tracker's parent run.

    Args:
        tracker: the sweep's tracker (parent run started).
        trial_params: a trial's MLflow params (its config and the sweep settings that shape it).
        primary_metric: a task's objective key in lm-eval's results (default: the built-in task's).
        clock: seconds, for the live curves' share of time (:data:`LIVE_SHARE`).
    """

    def __init__(
        self,
        tracker: SweepTracker,
        trial_params: Callable[[TrialRequest], dict[str, Any]],
        primary_metric: Callable[[str], str] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__()
        self._clock = clock
        self._live_pacer = SharePacer(LIVE_SHARE, clock)  # one unit per curve sent
        self.tracker = tracker
        self.trial_params = trial_params
        self.primary_metric = primary_metric or _builtin_primary
        self._logged: dict[str, dict[str, int]] = {}  # per run: the last step already logged per metric
        # live curves go out on a thread of their own: the training loop hands them over and goes on
        # run id -> its latest undelivered curve, and whether sending it counts against the share
        self._live: dict[str, tuple[list[tuple[int, float, float]], bool]] = {}
        self._live_sending: str | None = None
        self._live_closed = False
        self._live_changed = threading.Condition()
        self._live_thread = threading.Thread(target=self._deliver_live, name="mlflow-live-curves", daemon=True)
        self._live_thread.start()

    def trial_started(self, request: TrialRequest, run_id: str | None, pack_id: str) -> str:
        tags = {"plora.pack_id": pack_id, "plora.trial_number": str(request.number), "plora.task": request.task}
        run_id = run_id or self.tracker.find_trial_run(request.adapter_id)  # one run per adapter
        if run_id is not None and self.tracker.resume_trial(run_id, tags):
            logged = self.tracker.logged_steps(run_id)
            if logged:
                with self._lock:
                    self._logged[run_id] = logged
            return run_id
        return self.tracker.start_trial(request.adapter_id, self.trial_params(request), tags)

    def _log(
        self, run_id: str, rows: list[tuple[str, float, int]], *, done: bool = True, tags: dict[str, str] | None = None
    ) -> None:
        """Log the rows the run does not hold yet: those reported live, or a crashed predecessor's
        (a retry retrains logged steps), with ``tags`` in the same call. ``done``: the run's last
        report, forget what it holds (its live curve still waiting is dropped, one being sent is
        waited for)."""
        if done:
            with self._live_changed:
                self._live.pop(run_id, None)
                while self._live_sending == run_id:
                    self._live_changed.wait()
        with self._lock:
            logged = self._logged.pop(run_id, {}) if done else self._logged.get(run_id, {})
            new = [r for r in rows if r[0] not in logged or r[2] > logged[r[0]]]
        self.tracker.log_metrics(run_id, new, tags)
        if not done:  # only rows the store took: a rejected live curve is the last report's to log
            with self._lock:
                logged = self._logged.setdefault(run_id, {})
                for key, _, step in new:
                    logged[key] = max(step, logged.get(key, step))

    def trial_progress(self, record: TrialRecord) -> None:
        with self._live_changed:
            if record.run_id not in self._live and not self._live_pacer.affordable(1):
                return  # replacing a waiting curve costs nothing; sending one more would
            self._live[record.run_id] = (list(record.curve), True)  # replaces an older curve not yet sent
            self._live_changed.notify_all()

    def trial_trained(self, record: TrialRecord) -> None:
        """Queued for the live thread outside the share: the run's last report would log these rows
        anyway, after the scoring; sent now, they overlap it."""
        with self._live_changed:
            self._live[record.run_id] = (list(record.curve), False)
            self._live_changed.notify_all()

    def _deliver_live(self) -> None:
        while True:
            with self._live_changed:
                while not self._live and not self._live_closed:
                    self._live_changed.wait()
                if not self._live:
                    return
                run_id = next(iter(self._live))
                curve, paced = self._live.pop(run_id)
                self._live_sending = run_id
            started = self._clock()
            try:
                with phase("mlflow-live"):  # its own thread's, beside the training loop
                    self._log(run_id, curve_rows(curve), done=False)
            except Exception as err:  # a live view only: the run's last report logs the whole curve
                log.warning("the live loss curve of MLflow run %s was not logged: %s", run_id, first_line(err))
            finally:
                with self._live_changed:
                    if paced:
                        self._live_pacer.record(1, self._clock() - started)
                    self._live_sending = None
                    self._live_changed.notify_all()

    def flush(self) -> None:
        """Wait until every live curve handed over so far is logged."""
        with self._live_changed:
            while self._live or self._live_sending is not None:
                self._live_changed.wait()

    def close(self) -> None:
        with self._live_changed:
            self._live_closed = True
            self._live_changed.notify_all()
        self._live_thread.join()

    def trial_completed(
        self, record: TrialRecord, pack_id: str, metrics: dict[str, float], adapter_dir: Path, stats: PackStats
    ) -> Path:
        metric = self.primary_metric(record.request.task)
        rows = curve_rows(record.curve) + intermediate_rows(record.intermediate, metric)
        rows += [(metric_key(k), v, 0) for k, v in metrics.items()]
        rows.append(("pack_tokens_per_second", stats.tokens_per_second, 0))
        rows.append(("pack_peak_memory_gib", stats.peak_memory_bytes / 2**30, 0))
        self._log(record.run_id, rows, tags=_end_tags(record, "COMPLETE"))
        kept = self.tracker.log_adapter(record.run_id, adapter_dir)
        self.tracker.end_trial(record.run_id)
        return kept

    def trial_pruned(self, record: TrialRecord, pack_id: str, step: int, metric: str) -> None:
        rows = curve_rows(record.curve) + intermediate_rows(record.intermediate, metric)
        self._log(record.run_id, rows, tags={**_end_tags(record, "PRUNED"), "plora.pruned_at_step": str(step)})
        self.tracker.end_trial(record.run_id, "KILLED")

    def trial_failed(self, record: TrialRecord, pack_id: str, reason: str) -> None:
        tags = {**_end_tags(record, "FAIL"), "plora.fail_reason": reason}
        self._log(record.run_id, curve_rows(record.curve), tags=tags)
        self.tracker.end_trial(record.run_id, "FAILED")

    def trial_abandoned(self, run_id: str) -> None:
        self.tracker.end_trial(run_id, "FAILED")

    def trial_interrupted(self, record: TrialRecord) -> None:
        interrupted = {"plora.interrupted": "checkpointed; its retry continues this run"}
        self._log(record.run_id, curve_rows(record.curve), tags=interrupted)
        self.tracker.end_trial(record.run_id, "KILLED")


def _builtin_primary(task: str) -> str:
    from plora_hpo.tasks import get_task

    return get_task(task).primary_metric


def _end_tags(record: TrialRecord, state: str) -> dict[str, str]:
    return {"plora.state": state, "plora.resumed_from_step": str(record.resumed_from)}


def curve_rows(steps: list[tuple[int, float, float]]) -> list[tuple[str, float, int]]:
    """MLflow rows of one adapter's per-step (step, loss, lr) records."""
    return [("train_loss", loss, step) for step, loss, _ in steps] + [
        ("learning_rate", lr, step) for step, _, lr in steps
    ]


def intermediate_rows(scores: list[tuple[int, float]], metric: str) -> list[tuple[str, float, int]]:
    return [(f"intermediate_{metric_key(metric)}", value, step) for step, value in scores]


def metric_key(lm_eval_key: str) -> str:
    """MLflow names cannot hold commas: ``exact_match,flexible-extract`` → ``exact_match/flexible-extract``."""
    name, _, filt = lm_eval_key.partition(",")
    return name if filt in ("", "none") else f"{name}/{filt}"
