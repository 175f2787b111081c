"""Optuna integration: packed trials behind ``study.optimize`` and an explicit batch API.

``study.optimize(PackedObjective(sweep, task), n_trials=N, n_jobs=sweep.concurrency)`` runs
that many objective calls at once (Optuna's threads); each call suggests its config and waits
while the sweep's device workers train it in a pack with the other calls' trials, score it and
hand it its value. With a pruner, intermediate eval scores go to ``trial.report`` and a pruned
trial's slot trains the next trial at once.

Scripts that prefer explicit control use :func:`optimize_in_packs` (ask a batch, train it
packed, tell each result).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import warnings
from pathlib import Path
from typing import Any

import optuna

from plora_hpo.adapter import AdapterConfig
from plora_hpo.config import SweepConfig
from plora_hpo.errors import ConfigError, disk_full, first_line
from plora_hpo.grid import OrderedGridSampler
from plora_hpo.space import SearchSpace
from plora_hpo.storage import (
    HEARTBEAT_SECONDS,
    SweepStorage,
    TrialBudgetReached,
    fail_stale_trials,
    open_storage,
    requeue,
)
from plora_hpo.sweep import PackedSweep
from plora_hpo.tasks import Direction, TaskSpec
from plora_hpo.trials import TrialInterrupted, TrialOutcome, TrialRequest, TrialTicket, TrialWithdrawn

log = logging.getLogger(__name__)

FINAL_LOSS_STEPS = 10
"""The final training loss a trial records is the mean over its last this many steps: one step's
loss is one batch of a few examples, too noisy to compare configs by."""

REFERENCE_PARAMS = {"rank": 16, "alpha_multiplier": 1.0, "learning_rate": 2e-4, "batch_size": 2}
"""The common default (r 16, alpha 16, lr 2e-4, batch 2): the trial every sweep should beat."""


def make_sampler(config: SweepConfig, space: SearchSpace) -> optuna.samplers.BaseSampler:
    """The sweep file's sampler, seeded. TPE uses the constant liar so concurrent trials differ."""
    seed = config.seed
    if config.sampler == "grid":
        return OrderedGridSampler(space.grid(), seed=seed)
    if config.sampler == "tpe":
        return optuna.samplers.TPESampler(seed=seed, constant_liar=True, multivariate=True)
    if config.sampler == "gp":
        return optuna.samplers.GPSampler(seed=seed)
    return optuna.samplers.RandomSampler(seed=seed)


def make_pruner(config: SweepConfig) -> optuna.pruners.BasePruner:
    """The sweep file's pruner; steps are each adapter's optimizer steps."""
    p = config.pruning
    first = max(p.interval, p.warmup_steps)
    if p.pruner == "median":
        return optuna.pruners.MedianPruner(n_warmup_steps=p.warmup_steps, interval_steps=p.interval)
    if p.pruner == "asha":
        return optuna.pruners.SuccessiveHalvingPruner(min_resource=first, reduction_factor=3)
    if p.pruner == "hyperband":
        return optuna.pruners.HyperbandPruner(min_resource=first, reduction_factor=3)
    return optuna.pruners.NopPruner()


def study_name(config: SweepConfig, task: str) -> str:
    return f"{config.name}-{task}"


