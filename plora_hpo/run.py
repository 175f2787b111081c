"""One sweep in its run directory: the recipe that owns resuming it.

:class:`SweepRun` is what the CLI's ``plora-hpo sweep`` runs and what Python users open. Opening
it decides, in one place, whether and how an earlier process's work continues:

1. the inputs are checked and the run directory's saved settings are compared with the sweep's
   (a resume with settings that change what finished trials mean is refused), and every
   checkpoint is read once, before anything is written;
2. the run directory is taken (one live owner: a second sweep on it is refused);
3. the studies are opened and the trials a dead or interrupted process left unfinished are
   enqueued again with their lineage, grid point and MLflow run (:func:`recover_stale_trials`);
4. the MLflow parent run continues, and runs a killed process left RUNNING that no retry will
   continue are closed.

:meth:`SweepRun.optimize` then runs those retries first (from their checkpoints, through the
workers) and the remaining trials with ``study.optimize``. The components it wires (the packed
sweep, its workers, the tracker) know nothing of it.

Example:
    >>> from plora_hpo import SweepRun, load_sweep  # doctest: +SKIP
    >>> with SweepRun(load_sweep("search_spaces/demo.yaml"), run_dir="plora_runs") as run:  # doctest: +SKIP
    ...     run.optimize()  # doctest: +SKIP
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Mapping
from os import PathLike
from pathlib import Path
from typing import Any

import optuna

from plora_hpo.checkpoints import CheckpointStore
from plora_hpo.config import SweepConfig
from plora_hpo.ownership import RunDirOwner
from plora_hpo.preflight import check_sweep_inputs
from plora_hpo.run_state import RunState, check_resumable
from plora_hpo.study import (
    PackedObjective,
    create_study,
    default_n_trials,
    finished_trials,
    recover_stale_trials,
    run_waiting_trials,
)
from plora_hpo.sweep import PackedSweep, checkpoint_dir
from plora_hpo.tracking import SweepTracker, default_tracking_uri
from plora_hpo.trials import PackProgress


def flatten(params: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"budget": {"steps": 30}}`` → ``{"budget.steps": 30}`` (one MLflow param per setting)."""
    out: dict[str, Any] = {}
    for key, value in params.items():
        if isinstance(value, Mapping):
            out.update(flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def default_storage(run_dir: Path) -> str:
    """The Optuna storage of a run directory when none is given: ``sqlite:///<run_dir>/optuna.db``."""
    return f"sqlite:///{(run_dir / 'optuna.db').resolve()}"


class SweepRun:
    """A sweep in ``run_dir``, owned by this process from :meth:`open` to :meth:`close`.

    Args:
        config: the sweep file (:func:`~plora_hpo.config.load_sweep`).
        run_dir: where the studies, MLflow store, checkpoints, adapters and pack record go.
        storage: Optuna storage URL (default :func:`default_storage`).
        mlflow_uri: MLflow tracking URI (default: a sqlite store in ``run_dir``).
        data_dir: offline task data (default ``$PLORA_HPO_DATA_DIR`` or the Hub).
        device: ``cpu``, ``cuda``, ``cuda:N`` or a list (default: every GPU, else the CPU).
        resume: require an earlier run in ``run_dir`` (a plain open resumes one too, if present).
        progress: front-end hooks (the CLI's progress bars).
        sweep_file: the file ``config`` came from, recorded with the studies and the MLflow run.

    Attributes (after :meth:`open`):
        sweep: the packed sweep (workers, trial pool) the studies' trials train on.
        studies: one Optuna study per task.
        tracker: the sweep's MLflow tracker (parent run open).
        retries: per task, how many trials an earlier process left in flight and will be resumed.
        closed_runs: MLflow runs an earlier process left RUNNING that were closed.
        eval_documents: per task, which evaluation documents the trials are scored on.
    """

    def __init__(
        self,
        config: SweepConfig,
        *,
        run_dir: str | PathLike[str] = "plora_runs",
        storage: str | None = None,
        mlflow_uri: str | None = None,
        data_dir: str | None = None,
        device: str | None = None,
        resume: bool = False,
        progress: PackProgress | None = None,
        sweep_file: str | PathLike[str] | None = None,
    ) -> None:
        self.config = config
        self.sweep_file = None if sweep_file is None else str(Path(sweep_file).resolve())
        self.run_dir = Path(run_dir)
        self._storage_given = storage  # checked by preflight; the default lives in run_dir
        self.storage = storage or default_storage(self.run_dir)
        self.mlflow_uri = mlflow_uri
        self.data_dir = data_dir
        self.device = device
        self.resume = resume
        self.progress = progress or PackProgress()
        self.sweep: PackedSweep | None = None
        self.tracker: SweepTracker | None = None
        self.studies: dict[str, optuna.Study] = {}
        self.retries: dict[str, int] = {}
        self.closed_runs: list[str] = []
        self.eval_documents: dict[str, str] = {}
        self._owner: RunDirOwner | None = None
        self._closed = False

    # --- lifecycle ----------------------------------------------------------------------------
    def open(self) -> SweepRun:
        """Check, take the run directory, open the stores and recover what a dead process left.

        Raises a :class:`~plora_hpo.errors.PloraError` (one line) for bad inputs, a run directory
        in use by a live process, an incompatible resume or a corrupt checkpoint; nothing is
        written then (a run directory this call created is removed again).
        """
        config, run_dir = self.config, self.run_dir
        # bad device/model/data/URIs, a changed resume and corrupt checkpoints stop here, read-only
        check_sweep_inputs(
            config,
            run_dir=run_dir,
            data_dir=self.data_dir,
            device=self.device,
            mlflow_uri=self.mlflow_uri,
            storage=self._storage_given,
        )
        saved = check_resumable(run_dir, config, resume=self.resume)
        for task in config.tasks:
            CheckpointStore(checkpoint_dir(run_dir, config, task)).validate_all()
        existed = run_dir.exists()
        run_dir.mkdir(parents=True, exist_ok=True)
        owner = RunDirOwner(run_dir)  # a second sweep on a live run directory stops here
        try:
            owner.acquire()
        except BaseException:
            if not existed:
                shutil.rmtree(run_dir, ignore_errors=True)
            raise
        self._owner = owner
        try:  # until the stores exist, a failure leaves no run directory behind that was not there
            self.tracker = SweepTracker(
                self.mlflow_uri or default_tracking_uri(run_dir), config.name, artifact_root=run_dir
            )
            self.progress.note(f"loading {config.model} and data for {', '.join(config.tasks)}")
            self.sweep = PackedSweep(
                config,
                tracker=self.tracker,
                run_dir=run_dir,
                data_dir=self.data_dir,
                device=self.device,
                progress=self.progress,
            )
            self.tracker.check_reachable()
            self.studies = {task: create_study(config, task, self.storage) for task in config.tasks}
        except BaseException:
            if self.sweep is not None:
                self.sweep.close()
            self._release()
            if not existed:
                shutil.rmtree(run_dir, ignore_errors=True)
            raise
        try:
            # this process owns the run directory: trials left RUNNING were left by a dead process
            for task, study in self.studies.items():
                self.retries[task] = len(recover_stale_trials(study))
            self.eval_documents = self.sweep.eval_documents()
            for task, documents in self.eval_documents.items():
                self.studies[task].set_user_attr("eval_documents", documents)
            self._continue_tracking(saved)
        except BaseException:
            self.close(failed=True)
            raise
        return self

    def _continue_tracking(self, saved: RunState | None) -> None:
        """Continue the earlier parent run (or start one) and close runs no retry will continue."""
        assert self.tracker is not None
        config = self.config
        state = saved or RunState.of(config)
        parent = flatten(
            {
                **config.model_dump(mode="json", exclude={"space"}),
                "space": config.space.model_dump(),
                "eval_documents": self.eval_documents,
                "sweep_file": self.sweep_file,
            }
        )
        if state.mlflow_parent_run_id is None or not self.tracker.resume(state.mlflow_parent_run_id):
            state.mlflow_parent_run_id = self.tracker.start(config.name, parent, {"plora.storage": self.storage})
        state.save(self.run_dir)
        for study in self.studies.values():  # from the study (optuna-dashboard) to its MLflow runs and file
            study.set_user_attr("mlflow_parent_run_id", self.tracker.resolve(state.mlflow_parent_run_id))
            study.set_user_attr("mlflow_tracking_uri", self.tracker.tracking_uri)
            if self.sweep_file is not None:
                study.set_user_attr("sweep_file", self.sweep_file)
        continued = {
            t.user_attrs["mlflow_run_id"]
            for study in self.studies.values()
            for t in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.WAITING,))
            if "mlflow_run_id" in t.user_attrs
        }
        self.closed_runs = self.tracker.close_orphan_runs(keep=continued)

    def optimize(self, n_trials: int | None = None) -> dict[str, optuna.Study]:
        """Resume the recovered trials, then run each task's study until it has ``n_trials``
        finished trials (default: the sweep file's ``n_trials``, else the grid size).

        Trials train concurrently (``n_jobs`` = :attr:`PackedSweep.concurrency`), so the
        admission policy packs them. Returns the studies.
        """
        if self.sweep is None:
            raise RuntimeError("SweepRun.optimize() needs an open run: use `with SweepRun(...) as run:`")
        target = default_n_trials(self.config) if n_trials is None else n_trials
        for task, study in self.studies.items():
            objective = PackedObjective(self.sweep, task)
            self.progress.add_trials(max(0, target - finished_trials(study)))
            run_waiting_trials(study, objective)
            remaining = max(0, target - finished_trials(study))
            study.optimize(objective, n_trials=remaining, n_jobs=self.sweep.concurrency, catch=())
        return self.studies

    def close(self, *, failed: bool = False) -> None:
        """Stop the workers (in-flight adapters are checkpointed), end the MLflow parent run
        (FAILED when ``failed``) and give the run directory up. Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            if self.sweep is not None:
                self.sweep.close()
            if not failed and self.tracker is not None:
                self._record_summary()
        finally:
            if self.tracker is not None:
                self.tracker.finish("FAILED" if failed else "FINISHED")
            self._release()

    def _record_summary(self) -> None:
        """The sweep's outcome on the MLflow parent run: each task's best value (metric
        ``best/<task>``), the best trial's adapter (tag) and every finished trial (``summary/``)."""
        assert self.tracker is not None
        parent = self.tracker.parent_run_id
        if parent is None:
            return
        rows, tags, table = [], {}, {}
        for task, study in self.studies.items():
            done = [t for t in study.get_trials(deepcopy=False) if t.state == optuna.trial.TrialState.COMPLETE]
            table[task] = [
                {
                    "trial": t.number,
                    "params": t.params,
                    "value": t.value,
                    "metrics": t.user_attrs.get("metrics"),
                    "final_train_loss": t.user_attrs.get("final_train_loss"),
                    "adapter_dir": t.user_attrs.get("adapter_dir"),
                    "mlflow_run_id": t.user_attrs.get("mlflow_run_id"),
                }
                for t in sorted(done, key=lambda t: t.value, reverse=True)
            ]
            if done:
                best = max(done, key=lambda t: t.value)
                rows.append((f"best/{task}", best.value, 0))
                tags[f"plora.best.{task}"] = str(best.user_attrs.get("adapter_dir"))
        folder = self.run_dir / "summary"
        folder.mkdir(exist_ok=True)
        (folder / "trials.json").write_text(json.dumps(table, indent=1, default=str) + "\n")
        self.tracker.log_metrics(parent, rows)
        self.tracker.set_tags(parent, tags)
        self.tracker.log_folder(parent, folder, "summary")

    def _release(self) -> None:
        if self._owner is not None:
            self._owner.release()
            self._owner = None

    def __enter__(self) -> SweepRun:
        return self.open()

    def __exit__(self, exc_type: object, *exc: object) -> None:
        self.close(failed=exc_type is not None)
