"""The Optuna storage a sweep's processes share: its trials, who trains them, and their heartbeats.

Every process of a sweep (the ``plora-hpo sweep`` that opened it, one worker per GPU, workers
joining from other machines) opens the study through :func:`open_storage`, an Optuna
``RDBStorage``:

* ``sqlite:///…`` serves the processes of one machine. Its transactions start with
  ``BEGIN IMMEDIATE`` (SQLAlchemy's recipe for serialisable pysqlite), so taking a waiting trial
  (read it WAITING, set it RUNNING) is atomic across threads and processes;
* PostgreSQL (``postgresql://user:pass@host/db``) serves workers on several machines: Optuna
  takes a waiting trial under a row lock there. Optuna's ``JournalStorage`` and gRPC proxy keep
  no heartbeats, which is why an RDB is the shared state.

While a process trains a trial, Optuna's heartbeat thread records it every ``heartbeat``
seconds. A RUNNING trial whose last heartbeat is older than :func:`grace_seconds` belongs to a
process that died (``kill -9``, a lost machine); the next process to start a trial fails it and
:func:`requeue` enqueues a retry that keeps its grid point, lineage (seed and checkpoint) and
MLflow run, so another worker continues it from its last checkpoint.
"""

from __future__ import annotations

import logging
import warnings
from typing import Any

import optuna
from optuna.storages import RDBStorage
from optuna.trial import FrozenTrial, TrialState

from plora_hpo.errors import PloraError, first_line
from plora_hpo.timeline import phase

log = logging.getLogger(__name__)

N_TRIALS_ATTR = "plora.n_trials"
"""The study user attr holding how many trials the sweep runs (retries of failed ones aside)."""
HEARTBEAT_SECONDS = 10.0
"""How often a training process records that each of its trials is alive."""
GRACE_HEARTBEATS = 6
"""Missed heartbeats after which a trial's process counts as dead."""


def grace_seconds(heartbeat: float) -> float:
    """How old a trial's last heartbeat may be before another process re-runs it."""
    return GRACE_HEARTBEATS * heartbeat


class TrialBudgetReached(Exception):
    """The study has as many trials as the sweep runs: no new one is created (``study.ask`` raises)."""


class SweepStorage(RDBStorage):
    """An ``RDBStorage`` that creates no trial beyond a study's :data:`N_TRIALS_ATTR`.

    Concurrent ``study.optimize`` calls in several processes each ask for trials as threads free
    up; without a cap the last rounds ask for more than the sweep runs (and a grid sampler, its
    points all taken, trains one of them twice). Enqueued trials (retries, grid points) are
    created from a template and always allowed; a fresh ``ask`` past the budget raises
    :class:`TrialBudgetReached`. With a grid every point is enqueued up front, so the cap is exact;
    with other samplers two processes asking at the same moment can still both pass it.
    """

    def _create_new_trial(self, study_id: int, template_trial: FrozenTrial | None = None) -> FrozenTrial:
        # the one path by which trials are created: ``create_new_trial`` and the cache Optuna
        # wraps every RDBStorage in (which calls this method directly) both go through it
        if template_trial is None:
            target = self.get_study_user_attrs(study_id).get(N_TRIALS_ATTR)
            if target is not None:
                trials = self.get_all_trials(study_id, deepcopy=False)
                retried = {t.user_attrs["retry_of"] for t in trials if "retry_of" in t.user_attrs}
                if sum(t.number not in retried for t in trials) >= target:
                    raise TrialBudgetReached(f"the study has its {target} trials")
        return super()._create_new_trial(study_id, template_trial)

    def record_heartbeat(self, trial_id: int) -> None:
        """Record that ``trial_id`` is alive; a failed write is logged and the next one tried.

        Optuna calls this on a thread of its own, which a storage error (a full disk, a database
        server away for a moment) would end with a traceback, leaving the trial without
        heartbeats for the rest of its training, so another process would re-run it. A missed
        heartbeat only ages the trial; the training thread meets a lasting storage error at its
        next write and stops the sweep with it. Each write is a ``heartbeat`` phase of the
        timeline (:mod:`plora_hpo.timeline`): these threads share the interpreter with the training
        loop, one per trial in flight.
        """
        try:
            with phase("heartbeat"):
                super().record_heartbeat(trial_id)
        except Exception as err:
            log.warning(
                "trial %d: heartbeat not recorded (%s); trying again in %d s",
                trial_id,
                first_line(err),
                self.heartbeat_interval,
            )


def open_storage(url: str, *, heartbeat: float = HEARTBEAT_SECONDS) -> SweepStorage:
    """The sweep's storage at ``url`` with heartbeats every ``heartbeat`` seconds.

    Raises:
        PloraError: ``url`` is not an RDB URL Optuna can open (one line: the cause and the fix).
    """
    sqlite = url.startswith("sqlite")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            storage = SweepStorage(
                url,
                engine_kwargs={"connect_args": {"timeout": 120}} if sqlite else {"pool_pre_ping": True},
                heartbeat_interval=max(1, round(heartbeat)),
                grace_period=max(2, round(grace_seconds(heartbeat))),
                heartbeat_stale_trial_callback=requeue,
            )
    except Exception as err:  # SQLAlchemy/Optuna raise many kinds for a bad URL or an unreachable server
        raise PloraError(
            f"cannot open the Optuna storage {url!r} ({first_line(err)}); "
            "pass --storage with a reachable database URL (sqlite:///… or postgresql://…)"
        ) from None
    if sqlite:
        _serialise_sqlite(storage)
    return storage


def _serialise_sqlite(storage: SweepStorage) -> None:
    """Begin every transaction with ``BEGIN IMMEDIATE``: one writer at a time, reads included."""
    from sqlalchemy import event

    engine = storage.engine

    @event.listens_for(engine, "connect")
    def _no_implicit_begin(dbapi_connection: Any, _record: Any) -> None:
        dbapi_connection.isolation_level = None

    @event.listens_for(engine, "begin")
    def _begin_immediate(connection: Any) -> None:
        connection.exec_driver_sql("BEGIN IMMEDIATE")

    engine.dispose()  # connections opened before the listeners existed


def requeue(study: optuna.Study, trial: FrozenTrial) -> bool:
    """Enqueue a retry of ``trial`` (failed by a dead or interrupted process).

    The retry is a WAITING trial with the same params and grid point, and the original's user
    attrs plus ``retry_of``: it keeps the ``lineage`` (seed, checkpoint, adapter name) and the
    ``mlflow_run_id``, so whichever process takes it resumes the checkpoint and continues the run.
    False (and nothing enqueued) when a retry of ``trial`` exists already.
    """
    trials = study.get_trials(deepcopy=False)
    if any(t.user_attrs.get("retry_of") == trial.number for t in trials):
        return False
    params = trial.system_attrs.get("fixed_params") or trial.params
    user_attrs = {k: v for k, v in trial.user_attrs.items() if k != "interrupted"}
    grid = {k: trial.system_attrs[k] for k in ("grid_id", "search_space") if k in trial.system_attrs}
    retry = optuna.trial.create_trial(
        state=TrialState.WAITING,
        system_attrs={"fixed_params": params, **grid},
        user_attrs={**user_attrs, "retry_of": trial.number},
    )
    study.add_trial(retry)
    return True


def fail_stale_trials(study: optuna.Study) -> None:
    """Fail (and :func:`requeue`) the trials whose process stopped sending heartbeats."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        optuna.storages.fail_stale_trials(study)
