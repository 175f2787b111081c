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

import threading
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import optuna

from plora_hpo.config import SweepConfig
from plora_hpo.errors import ConfigError, PloraError, first_line
from plora_hpo.grid import OrderedGridSampler
from plora_hpo.space import SearchSpace
from plora_hpo.sweep import PackedSweep
from plora_hpo.trials import TrialInterrupted, TrialOutcome, TrialRequest

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


def create_study(config: SweepConfig, task: str, storage: str) -> optuna.Study:
    """Create (or reopen, to resume) the task's study in ``storage``.

    The reference trial (:data:`REFERENCE_PARAMS`) is not enqueued: Optuna 5.0 on sqlite can hand
    one waiting trial to two ``study.optimize`` threads at once, and packs run with ``n_jobs > 1``.
    Grids that contain it (demo, paper120) train it anyway; the summary compares against it.

    Trials a dead process left unfinished are recovered by the study's owner
    (:class:`~plora_hpo.run.SweepRun`), never here: other live processes may be running them.
    """
    space = SearchSpace(config.space, seed=config.seed, use_rslora=config.train.use_rslora)
    try:
        study = optuna.create_study(
            study_name=study_name(config, task),
            storage=storage,
            sampler=make_sampler(config, space),
            pruner=make_pruner(config),
            direction="maximize",
            load_if_exists=True,
        )
    except Exception as err:  # SQLAlchemy/Optuna raise many kinds for a bad URL
        raise PloraError(
            f"cannot open the Optuna storage {storage!r} ({first_line(err)}); "
            "pass --storage with a reachable database URL"
        ) from None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        study.set_metric_names([task_metric_name(task)])
    return study


def recover_stale_trials(study: optuna.Study) -> list[int]:
    """Fail every trial a dead or interrupted run left unfinished and enqueue it again.

    After a crash or ``kill -9`` the storage still holds the in-flight trials as RUNNING and
    nothing would ever finish them; after an interrupt they are FAIL with the user attr
    ``interrupted``. Each is (told FAIL and) enqueued again as a WAITING copy with the same
    params, grid point and user attrs plus ``retry_of``: the copy keeps the ``lineage`` and
    ``mlflow_run_id``, so it resumes from the checkpoint and continues the MLflow run.
    :func:`finished_trials` does not count the original. Returns the recovered trial numbers.
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
        params = trial.system_attrs.get("fixed_params") or trial.params
        if trial.state == optuna.trial.TrialState.RUNNING:
            _tell(study, trial.number, state=optuna.trial.TrialState.FAIL)
        user_attrs = {k: v for k, v in trial.user_attrs.items() if k != "interrupted"}
        grid = {k: trial.system_attrs[k] for k in ("grid_id", "search_space") if k in trial.system_attrs}
        retry = optuna.trial.create_trial(
            state=optuna.trial.TrialState.WAITING,
            system_attrs={"fixed_params": params, **grid},
            user_attrs={**user_attrs, "retry_of": trial.number},
        )
        study.add_trial(retry)
    return [t.number for t in stale]


def run_waiting_trials(study: optuna.Study, objective: PackedObjective) -> int:
    """Run every WAITING trial (the retries :func:`recover_stale_trials` enqueued) together.

    They are asked here, one after another in one thread, and then trained concurrently: Optuna
    5.0 on sqlite can pop one waiting trial into two ``study.optimize`` threads at once.
    Returns how many ran.
    """
    waiting = study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.WAITING,))
    trials = [study.ask() for _ in waiting]
    if trials:
        with ThreadPoolExecutor(len(trials), thread_name_prefix="plora-retry") as pool:
            for future in [pool.submit(_run_and_tell, study, objective, t) for t in trials]:
                future.result()
    return len(trials)


def _run_and_tell(study: optuna.Study, objective: PackedObjective, trial: optuna.Trial) -> None:
    """What ``study.optimize`` does with one trial: run the objective, tell the state it reached."""
    try:
        value = objective(trial)
    except optuna.TrialPruned:
        _tell(study, trial, state=optuna.trial.TrialState.PRUNED)
        return
    except BaseException:
        _tell(study, trial, state=optuna.trial.TrialState.FAIL)
        raise
    if value != value:  # NaN: the adapter failed (non-finite); only this trial fails
        _tell(study, trial, state=optuna.trial.TrialState.FAIL)
    else:
        _tell(study, trial, value)


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
    lineage = trial.user_attrs.get("lineage")
    if lineage is None:
        lineage = trial.number
        trial.set_user_attr("lineage", lineage)

    def should_prune(step: int, value: float) -> bool:
        trial.report(value, step)
        return trial.should_prune()

    return TrialRequest(
        task,
        trial.number,
        config,
        lineage=lineage,
        run_id=trial.user_attrs.get("mlflow_run_id"),
        should_prune=should_prune if pruning else None,
        on_started=lambda run_id: trial.set_user_attr("mlflow_run_id", run_id),
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
        self._warned = False

    def __call__(self, trial: optuna.Trial) -> float:
        if not self._warned and self.sweep.concurrency > 1 and threading.current_thread() is threading.main_thread():
            self._warned = True  # study.optimize runs n_jobs=1 in the caller's thread, more in a pool
            warnings.warn(
                "study.optimize(..., n_jobs=1) hands the sweep one trial at a time, so every pack trains "
                f"one adapter; pass n_jobs=sweep.concurrency ({self.sweep.concurrency}) to train them together",
                UserWarning,
                stacklevel=2,
            )
        config = self.space.suggest(trial)
        try:
            outcome = self.sweep.submit(trial_request(trial, self.task, config, self.pruning)).wait()
        except TrialInterrupted:
            trial.set_user_attr("interrupted", True)  # a rerun resumes it (recover_stale_trials)
            raise
        if outcome.pruned:
            record_outcome(trial, outcome)
            raise optuna.TrialPruned(f"pruned at step {outcome.pruned_at} ({outcome.value:.4f})")
        if outcome.failed:
            # Returning NaN makes Optuna mark just this trial FAIL (with a warning) and go on;
            # raising would stop study.optimize(catch=()) and with it the trials still to run.
            record_failure(trial, outcome)
            return float("nan")
        record_outcome(trial, outcome)
        return outcome.value


# --- explicit batches ---------------------------------------------------------------------------
def ask_batch(study: optuna.Study, space: SearchSpace, size: int) -> list[tuple[optuna.Trial, Any]]:
    """Ask ``size`` trials at once; returns (trial, AdapterConfig) pairs."""
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
        for (trial, _), outcome in zip(batch, results):
            if outcome.failed:  # only this trial fails; the batch and the study go on
                record_failure(trial, outcome)
                _tell(study, trial, state=optuna.trial.TrialState.FAIL)
            elif outcome.pruned:
                record_outcome(trial, outcome)
                _tell(study, trial, state=optuna.trial.TrialState.PRUNED)
            else:
                record_outcome(trial, outcome)
                _tell(study, trial, outcome.value)
        outcomes += results
    return outcomes


def _tell(
    study: optuna.Study,
    trial: optuna.Trial | int,
    value: float | None = None,
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
