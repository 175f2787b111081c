"""Optuna integration: packed trials behind ``study.optimize`` and an explicit batch API.

``study.optimize(PackedObjective(sweep, task), n_trials=N, n_jobs=K)`` runs K objective calls
at once (Optuna's threads); each call suggests its config, then waits while a gatherer
collects the concurrent calls into one pack, trains and scores them together, and hands every
trial its own value. Training losses stream back to each trial through ``trial.report``.

Scripts that prefer explicit control use :func:`optimize_in_packs` (ask a batch, train it
packed, tell each result).
"""

from __future__ import annotations

import queue
import threading
import time
import warnings
from dataclasses import dataclass, field
from typing import Any

import optuna

from plora_hpo.config import SweepConfig
from plora_hpo.engine import StepReport
from plora_hpo.errors import ConfigError, PloraError
from plora_hpo.space import SearchSpace
from plora_hpo.sweep import PackedSweep, TrialOutcome, TrialRequest

REFERENCE_PARAMS = {"rank": 16, "alpha_multiplier": 1.0, "learning_rate": 2e-4, "batch_size": 2}
"""The common default (r 16, alpha 16, lr 2e-4, batch 2): the trial every sweep should beat."""


def make_sampler(config: SweepConfig, space: SearchSpace) -> optuna.samplers.BaseSampler:
    """The sweep file's sampler, seeded. TPE uses the constant liar so concurrent trials differ."""
    seed = config.seed
    if config.sampler == "grid":
        return optuna.samplers.GridSampler(space.grid(), seed=seed)
    if config.sampler == "tpe":
        return optuna.samplers.TPESampler(seed=seed, constant_liar=True, multivariate=True)
    if config.sampler == "gp":
        return optuna.samplers.GPSampler(seed=seed)
    return optuna.samplers.RandomSampler(seed=seed)


def study_name(config: SweepConfig, task: str) -> str:
    return f"{config.name}-{task}"


def create_study(config: SweepConfig, task: str, storage: str, *, recover_stale: bool = False) -> optuna.Study:
    """Create (or reopen, to resume) the task's study in ``storage``.

    The reference trial (:data:`REFERENCE_PARAMS`) is not enqueued: Optuna 5.0 on sqlite can hand
    one waiting trial to two ``study.optimize`` threads at once, and packs run with ``n_jobs > 1``.
    Grids that contain it (demo, paper120) train it anyway; the summary compares against it.

    ``recover_stale``: the caller owns the study (the CLI's sweep), so trials still RUNNING were
    left by a dead process; see :func:`recover_stale_trials`. Leave it off when other live
    processes may be running trials of the same study.
    """
    space = SearchSpace(config.space, seed=config.seed, use_rslora=config.train.use_rslora)
    try:
        study = optuna.create_study(
            study_name=study_name(config, task),
            storage=storage,
            sampler=make_sampler(config, space),
            direction="maximize",
            load_if_exists=True,
        )
    except Exception as err:  # SQLAlchemy/Optuna raise many kinds for a bad URL
        first = str(err).splitlines()[0][:200] if str(err) else type(err).__name__
        raise PloraError(
            f"cannot open the Optuna storage {storage!r} ({first}); pass --storage with a reachable database URL"
        ) from None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        study.set_metric_names([task_metric_name(task)])
    if recover_stale:
        recover_stale_trials(study)
    return study


def recover_stale_trials(study: optuna.Study) -> list[int]:
    """Fail every RUNNING trial and enqueue its params again, so a rerun retrains it.

    After a crash or ``kill -9`` the storage still holds the in-flight trials as RUNNING and
    nothing would ever finish them. Each one is told FAIL and a WAITING copy (same params and
    user attrs, plus ``retry_of``) is enqueued; :func:`finished_trials` does not count the
    failed original, so the rerun still reaches ``n_trials``. Returns the failed trial numbers.
    """
    stale = study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.RUNNING,))
    for trial in stale:
        params = trial.system_attrs.get("fixed_params") or trial.params
        study.tell(trial.number, state=optuna.trial.TrialState.FAIL)
        study.enqueue_trial(params, user_attrs={**trial.user_attrs, "retry_of": trial.number}, skip_if_exists=False)
    return [t.number for t in stale]


