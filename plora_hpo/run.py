"""One sweep in its run directory: the recipe that owns resuming it.

:class:`SweepRun` is what the CLI's ``plora-hpo sweep`` runs and what Python users open. Opening
it decides, in one place, whether and how an earlier process's work continues:

1. the inputs are checked and the run directory's saved settings are compared with the sweep's
   (a resume with settings that change what finished trials mean is refused), and every
   checkpoint is read once, before anything is written;
2. the run directory is taken (one live owner: a second sweep on it is refused);
3. the studies are opened and the trials a dead or interrupted process left unfinished are
   enqueued again with their lineage, grid point and MLflow run (:func:`recover_stale_trials`);
   with a storage given explicitly, which workers elsewhere may share, only the trials whose
   heartbeat stopped are;
4. the MLflow parent run continues, and (with the run directory's own storage) runs a killed
   process left RUNNING that no retry will continue are closed.

:meth:`SweepRun.optimize` then serves each study: in this process (one training thread per
device) or in one worker process per device (:mod:`plora_hpo.cluster`), while workers on other
machines may join. The components it wires (the packed sweep, its workers, the tracker) know
nothing of it.

Example:
    >>> from plora_hpo import SweepRun, load_sweep  # doctest: +SKIP
    >>> with SweepRun(load_sweep("search_spaces/demo.yaml"), run_dir="plora_runs") as run:  # doctest: +SKIP
    ...     run.optimize()  # doctest: +SKIP
"""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import time
from collections.abc import Mapping
from os import PathLike
from pathlib import Path
from typing import Any

import optuna

