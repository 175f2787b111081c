"""The sweep recipe: wires task data, base replicas, the trial pool, admission, reporter and one
device worker per device, and serves trial requests from any thread.

:meth:`PackedSweep.submit` puts a trial in the pool; each device's worker
(:mod:`plora_hpo.worker`) lets its admission policy (:mod:`plora_hpo.admission`) pick which
waiting trials train together, trains them, scores every adapter in batched evaluations, exports
each in PEFT format and reports it (:mod:`plora_hpo.reporting`). The study layer
(:mod:`plora_hpo.study`) decides what to run; the components never call back into the recipe.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from plora_hpo.admission import make_admission
from plora_hpo.checkpoints import CheckpointStore
from plora_hpo.config import SweepConfig
from plora_hpo.cpu_threads import use_available_cores
from plora_hpo.devices import resolve_devices
from plora_hpo.errors import ConfigError
from plora_hpo.replica import Replica, fresh_eval_tasks, load_base, load_replica, replica_key
from plora_hpo.reporting import MlflowReporter, NullReporter, PackSegment
from plora_hpo.resources import DeviceResources, device_spec, total_steps
from plora_hpo.tracking import SweepTracker
from plora_hpo.trials import PackProgress, TrialInterrupted, TrialOutcome, TrialPool, TrialRequest, TrialTicket
from plora_hpo.worker import DeviceWorker

if TYPE_CHECKING:
    from plora_hpo.pack_group import PackChannel


class PackedSweep:
    """Task data, the trial pool, admission, reporter, checkpoints and one worker per device.

    ``specs`` holds each task's resolved definition (lm-eval task, objective metric, direction).

    Args:
        config: the sweep file.
        tracker: MLflow tracking (parent run started by the caller); ``None`` records no runs.
        run_dir: where adapters, checkpoints and the pack record go.
        data_dir: offline task data (``None``: ``$PLORA_HPO_DATA_DIR`` or the Hub).
        device: see :func:`plora_hpo.devices.resolve_devices`.
        progress: front-end hooks (progress bars).
        label: names this process among several serving one study (a worker process): it is in
            every pack id (``pack-3@<label>``) and its pack record goes to ``packs/<label>/``.
        channel: this process's tensor-parallel group (:mod:`plora_hpo.pack_group`), on one
            device: the base replica is split over the group, and the worker leads or follows it.
    """

    def __init__(
        self,
        config: SweepConfig,
        *,
        tracker: SweepTracker | None,
        run_dir: Path,
        data_dir: str | None = None,
        device: str | None = None,
        progress: PackProgress | None = None,
        label: str | None = None,
        channel: PackChannel | None = None,
        replica: Replica | None = None,
    ) -> None:
        self.config = config
        self.channel = channel
        self.label = label
        self.tracker = tracker
        self.run_dir = run_dir
        self.data_dir = data_dir
        self.progress = progress or PackProgress()
        self.devices = resolve_devices(device)
        if channel is not None and len(self.devices) != 1:
            raise ConfigError(f"--device {device}: a process of a tensor-parallel group trains on one device")
        if any(d.type == "cpu" for d in self.devices):
            use_available_cores()
        if replica is None or channel is not None or replica.key != replica_key(config, self.devices[0], data_dir):
            replica = load_replica(config, self.devices[0], data_dir, sharded=channel is not None)
        self.base = replica.base
        self.specs = replica.specs
        self.tasks = replica.tasks
        self.pool = TrialPool()
        self.reporter: MlflowReporter | NullReporter = (
            NullReporter()
            if tracker is None
            else MlflowReporter(tracker, self.trial_params, lambda task: self.specs[task].primary_metric)
        )
        self._started_at = time.monotonic()
        self.clock_zero = time.time()
        """Unix time the pack segments' seconds count from (records of several processes merge by it)."""
        self._pack_ids = itertools.count()
        self._pack_id_lock = threading.Lock()
        self._started = False
        self._interrupted = False
        self._lock = threading.Lock()
        self._close_lock = threading.Lock()
        names = [f"{d}" if self.devices.count(d) == 1 else f"{d}#{i}" for i, d in enumerate(self.devices)]
        self.workers: list[DeviceWorker] = []
        for i, (dev, name) in enumerate(zip(self.devices, names)):
            resources = DeviceResources(
                device=dev,
                name=name,
                base=self.base if i == 0 else load_base(config, dev),
                eval_tasks=replica.eval_tasks if i == 0 else fresh_eval_tasks(config, self.specs, data_dir),
                tasks=self.tasks,
                gpu=device_spec(dev),
            )
            self.workers.append(
                DeviceWorker(
                    resources,
                    config=config,
                    pool=self.pool,
                    admission=make_admission(config.pack.policy, solver=config.pack.solver),
                    reporter=self.reporter,
                    checkpoints=self.checkpoints,
                    adapter_root=run_dir / "adapters",
                    progress=self.progress,
                    pack_id=self._next_pack_id,
                    clock=self._clock,
                    channel=channel,
                )
            )

    # --- what the components are given --------------------------------------------------------
    def total_steps(self, task: str, config: Any) -> int:
        return total_steps(self.config.budget, config, len(self.tasks[task].examples))

    def checkpoints(self, task: str) -> CheckpointStore:
        return CheckpointStore(checkpoint_dir(self.run_dir, self.config, task))

    def _next_pack_id(self, worker_name: str) -> str:
        with self._pack_id_lock:
            n = next(self._pack_ids)
        where = [self.label] if self.label else []
        if len(self.devices) > 1:
            where.append(worker_name)
        return f"pack-{n}@{'/'.join(where)}" if where else f"pack-{n}"

    def _clock(self) -> float:
        return time.monotonic() - self._started_at

    def eval_documents(self) -> dict[str, str]:
        """Per task, which evaluation documents a trial's final score uses: all of them, or the
        seeded (stratified) sample of ``evaluation.limit`` that every adapter is scored on."""
        from plora_hpo.evaluation.runner import lm_eval_tasks
        from plora_hpo.evaluation.sampling import describe

        limit, worker = self.config.evaluation.limit, self.workers[0]
        out = {}
        for task in self.config.tasks:
            picked = (worker.document_sample(task, limit) if limit else None) or {}
            lm_tasks = lm_eval_tasks(worker.resources.eval_tasks[task])
            out[task] = "; ".join(describe(t, picked.get(t.config.task), seed=self.config.seed) for t in lm_tasks)
        return out

    def trial_params(self, request: TrialRequest) -> dict[str, Any]:
        cfg = self.config
        return {
            **request.config.as_params(),
            "task": request.task,
            "base_model": self.base.name,
            "target_modules": ",".join(cfg.target_modules),
            "seq_len": cfg.seq_len,
            "total_steps": self.total_steps(request.task, request.config),
            "lr_schedule": cfg.train.lr_schedule,
        }

    # --- submitting work ----------------------------------------------------------------------
    def submit(self, request: TrialRequest) -> TrialTicket:
        """Put a trial in the pool; a worker's admission policy places it in a pack. Thread-safe."""
        if self._interrupted:
            ticket = TrialTicket(request)
            ticket.fail(TrialInterrupted(f"{request.adapter_id}: the sweep was stopped"))
            return ticket
        with self._lock:
            if not self._started:
                self.pool.reopen()
                for worker in self.workers:
                    worker.start()
                self._started = True
        ticket = TrialTicket(request)
        self.pool.put(ticket)
        return ticket

    def run_pack(self, requests: Sequence[TrialRequest]) -> list[TrialOutcome]:
        """Train ``requests`` (together, as far as ``pack.size`` and memory allow) and wait for all.

        Raises the first error a trial met, after every trial has ended.
        """
        tickets = [self.submit(r) for r in requests]
        outcomes, errors = [], []
        for ticket in tickets:
            try:
                outcomes.append(ticket.wait())
            except BaseException as err:
                errors.append(err)
        if errors:
            raise errors[0]
        return outcomes

    @property
    def concurrency(self) -> int:
        """How many trials can train at once: pack size × workers (``study.optimize``'s n_jobs)."""
        return self.config.pack.size * len(self.workers)

    @property
    def pack_segments(self) -> list[PackSegment]:
        """Every pack composition that ran so far: members, device, predicted and measured figures."""
        return list(self.reporter.segments)

    def __enter__(self) -> PackedSweep:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def interrupt(self) -> None:
        """Stop for good from any thread (preemption): like :meth:`close`, and trials submitted
        afterwards fail with :class:`~plora_hpo.trials.TrialInterrupted` instead of training."""
        self._interrupted = True
        self.close()

    def close(self) -> None:
        """Stop the workers (a pack still training checkpoints its adapters first; idempotent,
        thread-safe), write the record of pack decisions (:meth:`write_pack_record`) and deliver
        the live loss curves still pending."""
        with self._close_lock:
            for ticket in self.pool.close():  # trials no worker took any more
                ticket.fail(TrialInterrupted(f"{ticket.request.adapter_id}: the sweep stopped before it started"))
            if self._started:
                for worker in self.workers:
                    worker.join()
                self._started = False
                self.write_pack_record()
            self.reporter.close()

    def write_pack_record(self) -> Path | None:
        """``<run_dir>/packs/[<label>/]packs.json`` and ``packs.png`` (what ran next to what was
        planned), also logged to the MLflow parent run there. None when no pack ran."""
        from plora_hpo.pack_record import write_pack_record

        segments = self.pack_segments
        if not segments:
            return None
        where = Path("packs", self.label) if self.label else Path("packs")
        folder = write_pack_record(segments, self.run_dir / where, started_at=self.clock_zero, title=self.config.name)
        if self.tracker is not None and self.tracker.parent_run_id is not None:
            self.tracker.log_folder(self.tracker.parent_run_id, folder, where.as_posix())
        return folder


def checkpoint_dir(run_dir: Path, config: SweepConfig, task: str) -> Path:
    return run_dir / "checkpoints" / f"{config.name}-{task}"