def finished_trials(study: optuna.Study) -> int:
    """Finished trials that count towards ``n_trials``: not those retried after a crash."""
    trials = study.get_trials(deepcopy=False)
    retried = {t.user_attrs["retry_of"] for t in trials if "retry_of" in t.user_attrs}
    return sum(t.state.is_finished() and t.number not in retried for t in trials)


def task_metric_name(task: str) -> str:
    from plora_hpo.tasks import get_task

    return f"{task}:{get_task(task).primary_metric}"


def default_n_trials(config: SweepConfig) -> int:
    space = SearchSpace(config.space)
    if config.n_trials is not None:
        return config.n_trials
    if space.is_grid:
        return space.grid_size()
    raise ConfigError("n_trials is required for a ranged search space; add 'n_trials: N' or pass --n-trials")


def record_outcome(trial: optuna.trial.BaseTrial, outcome: TrialOutcome) -> None:
    """What a trial keeps in the Optuna storage besides its value (links to MLflow and the adapter)."""
    trial.set_user_attr("mlflow_run_id", outcome.run_id)
    trial.set_user_attr("pack_id", outcome.pack_id)
    trial.set_user_attr("adapter_dir", str(outcome.adapter_dir))
    trial.set_user_attr("metrics", outcome.metrics)
    trial.set_user_attr("tokens_per_second", outcome.tokens_per_second)
    trial.set_user_attr("final_train_loss", outcome.losses[-1] if outcome.losses else None)


def record_failure(trial: optuna.trial.BaseTrial, outcome: TrialOutcome) -> None:
    """Why a trial failed (non-finite loss or gradient), next to its MLflow run."""
    trial.set_user_attr("fail_reason", outcome.fail_reason)
    trial.set_user_attr("mlflow_run_id", outcome.run_id)
    trial.set_user_attr("pack_id", outcome.pack_id)


# --- study.optimize -------------------------------------------------------------------------
_DONE = object()


@dataclass
class _Ticket:
    request: TrialRequest
    reports: queue.Queue = field(default_factory=queue.Queue)
    outcome: TrialOutcome | None = None
    error: BaseException | None = None


class _PackGatherer:
    """Collects concurrent trial requests into packs and runs each pack on a worker thread."""

    def __init__(self, sweep: PackedSweep, pack_size: int, gather_seconds: float) -> None:
        self.sweep = sweep
        self.pack_size = pack_size
        self.gather_seconds = gather_seconds
        self._inbox: queue.Queue[_Ticket] = queue.Queue()
        self._worker = threading.Thread(target=self._serve, name="plora-packs", daemon=True)
        self._worker.start()

    def submit(self, request: TrialRequest) -> _Ticket:
        ticket = _Ticket(request)
        request.on_report = ticket.reports.put
        self._inbox.put(ticket)
        return ticket

    def _gather(self) -> list[_Ticket]:
        batch = [self._inbox.get()]
        deadline = time.monotonic() + self.gather_seconds
        while len(batch) < self.pack_size:
            try:
                batch.append(self._inbox.get(timeout=max(0.0, deadline - time.monotonic())))
            except queue.Empty:
                break
        return batch

    @staticmethod
    def _finish(tickets: list[_Ticket], error: BaseException | None = None) -> None:
        for ticket in tickets:
            ticket.error = error
            ticket.reports.put(_DONE)

    def _serve(self) -> None:
        while True:
            gathered = self._gather()
            by_request = {id(t.request): t for t in gathered}
            try:
                packs = self.sweep.split_into_packs([t.request for t in gathered])
            except BaseException as err:  # delivered to every waiting trial
                self._finish(gathered, err)
                continue
            for pack in packs:
                tickets = [by_request[id(r)] for r in pack]
                try:
                    outcomes = self.sweep.run_pack(pack)
                except BaseException as err:  # delivered to every waiting trial of the pack
                    self._finish(tickets, err)
                    continue
                for ticket, outcome in zip(tickets, outcomes):
                    ticket.outcome = outcome
                self._finish(tickets)


