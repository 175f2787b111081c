"""Processes that serve a running sweep: one worker per GPU on this machine, workers that join
from other machines.

A worker (``plora-hpo worker --storage URL --study NAME``) opens a study that ``plora-hpo sweep``
created in a shared storage and trains its trials on its own devices, with its own base
replica, next to every other process serving the study. Everything it needs is in the study:
the sweep's settings, the task, how many trials to finish, the run directory (checkpoints,
adapters) and the MLflow parent run its trial runs go under. Which process trains which trial
is decided by the storage (a waiting trial is taken atomically); a worker that dies is found by
its trials' heartbeats, and its trials continue from their checkpoints in another worker, so
the run directory must be one every worker reads and writes (a shared file system).

``plora-hpo sweep`` runs one such worker process per device of its own machine
(:mod:`plora_hpo.local_workers`).

With ``pack.degree`` d > 1 a worker is a group of d processes, one per device, that train each
pack together (:mod:`plora_hpo.pack_group`): its rank 0 serves the study as above, the others
follow it. The sweep starts its local groups itself; on another machine, ``torchrun
--nproc-per-node d -m plora_hpo.cli worker ...`` starts one.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
from os import PathLike
from pathlib import Path

import optuna
import torch.distributed as dist

from plora_hpo.config import SweepConfig, load_sweep
from plora_hpo.devices import resolve_devices
from plora_hpo.errors import PloraError
from plora_hpo.pack_group import PackChannel, join_group
from plora_hpo.replica import Replica
from plora_hpo.run_state import differences
from plora_hpo.storage import HEARTBEAT_SECONDS, N_TRIALS_ATTR, open_storage
from plora_hpo.study import PackedObjective, create_study, serve
from plora_hpo.sweep import PackedSweep
from plora_hpo.timeline import phase
from plora_hpo.tracking import SweepTracker
from plora_hpo.trials import PackProgress

CONFIG_ATTR = "plora.config"
"""Study user attrs a sweep leaves for its workers (with ``mlflow_parent_run_id`` and
``mlflow_tracking_uri``)."""
TASK_ATTR = "plora.task"
RUN_DIR_ATTR = "plora.run_dir"
DATA_DIR_ATTR = "plora.data_dir"


def describe_for_workers(
    study: optuna.Study, config: SweepConfig, task: str, *, run_dir: Path, data_dir: str | None
) -> None:
    """Record in ``study`` what a worker process needs to serve it (settings, task, run directory)."""
    study.set_user_attr(CONFIG_ATTR, config.model_dump(mode="json"))
    study.set_user_attr(TASK_ATTR, task)
    study.set_user_attr(RUN_DIR_ATTR, str(run_dir.resolve()))
    study.set_user_attr(DATA_DIR_ATTR, None if data_dir is None else str(Path(data_dir).resolve()))


def set_target(study: optuna.Study, n_trials: int) -> None:
    """How many finished trials the study's processes work towards."""
    study.set_user_attr(N_TRIALS_ATTR, n_trials)