def create_study(
    config: SweepConfig, task: str, storage: str | SweepStorage, *, heartbeat: float = HEARTBEAT_SECONDS
) -> optuna.Study:
    """Create (or reopen, to resume or join) the task's study in ``storage`` (a URL, or a storage
    :func:`~plora_hpo.storage.open_storage` already opened).

    The storage records a heartbeat of every trial in training every ``heartbeat`` seconds (for a
    URL; an opened storage keeps its own), so processes sharing it re-run the trials of one that
    died (:mod:`plora_hpo.storage`).
    The reference trial (:data:`REFERENCE_PARAMS`) is not enqueued: grids that contain it (demo,
    paper120) train it anyway; the summary compares against it.

    Trials a dead process left unfinished are recovered by the study's owner
    (:class:`~plora_hpo.run.SweepRun`) or by heartbeat, never here: other live processes may be
    running them.
    """
    from plora_hpo.tasks import resolve_task

    spec = resolve_task(task, config.custom_tasks)
    space = SearchSpace(config.space, seed=config.seed, use_rslora=config.train.use_rslora)
    study = optuna.create_study(
        study_name=study_name(config, task),
        storage=open_storage(storage, heartbeat=heartbeat) if isinstance(storage, str) else storage,
        sampler=make_sampler(config, space),
        pruner=make_pruner(config),
        directions=[direction for _, direction in objectives(config, spec)],
        load_if_exists=True,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        study.set_metric_names([name for name, _ in objectives(config, spec)])
    return study


def queue_grid(study: optuna.Study, n_trials: int) -> int:
    """Enqueue the grid points of a grid study up to ``n_trials`` (see
    :meth:`~plora_hpo.grid.OrderedGridSampler.queue`); other samplers propose as they go. Returns
    how many were enqueued."""
    if isinstance(study.sampler, OrderedGridSampler):
        return study.sampler.queue(study, n_trials)
    return 0


def recover_stale_trials(study: optuna.Study) -> list[int]:
    """Fail every trial a dead or interrupted run left unfinished and enqueue it again.

    Only for a study no live process serves (its owner checked that): after a crash or
    ``kill -9`` the storage still holds the in-flight trials as RUNNING and nothing would ever
    finish them; after an interrupt they are FAIL with the user attr ``interrupted``. Each is
    (told FAIL and) re-queued with its grid point, lineage and MLflow run
    (:func:`~plora_hpo.storage.requeue`). :func:`finished_trials` does not count the original.
    Returns the recovered trial numbers.
    """
    trials = study.get_trials(deepcopy=False)
    retried = {t.user_attrs["retry_of"] for t in trials if "retry_of" in t.user_attrs}
    stale = [
        t
        for t in trials
        if t.state == optuna.trial.TrialState.RUNNING
        or (t.state == optuna.trial.TrialState.FAIL and t.user_attrs.get("interrupted") and t.number not in retried)
    ]
    for trial in stale:
        if trial.state == optuna.trial.TrialState.RUNNING:
            _tell(study, trial.number, state=optuna.trial.TrialState.FAIL)
        requeue(study, trial)
    return [t.number for t in stale]


def lineage_of(trial: optuna.trial.BaseTrial) -> int:
    """The lineage a trial trains in (its checkpoint key): its predecessor's for a retry, else its own number."""
    return trial.user_attrs.get("lineage", trial.number)


def settled_lineages(study: optuna.Study) -> set[int]:
    """Lineages that will not train again: a trial of theirs has its result (complete, pruned,
    or failed on a non-finite loss or gradient) and none waits or runs. Their checkpoints are no
    longer needed; a process stopped after a trial's result and before the removal of its
    checkpoint leaves one behind."""
    states = optuna.trial.TrialState
    trials = study.get_trials(deepcopy=False)
    live = {lineage_of(t) for t in trials if t.state in (states.WAITING, states.RUNNING)}
    settled = {
        lineage_of(t)
        for t in trials
        if t.state in (states.COMPLETE, states.PRUNED) or (t.state == states.FAIL and "fail_reason" in t.user_attrs)
    }
    return settled - live


def serve(study: optuna.Study, objective: PackedObjective, *, n_trials: int, poll_seconds: float = 1.0) -> None:
    """Train the study's trials in this process until ``n_trials`` are finished, by any process.

    Each round takes the waiting trials (retries, enqueued grid points) and asks the sampler for
    as many new ones as are still missing, all through ``study.optimize`` with
    ``n_jobs`` = the sweep's concurrency (so Optuna's heartbeat covers every trial, and trials
    of dead processes are failed and re-queued as rounds start). When nothing is left to take
    but other processes still train trials, it waits: one of them may die and leave retries.

    Once a round has proposed its last trial, the sweep's pool holds every trial left
    (:attr:`~plora_hpo.trials.TrialPool.last_round`), so a full pack may rotate them
    (``pack.rotate``).

    A trial that another process failed as stale while this one trained it (its heartbeats had
    lapsed) has its retry queued; this process lets it go once it sees that (it looks at the
    trial's state as often as it records its heartbeat), and Optuna refuses any result for it,
    which ends that round; the next round goes on with the trials left
    (:attr:`PackedObjective.taken_over`).
    """
    n_jobs = objective.sweep.concurrency
    objective.warn_if_serial = False  # n_jobs below is as many as there are trials to do
    try:
        while True:
            fail_stale_trials(study)
            trials = study.get_trials(deepcopy=False)
            retried = {t.user_attrs["retry_of"] for t in trials if "retry_of" in t.user_attrs}
            live = [t for t in trials if t.number not in retried]
            waiting = sum(t.state == optuna.trial.TrialState.WAITING for t in live)
            running = sum(t.state == optuna.trial.TrialState.RUNNING for t in live)
            finished = sum(t.state.is_finished() for t in live)
            todo = waiting + max(0, n_trials - finished - running - waiting)
            if todo:
                objective.expect_calls(todo)
                taken = len(objective.taken_over)
                try:
                    with contextlib.suppress(TrialBudgetReached):  # other processes took what this one would ask
                        study.optimize(objective, n_trials=todo, n_jobs=min(n_jobs, todo), catch=())
                except ValueError as err:  # "Cannot tell a FAIL trial": a trial taken over meanwhile
                    if len(objective.taken_over) == taken:
                        raise
                    log.warning(
                        "trials %s were failed as stale by another process while this one trained them "
                        "(their heartbeats had lapsed: %s); their retries train them",
                        objective.taken_over[taken:],
                        first_line(err),
                    )
            elif running:
                time.sleep(poll_seconds)
            else:
                return
    finally:
        objective.expect_calls(None)


def finished_trials(study: optuna.Study) -> int:
    """Finished trials that count towards ``n_trials``: not those retried after a crash."""
    trials = study.get_trials(deepcopy=False)
    retried = {t.user_attrs["retry_of"] for t in trials if "retry_of" in t.user_attrs}
    return sum(t.state.is_finished() and t.number not in retried for t in trials)


OBJECTIVE_DIRECTIONS: dict[str, Direction] = {"adapter_params": "minimize", "pack_tokens_per_second": "maximize"}
"""The fixed direction of each objective besides the task's metric."""


def objectives(config: SweepConfig, spec: TaskSpec) -> list[tuple[str, Direction]]:
    """The study's objectives in order, each with its direction: ``("cola:mcc,none", "maximize")``
    for the task's metric, then the sweep file's other objectives (multi-objective studies)."""
    return [
        (f"{spec.name}:{spec.primary_metric}", spec.direction) if name == "task" else (name, OBJECTIVE_DIRECTIONS[name])
        for name in config.objectives
    ]


def trial_values(config: SweepConfig, outcome: TrialOutcome, adapter_params: int) -> float | list[float]:
    """What Optuna is told of a trial: the task's score, or one value per objective (a failed
    trial's score is NaN, which Optuna records as FAIL)."""
    values = {
        "task": outcome.value,
        "adapter_params": float(adapter_params),
        "pack_tokens_per_second": outcome.tokens_per_second,
    }
    picked = [values[name] for name in config.objectives]
    return picked[0] if len(picked) == 1 else picked


def adapter_params(sweep: PackedSweep, config: AdapterConfig) -> int:
    """Trainable parameters of a trial's adapter on the sweep's base model and target modules."""
    return sweep.base.shape.lora_params(config.rank, tuple(sweep.config.target_modules))


def default_n_trials(config: SweepConfig) -> int:
    space = SearchSpace(config.space)
    if config.n_trials is not None:
        return config.n_trials
    if space.is_grid:
        return space.grid_size()
    raise ConfigError("n_trials is required for a ranged search space; add 'n_trials: N' or pass --n-trials")


def record_outcome(trial: optuna.trial.BaseTrial, outcome: TrialOutcome, params: int) -> None:
    """What a trial keeps in the Optuna storage besides its value (links to MLflow and the adapter,
    and the adapter's ``params``: trainable parameters)."""
    trial.set_user_attr("mlflow_run_id", outcome.run_id)
    trial.set_user_attr("adapter_params", params)
    trial.set_user_attr("pack_id", outcome.pack_id)
    trial.set_user_attr("adapter_dir", str(Path(outcome.adapter_dir).resolve()) if outcome.adapter_dir else None)
    trial.set_user_attr("metrics", outcome.metrics)
    trial.set_user_attr("tokens_per_second", outcome.tokens_per_second)
    last = outcome.losses[-FINAL_LOSS_STEPS:]
    trial.set_user_attr("final_train_loss", sum(last) / len(last) if last else None)
    trial.set_user_attr("final_train_loss_steps", len(last))
    trial.set_user_attr("resumed_from_step", outcome.resumed_from)
    if outcome.pruned:
        trial.set_user_attr("pruned_at_step", outcome.pruned_at)


def record_failure(trial: optuna.trial.BaseTrial, outcome: TrialOutcome) -> None:
    """Why a trial failed (non-finite loss or gradient), next to its MLflow run."""
    trial.set_user_attr("fail_reason", outcome.fail_reason)
    trial.set_user_attr("mlflow_run_id", outcome.run_id)
    trial.set_user_attr("pack_id", outcome.pack_id)


# --- study.optimize -------------------------------------------------------------------------
def trial_request(trial: optuna.Trial, task: str, config: Any, pruning: bool) -> TrialRequest:
    """A trial's request, wired back to the trial: its MLflow run id lands in its user attrs as
    soon as it trains, and (with a pruner) each intermediate score goes to ``trial.report``.

    A retry of a crashed trial carries its predecessor's ``lineage`` and ``mlflow_run_id`` (see
    :func:`recover_stale_trials`), so it continues that checkpoint and that MLflow run.
    """
    lineage = lineage_of(trial)
    if "lineage" not in trial.user_attrs:
        trial.set_user_attr("lineage", lineage)

    # Both run on the worker's thread. Another process may have finished the trial meanwhile
    # (taken it over): Optuna refuses the write, and the objective lets the trial go.
    def should_prune(step: int, value: float) -> bool:
        try:
            trial.report(value, step)
        except optuna.exceptions.UpdateFinishedTrialError:
            return False
        return trial.should_prune()

    def on_started(run_id: str) -> None:
        with contextlib.suppress(optuna.exceptions.UpdateFinishedTrialError):
            trial.set_user_attr("mlflow_run_id", run_id)

    return TrialRequest(
        task,
        trial.number,
        config,
        lineage=lineage,
        run_id=trial.user_attrs.get("mlflow_run_id"),
        should_prune=should_prune if pruning else None,
        on_started=on_started,
    )


class PackedObjective:
    """An Optuna objective whose concurrent calls train together as packs.

    Each call suggests its config and queues it on the sweep; the device workers pack queued
    trials together and refill a pack's free slots (a finished, pruned or failed adapter's) with
    the next queued trial. Run it with ``n_jobs`` = :attr:`PackedSweep.concurrency` so that
    enough trials are in flight to fill every device's pack.

    Example:
        >>> objective = PackedObjective(sweep, task="synthetic")  # doctest: +SKIP
        >>> study.optimize(objective, n_trials=8, n_jobs=sweep.concurrency)  # doctest: +SKIP
    """

    def __init__(self, sweep: PackedSweep, task: str) -> None:
        config = sweep.config
        self.sweep = sweep
        self.task = task
        self.space = SearchSpace(config.space, seed=config.seed, use_rslora=config.train.use_rslora)
        self.pruning = config.pruning.pruner != "none"
        self.warn_if_serial = True
        """Warn once when ``study.optimize`` calls this in its caller's thread (``n_jobs=1``) while
        the sweep could train more trials at once; :func:`serve` turns it off, as it passes
        ``n_jobs=1`` only for the last trial to do."""
        self._calls_left: int | None = None  # calls the current round of serve() still makes
        self._calls_lock = threading.Lock()
        self.taken_over: list[int] = []
        """Trials another process finished while this one trained them: it failed them as stale
        (their heartbeats had lapsed) and queued their retries. This process let them go, Optuna
        refuses any result for them, and :func:`serve` goes on with the trials left."""

    def expect_calls(self, calls: int | None) -> None:
        """The next ``calls`` calls are all there will be (None: unknown): once the last of them
        has queued its trial, the sweep's pool holds every trial left to train."""
        with self._calls_lock:
            self._calls_left = calls
            self.sweep.pool.last_round = calls == 0

    def _called(self) -> None:
        with self._calls_lock:
            if self._calls_left is not None and self._calls_left > 0:
                self._calls_left -= 1
                self.sweep.pool.last_round = self._calls_left == 0

    def __call__(self, trial: optuna.Trial) -> float | list[float]:
        if self.warn_if_serial and self.sweep.concurrency > 1 and threading.current_thread() is threading.main_thread():
            self.warn_if_serial = False  # study.optimize runs n_jobs=1 in the caller's thread, more in a pool
            warnings.warn(
                "study.optimize(..., n_jobs=1) hands the sweep one trial at a time, so every pack trains "
                f"one adapter; pass n_jobs=sweep.concurrency ({self.sweep.concurrency}) to train them together",
                UserWarning,
                stacklevel=2,
            )
        config = self.space.suggest(trial)
        params = adapter_params(self.sweep, config)
        try:
            ticket = self.sweep.submit(trial_request(trial, self.task, config, self.pruning))
            self._called()
            outcome = self._await(trial, ticket)
            if outcome.pruned:
                record_outcome(trial, outcome, params)
                raise optuna.TrialPruned(f"pruned at step {outcome.pruned_at} ({outcome.value:.4f})")
            if outcome.failed:
                # Returning NaN makes Optuna mark just this trial FAIL (with a warning) and go on;
                # raising would stop study.optimize(catch=()) and with it the trials still to run.
                record_failure(trial, outcome)
            else:
                record_outcome(trial, outcome, params)
        except (optuna.exceptions.UpdateFinishedTrialError, TrialWithdrawn):
            self.taken_over.append(trial.number)  # one append: atomic beside the other calls' threads
            raise
        except Exception as err:
            # The sweep stopped (closed, preempted) or a disk filled, here or in what recorded the
            # trial: any process serving the study resumes it. A FAIL would count as done.
            if not isinstance(err, TrialInterrupted) and disk_full(err) is None:
                raise
            try:
                trial.set_user_attr("interrupted", True)
                requeue(trial.study, trial.study._storage.get_trial(trial._trial_id))
            except Exception as refused:  # the storage refused too (full): the trial stays RUNNING, a rerun recovers it
                log.info("trial %d: cannot queue its retry (%s)", trial.number, first_line(refused))
            raise
        return trial_values(self.sweep.config, outcome, params)

    def _await(self, trial: optuna.Trial, ticket: TrialTicket) -> TrialOutcome:
        """The trial's outcome. Meanwhile, as often as its heartbeat is recorded, a look at its state
        in the storage: a trial that another process finished (failed as stale after its heartbeats
        lapsed, its retry queued) is withdrawn, and its worker lets it go at its next step boundary
        instead of training it beside its retry (:meth:`~plora_hpo.trials.TrialPool.withdraw`)."""
        storage = trial.study._storage
        interval = getattr(storage, "get_heartbeat_interval", lambda: None)()
        while interval is not None and not ticket.done(interval):
            try:
                state = storage.get_trial(trial._trial_id).state
            except Exception as err:  # a storage outage: the trial's next write meets it
                log.info("trial %d: its state could not be read (%s)", trial.number, first_line(err))
                continue
            if state != optuna.trial.TrialState.RUNNING:
                self.sweep.pool.withdraw(ticket, f"another process set trial {trial.number} {state.name}")
                break
        return ticket.wait()


# --- explicit batches ---------------------------------------------------------------------------
def ask_batch(study: optuna.Study, space: SearchSpace, size: int) -> list[tuple[optuna.Trial, Any]]:
    """Ask ``size`` trials at once; returns (trial, AdapterConfig) pairs."""
    with warnings.catch_warnings():  # the study's heartbeat serves study.optimize; this is ask-and-tell
        warnings.filterwarnings("ignore", "Heartbeat of storage", UserWarning)
        trials = [study.ask() for _ in range(size)]
    return [(trial, space.suggest(trial)) for trial in trials]


def optimize_in_packs(
    study: optuna.Study, sweep: PackedSweep, task: str, *, n_trials: int, pack_size: int
) -> list[TrialOutcome]:
    """Ask a batch, train it as one pack, tell every result; repeat until ``n_trials`` are done.

    A trial that turned non-finite is told FAIL (``fail_reason`` user attr), one its pruner
    stopped is told PRUNED; both count towards ``n_trials`` and are returned with their flag set.
    """
    config = sweep.config
    space = SearchSpace(config.space, seed=config.seed, use_rslora=config.train.use_rslora)
    pruning = config.pruning.pruner != "none"
    outcomes: list[TrialOutcome] = []
    while len(outcomes) < n_trials:
        batch = ask_batch(study, space, min(pack_size, n_trials - len(outcomes)))
        requests = [trial_request(trial, task, cfg, pruning) for trial, cfg in batch]
        try:
            results = sweep.run_pack(requests)
        except BaseException:
            for trial, _ in batch:
                _tell(study, trial, state=optuna.trial.TrialState.FAIL)
            raise
        for (trial, adapter), outcome in zip(batch, results):
            params = adapter_params(sweep, adapter)
            if outcome.failed:  # only this trial fails; the batch and the study go on
                record_failure(trial, outcome)
                _tell(study, trial, state=optuna.trial.TrialState.FAIL)
            elif outcome.pruned:
                record_outcome(trial, outcome, params)
                _tell(study, trial, state=optuna.trial.TrialState.PRUNED)
            else:
                record_outcome(trial, outcome, params)
                _tell(study, trial, trial_values(config, outcome, params))
        outcomes += results
    return outcomes


def _tell(
    study: optuna.Study,
    trial: optuna.Trial | int,
    value: float | list[float] | None = None,
    state: optuna.trial.TrialState | None = None,
) -> None:
    """``study.tell`` that tolerates an exhausted grid.

    GridSampler calls ``study.stop()`` once every grid point is taken, which Optuna only allows
    inside ``optimize``; outside it (ask-and-tell, recovery) the trial's state is stored before
    that raises, so it is safe to ignore.
    """
    try:
        study.tell(trial, value, state=state)
    except RuntimeError as err:
        if not (isinstance(study.sampler, optuna.samplers.GridSampler) and "Study.stop" in str(err)):
            raise