class PackedObjective:
    """An Optuna objective whose concurrent calls train together as packs.

    Example:
        >>> objective = PackedObjective(sweep, task="synthetic")  # doctest: +SKIP
        >>> study.optimize(objective, n_trials=8, n_jobs=objective.pack_size)  # doctest: +SKIP
    """

    def __init__(
        self,
        sweep: PackedSweep,
        task: str,
        *,
        pack_size: int | None = None,
        gather_seconds: float | None = None,
    ) -> None:
        config = sweep.config
        self.sweep = sweep
        self.task = task
        self.space = SearchSpace(config.space, seed=config.seed, use_rslora=config.train.use_rslora)
        self.pack_size = pack_size or config.pack.size
        gather = config.pack.gather_seconds if gather_seconds is None else gather_seconds
        self._gatherer = _PackGatherer(sweep, self.pack_size, gather)

    def __call__(self, trial: optuna.Trial) -> float:
        config = self.space.suggest(trial)
        ticket = self._gatherer.submit(TrialRequest(self.task, trial.number, config))
        while (item := ticket.reports.get()) is not _DONE:
            report: StepReport = item
            trial.report(report.loss, report.step)
        if ticket.error is not None:
            raise ticket.error
        assert ticket.outcome is not None
        if ticket.outcome.failed:
            # Returning NaN makes Optuna mark just this trial FAIL (with a warning) and go on;
            # raising would stop study.optimize(catch=()) and with it the trials still to run.
            record_failure(trial, ticket.outcome)
            return float("nan")
        record_outcome(trial, ticket.outcome)
        return ticket.outcome.value


# --- explicit batches ---------------------------------------------------------------------------
def ask_batch(study: optuna.Study, space: SearchSpace, size: int) -> list[tuple[optuna.Trial, Any]]:
    """Ask ``size`` trials at once; returns (trial, AdapterConfig) pairs."""
    trials = [study.ask() for _ in range(size)]
    return [(trial, space.suggest(trial)) for trial in trials]


def optimize_in_packs(
    study: optuna.Study, sweep: PackedSweep, task: str, *, n_trials: int, pack_size: int
) -> list[TrialOutcome]:
    """Ask a batch, train it as one pack, tell every result; repeat until ``n_trials`` are done.

    A trial that turned non-finite is told FAIL (``fail_reason`` user attr) and still counts
    towards ``n_trials``; its outcome is returned with ``failed`` set.
    """
    config = sweep.config
    space = SearchSpace(config.space, seed=config.seed, use_rslora=config.train.use_rslora)
    outcomes: list[TrialOutcome] = []
    while len(outcomes) < n_trials:
        batch = ask_batch(study, space, min(pack_size, n_trials - len(outcomes)))
        requests = [TrialRequest(task, trial.number, cfg) for trial, cfg in batch]
        try:
            results = sweep.run_pack(requests)
        except BaseException:
            for trial, _ in batch:
                study.tell(trial, state=optuna.trial.TrialState.FAIL)
            raise
        for (trial, _), outcome in zip(batch, results):
            for step, loss in enumerate(outcome.losses, start=1):
                trial.report(loss, step)
            if outcome.failed:  # only this trial fails; the batch and the study go on
                record_failure(trial, outcome)
                study.tell(trial, state=optuna.trial.TrialState.FAIL)
                continue
            record_outcome(trial, outcome)
            _tell(study, trial, outcome.value)
        outcomes += results
    return outcomes


def _tell(study: optuna.Study, trial: optuna.Trial, value: float) -> None:
    """``study.tell`` that tolerates an exhausted grid.

    GridSampler calls ``study.stop()`` after the last grid point, which Optuna only allows inside
    ``optimize``; in ask-and-tell the trial is already stored when that raises, so it is safe
    to ignore.
    """
    try:
        study.tell(trial, value)
    except RuntimeError as err:
        if not (isinstance(study.sampler, optuna.samplers.GridSampler) and "Study.stop" in str(err)):
            raise