from plora_hpo.checkpoints import CheckpointStore
from plora_hpo.cluster import describe_for_workers, set_target
from plora_hpo.config import SweepConfig
from plora_hpo.devices import sweep_devices
from plora_hpo.errors import ConfigError, PloraError
from plora_hpo.local_workers import LocalWorkers
from plora_hpo.ownership import RunDirOwner
from plora_hpo.pack_record import gather_pack_records, import_pyplot, shifted, write_pack_record
from plora_hpo.preflight import check_sweep_inputs
from plora_hpo.reporting import PackSegment
from plora_hpo.run_state import RunState, check_resumable
from plora_hpo.storage import HEARTBEAT_SECONDS, N_TRIALS_ATTR, fail_stale_trials
from plora_hpo.study import (
    PackedObjective,
    create_study,
    default_n_trials,
    finished_trials,
    queue_grid,
    recover_stale_trials,
    serve,
    settled_lineages,
)
from plora_hpo.sweep import PackedSweep, checkpoint_dir
from plora_hpo.timeline import phase
from plora_hpo.tracking import SweepTracker, default_store_file, default_tracking_uri
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
        heartbeat: seconds between the heartbeats of trials in training (see :mod:`plora_hpo.storage`).
        processes: train in one worker process per device (default: when there are several
            devices; always with ``pack.degree`` > 1, whose groups are processes); otherwise one
            thread per device in this process.
        local_workers: the worker processes for the first task, already started by the caller
            (:meth:`LocalWorkers.for_task`, on the devices these settings give): the run takes
            them over. Started in :meth:`open` otherwise.

    Attributes (after :meth:`open`):
        sweep: the packed sweep (workers, trial pool) the studies' trials train on; None when
            worker processes train them.
        studies: one Optuna study per task.
        tracker: the sweep's MLflow tracker (parent run open).
        retries: per task, how many trials an earlier process left in flight and will be resumed.
        closed_runs: MLflow runs an earlier process left RUNNING that were closed (with the run
            directory's own storage only: with a shared one they may be live workers' runs).
        eval_documents: per task, which evaluation documents the trials are scored on.
        pack_segments: after :meth:`close`, every pack composition that ran, in this process or
            in worker processes (then on one clock, with ``<device>@<process>`` as device).
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
        heartbeat: float = HEARTBEAT_SECONDS,
        processes: bool | None = None,
        local_workers: LocalWorkers | None = None,
    ) -> None:
        self.config = config
        self.heartbeat = heartbeat
        self.processes = processes
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
        self.devices: list[str] = []
        self.worker_processes: list[subprocess.Popen] = []  # while optimize() waits for them
        self.local_workers = local_workers  # started, not yet given a study
        self._served: list[LocalWorkers] = []  # given a study: exiting by the time close() ends
        self.pack_segments: list[PackSegment] = []
        self._opened_at: float | None = None  # Unix time: worker records from before are an earlier run's
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
        self._opened_at = time.time()
        if config.pack.degree > 1 and self.processes is False:
            raise ConfigError(
                f"pack.degree {config.pack.degree} trains each pack on a group of worker processes; "
                "leave out --workers threads"
            )
        self._start_local_workers()  # they import while this process checks and opens the stores
        try:
            with phase("check-inputs"):
                # bad device/model/data/URIs, a changed resume and corrupt checkpoints stop here, read-only
                check_sweep_inputs(
                    config,
                    run_dir=run_dir,
                    data_dir=self.data_dir,
                    device=self.device,
                    mlflow_uri=self.mlflow_uri,
                    storage=self._storage_given,
                )
                with phase("check-resume"):
                    saved = check_resumable(run_dir, config, resume=self.resume)
                    for task in config.tasks:
                        CheckpointStore(checkpoint_dir(run_dir, config, task)).validate_all()
        except BaseException:
            self._stop_local_workers()
            raise
        existed = run_dir.exists()
        run_dir.mkdir(parents=True, exist_ok=True)
        owner = RunDirOwner(run_dir)  # a second sweep on a live run directory stops here
        try:
            owner.acquire()
        except BaseException:
            self._stop_local_workers()
            if not existed:
                shutil.rmtree(run_dir, ignore_errors=True)
            raise
        self._owner = owner
        store_file = default_store_file(run_dir) if self.mlflow_uri is None else None
        new_store = store_file is not None and not store_file.exists()
        try:  # until the stores exist, a failure leaves no run directory behind that was not there
            self.tracker = SweepTracker(
                self.mlflow_uri or default_tracking_uri(run_dir), config.name, artifact_root=run_dir
            )
            if store_file is not None:  # the run directory's own: it opens in its process while the model loads
                self.tracker.open_store()
            if not self.processes:
                self.progress.note(f"loading {config.model} and data for {', '.join(config.tasks)}")
                self.sweep = PackedSweep(
                    config,
                    tracker=self.tracker,
                    run_dir=run_dir,
                    data_dir=self.data_dir,
                    device=self.device,
                    progress=self.progress,
                )
            with phase("open-stores"):
                self.tracker.check_reachable()
                self.studies = {
                    task: create_study(config, task, self.storage, heartbeat=self.heartbeat) for task in config.tasks
                }
        except BaseException:
            if self.sweep is not None:
                self.sweep.close()
            if self.tracker is not None:
                self.tracker.close()
            self._release()
            if not existed:
                shutil.rmtree(run_dir, ignore_errors=True)
            elif new_store:  # made by this call, beside the model's load
                store_file.unlink(missing_ok=True)
            raise
        try:
            for task, study in self.studies.items():
                if self._storage_given is None:
                    # the run directory's own storage, and this process owns the run directory:
                    # trials left RUNNING were left by a dead process
                    self.retries[task] = len(recover_stale_trials(study))
                else:  # workers elsewhere may be training: only trials whose heartbeat stopped
                    fail_stale_trials(study)
                store = CheckpointStore(checkpoint_dir(run_dir, config, task))
                for lineage in settled_lineages(study):  # left by a process stopped before removing them
                    store.delete(lineage)
                describe_for_workers(study, config, task, run_dir=run_dir, data_dir=self.data_dir)
            if self.sweep is not None:
                self.eval_documents = self.sweep.eval_documents()
                for task, documents in self.eval_documents.items():
                    self.studies[task].set_user_attr("eval_documents", documents)
            with phase("open-stores"):
                self._continue_tracking(saved)
        except BaseException:
            self.close(status="FAILED")
            raise
        return self

    def _start_local_workers(self) -> None:
        """With worker processes, start one per device now (they wait for their study), unless
        the caller started them on these devices."""
        try:
            self.devices, self.processes = sweep_devices(self.device, self.processes, self.config.pack.degree)
        except PloraError:  # the input checks say so, in their words
            self._stop_local_workers()
            return
        if self.local_workers is not None and (not self.processes or self.local_workers.assigned != self.devices):
            self._stop_local_workers()
        if self.processes and self.local_workers is None:
            self.local_workers = self._local_workers(self.config.tasks[0])

    def _local_workers(self, task: str) -> LocalWorkers:
        return LocalWorkers.for_task(self.config, task, self.devices, data_dir=self.data_dir)

    def _stop_local_workers(self) -> None:
        if self.local_workers is not None:
            self.local_workers.stop()
            self.local_workers = None

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
        if self._storage_given is not None:  # runs left RUNNING may be live workers' elsewhere
            return
        continued = {
            t.user_attrs["mlflow_run_id"]
            for study in self.studies.values()
            for t in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.WAITING,))
            if "mlflow_run_id" in t.user_attrs
        }
        self.closed_runs = self.tracker.close_orphan_runs(keep=continued)

    def optimize(self, n_trials: int | None = None) -> dict[str, optuna.Study]:
        """Run each task's study until it has ``n_trials`` finished trials (default: the sweep
        file's ``n_trials``, else the grid size): a grid is queued whole, and waiting trials (the
        queued grid points, retries of recovered trials) train before new proposals.

        In this process, trials train concurrently (``n_jobs`` = :attr:`PackedSweep.concurrency`),
        so the admission policy packs them; with worker processes, each serves the study on its
        device and this process waits for them. Workers joining from other machines
        (``plora-hpo worker``) serve the same studies. Returns the studies.
        """
        if not self.studies:
            raise RuntimeError("SweepRun.optimize() needs an open run: use `with SweepRun(...) as run:`")
        target = default_n_trials(self.config) if n_trials is None else n_trials
        for task, study in self.studies.items():
            set_target(study, target)
            queue_grid(study, target)
            if self.sweep is not None:
                self.progress.add_trials(max(0, target - finished_trials(study)))
                serve(study, PackedObjective(self.sweep, task), n_trials=target)
            else:  # each worker process shows its own progress
                self._run_worker_processes(study, task)
        return self.studies

    def _run_worker_processes(self, study: optuna.Study, task: str) -> None:
        """One worker process per device serves ``study`` (``task``'s); wait for all of them.

        A worker that dies leaves its trials to the others (by heartbeat); the sweep fails only
        when every worker stopped with trials unfinished.
        """
        assert self.tracker is not None
        workers = self.local_workers or self._local_workers(task)
        self.local_workers = None  # a later task's study gets processes of its own
        procs = workers.serve(
            self.storage,
            study.study_name,
            run_dir=self.run_dir,
            data_dir=self.data_dir,
            mlflow_uri=self.tracker.tracking_uri,
            heartbeat=self.heartbeat,
        )
        self.worker_processes = procs
        self._served.append(workers)
        import_pyplot()  # close() draws every process's packs: ready by the time they are done
        try:
            codes = workers.wait_done()
        finally:
            self.worker_processes = []
        target = study.user_attrs[N_TRIALS_ATTR]
        if finished_trials(study) < target:
            raise PloraError(
                f"{study.study_name}: every worker process stopped (exit codes {codes}) with "
                f"{target - finished_trials(study)} trials unfinished; rerun the same command to resume them"
            )

    def interrupt(self) -> None:
        """Stop training from another thread (a signal handler's): packs checkpoint their
        adapters and their trials are queued to resume; :meth:`optimize` then raises
        :class:`~plora_hpo.trials.TrialInterrupted` (worker processes are sent SIGTERM and do the same)."""
        for proc in self.worker_processes:
            proc.send_signal(signal.SIGTERM)
        if self.sweep is not None:
            self.sweep.interrupt()

    def close(self, *, status: str = "FINISHED") -> None:
        """Stop the workers (in-flight adapters are checkpointed), end the MLflow parent run with
        ``status`` (FINISHED, FAILED, KILLED: a summary only when FINISHED), wait for the worker
        processes to exit and give the run directory up. Idempotent."""
        if self._closed:
            return
        self._closed = True
        with phase("close"):
            try:
                if self.sweep is not None:
                    self.sweep.close()
                    self.pack_segments = self.sweep.pack_segments
                if self._owner is not None:
                    self._merge_worker_records()
                if status == "FINISHED" and self.tracker is not None:
                    self._record_summary()
            finally:
                if self.tracker is not None:
                    try:
                        self.tracker.finish(status)
                    finally:
                        self.tracker.close()
                for workers in self._served:  # exiting while this process closed
                    workers.reap()
                self._release()

    def _merge_worker_records(self) -> None:
        """Add the pack records this run's worker processes have written by now
        (``packs/<process>/``; a joined worker still finishing is not waited for) to this
        process's own packs, on one clock: ``pack_segments``, ``<run_dir>/packs/packs.json`` and
        a Gantt chart of every process's devices, also logged to the MLflow parent run."""
        assert self._opened_at is not None
        theirs = gather_pack_records(self.run_dir / "packs", since=self._opened_at)
        if not theirs:
            return
        shift = 0.0 if self.sweep is None else self.sweep.clock_zero - self._opened_at
        self.pack_segments = shifted(self.pack_segments, shift) + theirs
        folder = write_pack_record(
            self.pack_segments, self.run_dir / "packs", started_at=self._opened_at, title=self.config.name
        )
        if self.tracker is not None and self.tracker.parent_run_id is not None:
            for name in ("packs.json", "packs.png"):  # the workers logged their own folders
                self.tracker.log_folder(self.tracker.parent_run_id, folder / name, "packs")

    def _record_summary(self) -> None:
        """The sweep's outcome on the MLflow parent run: each task's best value (metric
        ``best/<task>``) and the best trial's adapter (tag), or for a multi-objective study its
        Pareto front (tag ``plora.pareto.<task>``: trial numbers), and every finished trial
        (``summary/``), best first in the study's direction."""
        from plora_hpo.report import objectives_line, ranked_trials

        assert self.tracker is not None
        parent = self.tracker.parent_run_id
        if parent is None:
            return
        rows, tags, table = [], {}, {}
        for task, study in self.studies.items():
            done = [t for t in study.get_trials(deepcopy=False) if t.state == optuna.trial.TrialState.COMPLETE]
            multi = len(study.directions) > 1
            front = {t.number for t in study.best_trials} if multi and done else set()
            ordered = sorted(done, key=lambda t: t.number) if multi else ranked_trials(study, done)
            tags[f"plora.objective.{task}"] = objectives_line(study)
            table[task] = [
                {
                    "trial": t.number,
                    "params": t.params,
                    **({"values": t.values, "pareto": t.number in front} if multi else {"value": t.value}),
                    "metrics": t.user_attrs.get("metrics"),
                    "adapter_params": t.user_attrs.get("adapter_params"),
                    "final_train_loss": t.user_attrs.get("final_train_loss"),
                    "adapter_dir": t.user_attrs.get("adapter_dir"),
                    "mlflow_run_id": t.user_attrs.get("mlflow_run_id"),
                }
                for t in ordered
            ]
            if multi:
                tags[f"plora.pareto.{task}"] = ",".join(map(str, sorted(front)))
            elif done:
                best = ordered[0]
                rows.append((f"best/{task}", best.value, 0))
                tags[f"plora.best.{task}"] = str(best.user_attrs.get("adapter_dir"))
        folder = self.run_dir / "summary"
        folder.mkdir(exist_ok=True)
        (folder / "trials.json").write_text(json.dumps(table, indent=1, default=str) + "\n")
        self.tracker.log_metrics(parent, rows, tags)
        self.tracker.log_folder(parent, folder, "summary")

    def _release(self) -> None:
        self._stop_local_workers()
        if self._owner is not None:
            self._owner.release()
            self._owner = None

    def __enter__(self) -> SweepRun:
        return self.open()

    def __exit__(self, exc_type: object, *exc: object) -> None:
        self.close(status="FINISHED" if exc_type is None else "FAILED")