class SweepWorker:
    """A process serving one study of a running sweep on its own devices.

    Args:
        storage: the sweep's Optuna storage URL.
        study: the study to serve (``<sweep name>-<task>``).
        run_dir: the sweep's run directory as this machine sees it (default: the path the sweep
            recorded, when this machine shares it at the same path).
        device: as for ``plora-hpo sweep --device``.
        data_dir: offline task data on this machine (default: the path the sweep recorded).
        mlflow_uri: the tracking URI as this machine reaches it (default: the sweep's).
        heartbeat: seconds between the heartbeats of this worker's trials.
        sweep_file: if given, must hold the study's settings (a worker for the wrong sweep stops).
        progress: front-end hooks.
        replica: the base model and data this process loaded ahead for the study's settings
            (:mod:`plora_hpo.local_workers`); loaded anew if the study's settings differ.
    """

    def __init__(
        self,
        storage: str,
        study: str,
        *,
        run_dir: str | PathLike[str] | None = None,
        device: str | None = None,
        data_dir: str | None = None,
        mlflow_uri: str | None = None,
        heartbeat: float = HEARTBEAT_SECONDS,
        sweep_file: str | PathLike[str] | None = None,
        progress: PackProgress | None = None,
        replica: Replica | None = None,
    ) -> None:
        self.storage_url, self.study_name = storage, study
        self.replica = replica
        self.run_dir = None if run_dir is None else Path(run_dir)
        self.device, self.data_dir, self.mlflow_uri = device, data_dir, mlflow_uri
        self.heartbeat = heartbeat
        self.sweep_file = sweep_file
        self.progress = progress or PackProgress()
        self.label = f"{socket.gethostname()}-{os.getpid()}"
        self.study: optuna.Study | None = None
        self.task = ""  # the study's task, and how many trials it runs (read by open())
        self.n_trials = 0
        self.sweep: PackedSweep | None = None
        self.tracker: SweepTracker | None = None
        self.channel: PackChannel | None = None  # this process's tensor-parallel group, if any

    def open(self) -> SweepWorker:
        """Read the sweep from the study, load the base model and data, attach to its MLflow run.

        Raises a one-line :class:`~plora_hpo.errors.PloraError` for an unreachable storage, a study
        that does not exist or was not started by ``plora-hpo sweep``, a sweep file that differs
        from the study's, or a run directory this machine cannot see.
        """
        storage = open_storage(self.storage_url, heartbeat=self.heartbeat)
        names = optuna.get_all_study_names(storage)
        if self.study_name not in names:
            raise PloraError(
                f"study {self.study_name!r} does not exist in {self.storage_url} "
                f"(it holds: {', '.join(names) or 'no studies'}); start the sweep first with "
                f"`plora-hpo sweep FILE --storage {self.storage_url}` or pass one of those to --study"
            )
        attrs = storage.get_study_user_attrs(storage.get_study_id_from_name(self.study_name))
        if CONFIG_ATTR not in attrs or N_TRIALS_ATTR not in attrs:
            raise PloraError(
                f"study {self.study_name!r} was not started by `plora-hpo sweep` (it has no sweep settings); "
                "start the sweep with plora-hpo sweep --storage, then join it"
            )
        config = SweepConfig.model_validate(attrs[CONFIG_ATTR])
        if self.sweep_file is not None:
            self._check_same_sweep(config)
        task = attrs[TASK_ATTR]
        run_dir = self.run_dir or Path(attrs[RUN_DIR_ATTR])
        if not run_dir.is_dir():
            raise PloraError(
                f"the sweep's run directory {run_dir} does not exist on this machine; mount it (checkpoints "
                "and adapters live there) and pass --run-dir with its path here"
            )
        self.run_dir = run_dir
        devices = resolve_devices(self.device)
        if config.pack.degree > 1 and len(devices) > 1:  # started by torchrun: each rank its own GPU
            self.device = str(devices[int(os.environ.get("LOCAL_RANK", "0"))])
        self.channel = join_group(config.pack.degree, resolve_devices(self.device)[0])
        leads = self.channel is None or self.channel.leads
        if leads:  # a follower only makes its leader's engine calls
            with phase("open-stores"):
                self.study = create_study(config, task, storage)
                tracking_uri = self.mlflow_uri or attrs["mlflow_tracking_uri"]
                self.tracker = SweepTracker(tracking_uri, config.name, artifact_root=run_dir)
                self.tracker.attach(attrs["mlflow_parent_run_id"])
                self.tracker.open_store()  # a local store's process starts while the model loads
            self.progress.note(f"{self.label}: serving study {self.study_name} from {self.storage_url}")
        self.sweep = PackedSweep(
            config.model_copy(update={"tasks": [task]}),
            tracker=self.tracker,
            run_dir=run_dir,
            data_dir=self.data_dir or attrs.get(DATA_DIR_ATTR),
            device=self.device,
            progress=self.progress,
            label=self.label,
            channel=self.channel,
            replica=self.replica,
        )
        self.replica = None  # handed to the sweep
        if leads and "eval_documents" not in attrs:
            assert self.study is not None
            self.study.set_user_attr("eval_documents", self.sweep.eval_documents()[task])
        self.task = task
        self.n_trials = int(attrs[N_TRIALS_ATTR])
        return self

    def _check_same_sweep(self, config: SweepConfig) -> None:
        mine = load_sweep(self.sweep_file)
        changed = differences(config.model_dump(mode="json"), mine.model_dump(mode="json"))
        if changed:
            key, (theirs, ours) = next(iter(changed.items()))
            more = f" (and {len(changed) - 1} more)" if len(changed) > 1 else ""
            raise PloraError(
                f"{self.sweep_file} differs from the sweep of study {self.study_name!r}: {key} is "
                f"{json.dumps(ours)} here, {json.dumps(theirs)} in the study{more}; join with the sweep's own file "
                "or leave --sweep-file out"
            )

    def serve(self) -> None:
        """Train the study's trials until the sweep's target is finished by all its processes (a
        follower of a tensor-parallel group: until its leader is done)."""
        assert self.sweep is not None, "open() first"
        if self.channel is not None and not self.channel.leads:
            self.sweep.workers[0].follow()
            return
        assert self.study is not None
        serve(self.study, PackedObjective(self.sweep, self.task), n_trials=self.n_trials)

    def interrupt(self) -> None:
        """Stop training from another thread (a signal handler's): :meth:`serve` then raises
        :class:`~plora_hpo.trials.TrialInterrupted` once in-flight adapters are checkpointed."""
        if self.sweep is not None:
            self.sweep.interrupt()

    def close(self) -> None:
        """Stop training (in-flight adapters are checkpointed and their trials re-queued) and
        deliver what this worker logged; the sweep's parent run stays open."""
        with phase("close"):
            if self.sweep is not None:
                self.sweep.close()
            if self.channel is not None:
                if self.channel.leads:
                    with contextlib.suppress(Exception):  # a follower that is gone needs no stop
                        self.channel.stop()
                with contextlib.suppress(Exception):  # a group that failed may not close cleanly
                    dist.destroy_process_group()
                self.channel = None
            if self.tracker is not None:
                try:
                    self.tracker.finish()
                finally:
                    self.tracker.close()

    def __enter__(self) -> SweepWorker:
        return self.open()

    def __exit__(self, *exc: object) -> None:
        self.close()
