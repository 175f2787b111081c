"""One device's training loop: packs that trials join when there is room and leave when done.

A :class:`DeviceWorker` owns a replica of the frozen base model on its device
(:class:`~plora_hpo.resources.DeviceResources`) and serves the sweep's
:class:`~plora_hpo.trials.TrialPool`. Which waiting trials join is its
:class:`~plora_hpo.admission.AdmissionPolicy`'s decision (the planner's pack ILP by default),
asked when a pack starts (after waiting up to ``pack.gather_seconds`` for proposals) and again
whenever the pack's membership or the pool changed, so the slot of a finished, pruned or failed
adapter trains the trial the policy picks without restarting the pack.

Per step the worker also: checkpoints adapters a few times over their steps
(``train.checkpoint_every``); scores adapters on a slice of the eval set every
``pruning.interval`` steps and asks their trial whether to stop; scores adapters that finished,
copies each out of the pack and frees its slot, while threads of its own write the adapter
(``exporter``), then report its run and hand its trial the outcome (``finisher``); removes settled
trials' checkpoints once none is left to record; feeds warm step times back into its cost model.
A step that runs out of device memory is undone and the pack split: the adapters that still fit
(by the corrected memory estimate) train on, the others wait in host memory and rejoin when room
frees up. A trial that another process took over (its ticket withdrawn) leaves
at the next step boundary, and nothing more of it is written here.

Everything the worker tells the outside goes through its reporter, progress hooks and trial
tickets; it never calls back into the sweep that built it.

In a tensor-parallel group (``pack.degree`` > 1, :mod:`plora_hpo.pack_group`) the leader's worker
runs this loop and sends each engine call of its packs to the followers, whose workers
:meth:`~DeviceWorker.follow` it: the same adapters join and leave, every step, score, checkpoint
capture and export runs on every rank. A pack whose group fails (a follower died, a rank ran
out of memory) hands its trials back to resume from their last checkpoints, and the leader stops.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
import logging
import math
import statistics
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from plora_hpo.admission import AdmissionPolicy, Candidate, Room
from plora_hpo.checkpoint_writer import CheckpointWriter
from plora_hpo.checkpoints import NoSpaceLeft, as_no_space_left
from plora_hpo.engine import AdapterJob, OptimizerSettings, PackedLoraModel, PackedTrainer, StepReport
from plora_hpo.engine.adapter_state import (
    AdapterState,
    abort_step,
    capture,
    capture_bytes_bound,
    restore,
    stream_positions,
)
from plora_hpo.engine.export import peft_adapter_files
from plora_hpo.errors import CheckpointError, first_line
from plora_hpo.job_thread import JobThread
from plora_hpo.pacing import SharePacer
from plora_hpo.pack_group import STOP, GroupFailed
from plora_hpo.planner.cost_model import ROTATION_TURNS
from plora_hpo.reporting import PackSegment, TrialReporter
from plora_hpo.resources import AdapterExporter, AdapterScorer, DeviceResources, total_steps, usable_memory_bytes
from plora_hpo.tasks import padded_length
from plora_hpo.timeline import enabled as timeline_enabled
from plora_hpo.timeline import phase, watch_triton_compiles
from plora_hpo.trials import PackProgress, PoolClosed, TrialInterrupted, TrialOutcome, TrialPool, TrialWithdrawn

if TYPE_CHECKING:
    from plora_hpo.adapter import AdapterConfig
    from plora_hpo.checkpoints import CheckpointStore
    from plora_hpo.config import SweepConfig
    from plora_hpo.engine import PackStats
    from plora_hpo.pack_group import PackChannel
    from plora_hpo.trials import TrialRequest, TrialTicket

log = logging.getLogger(__name__)

LIVE_LOG_SECONDS = 10.0
"""How often the loss curves of the trials in a pack are reported while they train."""
LOAD_FACTOR = 0.9  # the planner's default C: packs use at most 90% of device memory
CALIBRATION_STEPS = 8  # warm steps of one pack composition that become a cost-model observation
ROTATE_MIN_LEAD = 25
"""A member yields its place in a full pack (``pack.rotate``) to a waiting trial that has more
steps left by at least 1 / :data:`~plora_hpo.planner.cost_model.ROTATION_TURNS` of that trial's
steps (and by at least ``ROTATE_MIN_LEAD``): a trial moves in and out about that many times, and
the pack's members end within that many steps of each other."""
FINISHING_QUEUE_BYTES = 1 << 30
"""Host bytes of finished adapters' copies a device may queue for writing before its loop waits."""


@dataclass
class _Slot:
    """An admitted trial: its ticket, MLflow run, loss curve and where it started."""

    ticket: TrialTicket
    run_id: str
    curve: list[tuple[int, float, float]] = field(default_factory=list)  # (step, loss, lr)
    intermediate: list[tuple[int, float]] = field(default_factory=list)
    resumed_from: int = 0

    @property
    def request(self) -> TrialRequest:
        return self.ticket.request


class DeviceWorker:
    """Trains the pool's trials on one device, one continuously refilled pack at a time.

    Args:
        resources: the device, its base replica, task data and eval tasks.
        config: the sweep settings (pack size, budget, training, evaluation, pruning).
        pool: where proposed trials wait.
        admission: decides which waiting trials join a pack.
        reporter: where trial runs and pack decisions are recorded.
        checkpoints: a task's checkpoint store.
        adapter_root: where finished adapters are exported (one folder per adapter id).
        progress: front-end hooks.
        pack_id: a new pack id for this worker's name (unique across the sweep's workers).
        clock: seconds since the sweep started (pack segments are stamped with it).
        scorer: scores adapters (default: the tasks' lm-eval definitions in ``resources.eval_tasks``
            with the sweep's evaluation settings, many adapters per batch).
        exporter: writes a finished adapter (default: PEFT's format, loadable by ``PeftModel``).
        channel: this process's tensor-parallel group (None: the pack trains on this device alone);
            the leader's worker serves the pool, a follower replays the leader's calls (:meth:`follow`).
    """

    def __init__(
        self,
        resources: DeviceResources,
        *,
        config: SweepConfig,
        pool: TrialPool,
        admission: AdmissionPolicy,
        reporter: TrialReporter,
        checkpoints: Callable[[str], CheckpointStore],
        adapter_root: Path,
        progress: PackProgress,
        pack_id: Callable[[str], str],
        clock: Callable[[], float],
        scorer: AdapterScorer | None = None,
        exporter: AdapterExporter | None = None,
        channel: PackChannel | None = None,
    ) -> None:
        from plora_hpo.planner import CostModel, Workload, load_calibration
        from plora_hpo.planner.model_names import shape_name_for_shape

        self.resources = resources
        self.config = config
        self.pool = pool
        self.admission = admission
        self.reporter = reporter
        self.checkpoints = checkpoints
        self.adapter_root = adapter_root
        self.progress = progress
        self.new_pack_id = pack_id
        self.clock = clock
        self.channel = channel
        self.degree = 1 if channel is None else channel.degree  # GPUs each pack is split over
        self.score: AdapterScorer = scorer or self._lm_eval_scores
        self._samples: dict[tuple[str, int], dict[str, list[int]] | None] = {}
        self.export: AdapterExporter = exporter or self._peft_export
        self.device = resources.device
        self.name = resources.name
        self.base = resources.base
        self.gpu = resources.gpu
        self.packed = PackedLoraModel(self.base.model, config.target_modules)
        if self.device.type == "cuda":  # where kernels compile: a step that compiles shows as such
            watch_triton_compiles()
        shape_name = shape_name_for_shape(self.base.shape)
        self.cost = CostModel(
            Workload(
                self.base.shape,
                padded_length(config.seq_len, (e for task in resources.tasks.values() for e in task.examples)),
                tuple(config.target_modules),
                self.dtype_bytes(),
                checkpointing=config.pack.activation_checkpointing,
                micro_batch_tokens=config.pack.micro_batch_tokens,
            ),
            self.gpu,
            load_calibration(shape_name, self.gpu.name) if shape_name else None,
        )
        self.pacer = SharePacer(config.train.checkpoint_overhead)  # checkpoint saves, sized in LoRA parameters
        self.writer = CheckpointWriter(f"plora-{self.name}")
        # finished trials are recorded in two stages, a thread each, so that one trial's MLflow run is
        # reported while the next one's files are written. The exports hold the adapters' host copies:
        # a copy or two ahead is all the overlap needs, and page-locked buffers freed by written
        # copies are what the next copies reuse. The finishing thread reports runs and hands results over.
        self.exporter = JobThread(f"plora-{self.name}-exports", FINISHING_QUEUE_BYTES)
        self.finisher = JobThread(f"plora-{self.name}-finishing", 0)
        # settled trials' checkpoints whose removal waits (remove_checkpoint)
        self._held_removals: list[tuple[CheckpointStore, int]] = []
        self._removals_lock = threading.Lock()
        self.memory_correction = 1.0  # raised after an out-of-memory step: measured need ÷ prediction
        # the first full disk a finished trial's record met: the records queued behind it resume
        # their trials without writing (each write would fill the disk again, under the stores' writes)
        self.full_disk: NoSpaceLeft | None = None
        self.parked: deque[tuple[TrialTicket, AdapterState | None]] = deque()  # waiting to (re)join
        self._thread = threading.Thread(target=self._serve, name=f"plora-{self.name}", daemon=True)

    def _lm_eval_scores(
        self, packed: PackedLoraModel, adapter_ids: Sequence[str], task: str, limit: int | None
    ) -> dict[str, dict[str, float]]:
        from plora_hpo.evaluation import evaluate_adapters

        ev = self.config.evaluation
        return evaluate_adapters(
            packed,
            self.base.tokenizer,
            list(adapter_ids),
            self.resources.eval_tasks[task],
            samples=None if limit is None else self.document_sample(task, limit),
            batch_size=ev.batch_size,
            max_new_tokens=ev.max_new_tokens,
            bootstrap_iters=ev.bootstrap_iters,
        )

    def document_sample(self, task: str, limit: int) -> dict[str, list[int]] | None:
        """The evaluation documents a ``limit``-document score of ``task`` uses: the same seeded,
        stratified sample for every adapter of the sweep (None: the limit covers them all)."""
        key = (task, limit)
        if key not in self._samples:
            from plora_hpo.evaluation.runner import lm_eval_tasks
            from plora_hpo.evaluation.sampling import document_sample

            picked = {}
            for lm_task in lm_eval_tasks(self.resources.eval_tasks[task]):
                indices = document_sample(lm_task, limit, seed=self.config.seed)
                if indices is not None:
                    picked[lm_task.config.task] = indices
            self._samples[key] = picked or None
        return self._samples[key]

    def _peft_export(self, packed: PackedLoraModel, adapter_id: str, directory: Path) -> Callable[[], Path]:
        files = peft_adapter_files(packed, adapter_id, self.base.pretrained_path)
        return (lambda: directory) if files is None else functools.partial(files.write, directory)

    def start(self) -> None:
        self._thread.start()

    def join(self, timeout: float | None = None) -> None:
        self._thread.join(timeout)

    def dtype_bytes(self) -> int:
        return next(self.base.model.parameters()).element_size()

    def total_steps(self, request: TrialRequest) -> int:
        return total_steps(self.config.budget, request.config, len(self.resources.tasks[request.task].examples))

    def optimizer_settings(self) -> OptimizerSettings:
        t = self.config.train
        return OptimizerSettings(
            lr_schedule=t.lr_schedule,
            warmup_ratio=t.warmup_ratio,
            weight_decay=t.weight_decay,
            max_grad_norm=t.max_grad_norm,
        )

    # --- admission --------------------------------------------------------------------------
    @property
    def memory_limit(self) -> float:
        return LOAD_FACTOR * usable_memory_bytes(self.device, self.gpu.memory_bytes)

    def predicted_memory(self, configs: list[Any]) -> float:
        return self.memory_correction * self.cost.peak_memory(configs, self.degree)

    def raise_finishing_failure(self) -> None:
        """Raise the first error a finished trial's record raised since the last look, if any."""
        self.exporter.raise_failure()
        self.finisher.raise_failure()

    def drain_finishing(self) -> None:
        """Wait until every finished trial queued so far is recorded (files, then run and result);
        then raise the first error either stage kept."""
        errors: list[BaseException] = []
        for stage in (self.exporter, self.finisher):  # the exports queue the reports: they drain first
            try:
                stage.drain()
            except BaseException as err:
                errors.append(err)
        for err in errors[1:]:
            log.info("recording a finished trial failed too: %s", first_line(err))
        if errors:
            raise errors[0]

    def remove_checkpoint(self, request: TrialRequest) -> None:
        """Remove a settled trial's checkpoint later: when this device trains its next step with no
        finished trial left to record, or waits for trials, or stops serving.

        Removing a file of gigabytes keeps the file system's journal busy for tenths of a second,
        and every store commit waits for it meanwhile: MLflow's runs, Optuna's results and
        heartbeats. When a pack's trials finish together, removals interleaved with their records
        and results made each of those several times slower, the device idle meanwhile.
        """
        with self._removals_lock:
            self._held_removals.append((self.checkpoints(request.task), request.lineage))

    def release_removals(self, *, unless_recording: bool = False) -> None:
        """Hand the held checkpoint removals to the writer (each runs after the saves queued
        before it); ``unless_recording``: not while a finished trial is still being recorded."""
        if not self._held_removals:  # the training loop asks every step
            return
        if unless_recording and not (self.exporter.idle() and self.finisher.idle()):
            return
        with self._removals_lock:
            held, self._held_removals = self._held_removals, []
        for store, lineage in held:
            self.writer.delete(store, lineage)

    def fits(self, configs: list[Any], limit: float | None = None) -> bool:
        """Whether ``configs`` make a pack this device takes: at most ``pack.size`` of them, predicted
        within ``limit`` bytes (default: the device's memory limit)."""
        limit = self.memory_limit if limit is None else limit
        return len(configs) <= self.config.pack.size and self.predicted_memory(configs) <= limit

    def room(self, members: list[Any], *, idle_peers: int = 0) -> Room:
        """The device's room for a pack holding ``members`` (in the cost model's units)."""
        return Room(
            members=tuple(members),
            free_slots=max(0, self.config.pack.size - len(members)),
            idle_peers=idle_peers,
            memory_limit=self.memory_limit / self.memory_correction,
            cost_model=self.cost,
            degree=self.degree,
        )

    def save_checkpoint(self, request: TrialRequest, state: AdapterState, extra: dict[str, str]) -> None:
        """Queue one adapter's resumable state for writing (``extra``: its MLflow run and adapter id)."""
        with phase("checkpoint"):
            self.writer.save(self.checkpoints(request.task), request.lineage, state, extra)

    def _serve(self) -> None:
        if self.device.type == "cuda":  # Triton launches on the thread's current device
            torch.cuda.set_device(self.device)
        try:
            self._serve_packs()
        finally:
            self.release_removals()
            try:
                self.writer.flush()
            except Exception as err:  # the lineage keeps its previous checkpoint
                log.warning("%s: the last checkpoint writes failed: %s", self.name, first_line(err))

    def _serve_packs(self) -> None:
        while True:
            if not self.parked:
                self.release_removals()
                try:
                    with phase("idle"):
                        self.pool.wait()
                except PoolClosed:
                    return
            try:
                _Pack(self).run()
            except _Shutdown:
                self._interrupt_parked()
                return
            except GroupFailed:
                return
            except BaseException as err:  # a pack that could not start: its waiting trials get the error
                log.exception("%s: a pack failed to start", self.name)
                while self.parked:
                    self.parked.popleft()[0].fail(err)

    def follow(self) -> None:
        """A follower rank of a tensor-parallel group: make the leader's pack engine calls, in its
        order, until the leader is done (a leader that dies ends this with its connection error)."""
        assert self.channel is not None and not self.channel.leads, "only a follower follows"
        pack: _Pack | None = None
        while True:
            name, args = self.channel.receive()
            if name == STOP:
                return
            if name == _NEW_PACK:
                pack = _Pack(self)
                continue
            assert pack is not None and name in _REPLAYED, name
            try:
                getattr(pack, name)(*args)
            except Exception as err:  # the leader's call raised the same, and it handles that
                log.info("%s: the leader's %s raised %s", self.name, name, first_line(err))

    def _interrupt_parked(self) -> None:
        """The sweep is closing: trials waiting for room keep their state for a rerun."""
        parked = list(self.parked)
        self.parked.clear()
        for ticket, state in parked:
            request = ticket.request
            if state is not None:
                self.save_checkpoint(request, state, {"run_id": request.run_id or "", "adapter_id": request.adapter_id})
        self.writer.flush()  # on disk before anyone may take the trials again
        for ticket, _ in parked:
            ticket.fail(TrialInterrupted(f"{ticket.request.adapter_id}: the sweep stopped; a rerun resumes it"))


class _Shutdown(Exception):
    """The sweep is closing: the worker stops at its next look at the queue."""


_NEW_PACK = "new_pack"
_REPLAYED: set[str] = set()


def _replayed(method: Callable[..., Any]) -> Callable[..., Any]:
    """An engine call of a pack that every rank of a tensor-parallel group makes: on the leader
    it is first sent to the followers (its arguments pickled), which make it on their own pack."""
    _REPLAYED.add(method.__name__)

    @functools.wraps(method)
    def call(pack: _Pack, *args: Any) -> Any:
        channel = pack.worker.channel
        if channel is not None and channel.leads:
            channel.send(method.__name__, args)
        return method(pack, *args)

    return call


def _alloc_retries(device: torch.device) -> int:
    return int(torch.cuda.memory_stats(device).get("num_alloc_retries", 0))


class _Pack:
    """One pack's life on a worker: from its first admitted trial until it has none left."""

    def __init__(self, worker: DeviceWorker) -> None:
        self.worker = worker
        if worker.channel is not None and worker.channel.leads:
            worker.channel.send(_NEW_PACK, ())
        self.config = worker.config
        self.reporter = worker.reporter
        self._pack_id: str | None = None
        self.trainer = PackedTrainer(
            worker.packed,
            settings=worker.optimizer_settings(),
            pad_id=worker.base.tokenizer.pad_token_id,
            device=worker.device,
            micro_batch_tokens=self.config.pack.micro_batch_tokens,
            activation_checkpointing=self.config.pack.activation_checkpointing,
        )
        self.slots: dict[str, _Slot] = {}
        self.packed_steps = 0
        self._compiled = False  # the pack's kernels, compiled before its first step
        self._stable_since = 0  # index into stats.step_seconds where the composition last changed
        self._composition = 0  # bumped on every join or leave
        self._planned_for: tuple[int, int] | None = None  # (pool version, composition) last planned for
        self._segment: PackSegment | None = None
        self._segment_configs: list[AdapterConfig] = []  # the adapters of the open segment
        self._joined: list[str] = []
        self._reported_at = time.monotonic()
        self._saves_due: dict[str, None] = {}  # adapters whose checkpoint fell due, in order, not yet saved
        # (composition, swaps that do not fit: a waiting trial and the members it would replace)
        self._unfit: tuple[int, set[tuple[TrialTicket, tuple[str, ...]]]] = (-1, set())

    # --- engine calls (made by every rank of a tensor-parallel group) ---------------------------
    @_replayed
    def add_adapter(
        self, adapter_id: str, task: str, config: AdapterConfig, steps: int, state: AdapterState | None
    ) -> None:
        """Train a new adapter, or one from its saved ``state``, for ``steps`` steps on ``task``."""
        job = AdapterJob(adapter_id, config, self.worker.resources.tasks[task].examples, steps)
        with phase("join"):
            if state is None:
                self.trainer.add_job(job)
            else:
                restore(self.trainer, job, state)

    @_replayed
    def stop_training(self, adapter_id: str) -> None:
        """Out of the trainer; its weights stay in the model (to score and export)."""
        self.trainer.remove_job(adapter_id)

    @_replayed
    def drop_adapter(self, adapter_id: str) -> None:
        """Out of the trainer and out of the model, whichever it is still in."""
        if adapter_id in self.trainer.jobs:
            self.trainer.remove_job(adapter_id)
        if adapter_id in self.worker.packed.configs:
            self.worker.packed.remove_adapter(adapter_id)

    @_replayed
    def train_step(self) -> list[StepReport]:
        device = self.worker.device
        watch = device.type == "cuda" and timeline_enabled()
        with phase("train") as details:
            before = _alloc_retries(device) if watch else 0
            tokens = self.trainer.stats.padded_tokens
            reports = self.trainer.step()
            if watch:  # the caching allocator emptied its cache to fit the step: a step slowed by memory
                details["alloc_retries"] = _alloc_retries(device) - before
            details["padded_tokens"] = self.trainer.stats.padded_tokens - tokens  # the step's size, padding included
        return reports

    @_replayed
    def undo_step(self, positions: dict[str, tuple[int, int]]) -> None:
        abort_step(self.trainer, positions)

    @_replayed
    def capture_state(self, adapter_id: str, curve: list[tuple[int, float, float]]) -> AdapterState:
        with phase("checkpoint"):
            return capture(self.trainer, adapter_id, curve)

    @_replayed
    def score(self, task: str, adapter_ids: list[str], limit: int | None) -> dict[str, dict[str, float]]:
        with phase("evaluate"):
            return self.worker.score(self.worker.packed, adapter_ids, task, limit)

    @_replayed
    def export_adapter(self, adapter_id: str, directory: Path) -> Callable[[], Path]:
        """The adapter copied out of the pack; returns the write of it (for the export thread)."""
        with phase("export"):
            return self.worker.export(self.worker.packed, adapter_id, directory)

    @property
    def pack_id(self) -> str:
        """Taken when the first trial joins, so packs that found nothing to train use no id."""
        if self._pack_id is None:
            self._pack_id = self.worker.new_pack_id(self.worker.name)
        return self._pack_id

    # --- membership -------------------------------------------------------------------------
    def _configs(self, extra: Any = None) -> list[Any]:
        configs = [s.request.config for s in self.slots.values()]
        return configs + ([extra] if extra is not None else [])

    def _admit_parked(self) -> None:
        kept: deque = deque()
        while self.worker.parked:
            ticket, state = self.worker.parked.popleft()
            if self.worker.fits(self._configs(ticket.request.config)) or not self.slots:
                self._join(ticket, state)
            else:
                kept.append((ticket, state))
        self.worker.parked = kept

    def admit(self, *, gather_seconds: float = 0.0) -> None:
        """Parked trials first; then the ones the admission policy picks from the pool.

        A starting pack first waits up to ``gather_seconds`` for the pool to hold a full pack.
        The room it offers names the other devices waiting for trials, so the policy can share
        the pool among them. The policy is asked again only when the pool or the pack's
        membership changed. A closed pool stops the pack here, at a step boundary.
        """
        if self.worker.pool.closed:  # the sweep is closing: checkpoint and stop at this step boundary
            raise _Shutdown
        self._admit_parked()
        if self.worker.parked:  # the ones that were here first do not fit yet: they go first
            return
        free = self.config.pack.size - len(self.slots)
        if free <= 0:
            return
        try:
            if not self.slots:  # a pack planned for this device while it was idle comes first
                reserved = self.worker.pool.claim()
                if reserved:
                    for ticket in reserved:
                        self._join(ticket, None)
                    self._planned_for = (self.worker.pool.version, self._composition)
                    return
            if gather_seconds > 0:
                with phase("gather"):
                    self.worker.pool.wait(at_least=free, timeout=gather_seconds)
            if self._planned_for == (self.worker.pool.version, self._composition):
                return
            room = self.worker.room(self._configs(), idle_peers=self.worker.pool.idle_workers)
            policy = self.worker.admission

            def choose(waiting: Sequence[TrialTicket]) -> tuple[list[int], list[list[int]]]:
                with phase("planner"):
                    mine = policy.select(
                        [Candidate(t.request.config, self.worker.total_steps(t.request)) for t in waiting], room
                    )
                return mine, (policy.last.peer_packs if policy.last else [])

            tickets = self.worker.pool.take(choose)
        except PoolClosed:
            raise _Shutdown from None
        for ticket in tickets:
            self._join(ticket, None)
        self._planned_for = (self.worker.pool.version, self._composition)

    def _join(self, ticket: TrialTicket, state: AdapterState | None) -> None:
        request = ticket.request
        if ticket.withdrawn is not None:  # taken over while it waited
            self._withdraw(ticket)
            return
        self._make_way_for_retry(ticket)
        run_id = None
        try:
            store = self.worker.checkpoints(request.task)
            saved_run_id, from_disk = None, state is None
            if state is None:
                with phase("checkpoint"):
                    self.worker.writer.flush()  # a save of this lineage may still be queued
                    found = store.load(request.lineage)
                if found is not None:
                    state, extra = found
                    saved_run_id = extra.get("run_id")
            with phase("mlflow"):
                run_id = self.reporter.trial_started(request, saved_run_id or request.run_id, self.pack_id)
            steps = self.worker.total_steps(request)
            try:
                self.add_adapter(request.adapter_id, request.task, request.config, steps, state)
            except ValueError as err:
                if not from_disk:
                    raise
                raise CheckpointError(
                    f"{store.path(request.lineage)} does not fit this sweep ({err}); "
                    "delete it to retrain that trial from step 0"
                ) from None
        except BaseException as err:
            ticket.fail(err)
            if run_id is not None:
                self.reporter.trial_abandoned(run_id)
            self.drop_adapter(request.adapter_id)
            return
        slot = _Slot(ticket, run_id)
        if state is not None:
            slot.curve, slot.resumed_from = list(state.curve), state.steps_done
            log.info("%s resumes at step %d", request.adapter_id, state.steps_done)
        self.slots[request.adapter_id] = slot
        self._joined.append(request.adapter_id)
        if request.on_started is not None:
            request.on_started(run_id)
        self._composition_changed()

    def _leave(self, adapter_id: str) -> None:
        """Out of the pack and out of the model (its outcome is already recorded)."""
        self.drop_adapter(adapter_id)
        del self.slots[adapter_id]
        self._composition_changed()

    def _let_go_withdrawn(self) -> None:
        """Members and parked trials another process took over leave (:meth:`_withdraw`)."""
        for adapter_id, slot in list(self.slots.items()):
            if slot.ticket.withdrawn is not None:
                with phase("leave"):
                    self._leave(adapter_id)
                self._withdraw(slot.ticket)
        gone = [ticket for ticket, _ in self.worker.parked if ticket.withdrawn is not None]
        if gone:
            self.worker.parked = deque(entry for entry in self.worker.parked if entry[0].withdrawn is None)
            for ticket in gone:
                self._withdraw(ticket)

    def _make_way_for_retry(self, ticket: TrialTicket) -> None:
        """A trial that is here already under the joining trial's adapter name (its lineage) was
        taken over, and this joining one is its retry: the predecessor leaves first, so the retry
        resumes from the checkpoint it leaves."""
        adapter_id = ticket.request.adapter_id
        held = [self.slots[adapter_id].ticket] if adapter_id in self.slots else []
        held += [t for t, _ in self.worker.parked if t.request.adapter_id == adapter_id]
        for predecessor in held:
            predecessor.withdraw(f"its retry, trial {ticket.request.number}, takes its place")
        if held:
            self._let_go_withdrawn()

    def _withdraw(self, ticket: TrialTicket) -> bool:
        """If another process took the ticket's trial over, hand the ticket :class:`TrialWithdrawn`
        and say so (True): its retry continues the lineage's checkpoint and the MLflow run, so
        nothing of it is written here, and its checkpoint stays."""
        if ticket.withdrawn is None:
            return False
        log.warning("%s: %s leaves: %s", self.worker.name, ticket.request.adapter_id, ticket.withdrawn)
        ticket.fail(TrialWithdrawn(f"{ticket.request.adapter_id}: {ticket.withdrawn}"))
        return True

    def _composition_changed(self) -> None:
        self._composition += 1
        self._close_segment()
        self._stable_since = len(self.trainer.stats.step_seconds)
        if self.worker.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.worker.device)

    # --- the record of pack decisions -------------------------------------------------------------
    def _close_segment(self) -> None:
        """End the current composition's segment (measured figures) and open the next one."""
        seg = self._segment
        if seg is not None:
            seconds = self.trainer.stats.step_seconds[self._stable_since :]
            seg.end = self.worker.clock()
            seg.steps = len(seconds)
            warm = seconds[1:] if len(seconds) > 1 else []
            seg.measured_step_seconds = sum(warm) / len(warm) if warm else None
            if self.worker.device.type == "cuda" and seconds:
                seg.measured_peak_gib = torch.cuda.max_memory_allocated(self.worker.device) / 2**30
            if len(warm) > CALIBRATION_STEPS:  # refit on its first steps: now on all of them
                try:
                    with phase("calibrate"):
                        self._calibrate(self._segment_configs, warm)
                except OSError as err:  # this also runs as a failed pack ends: its error is the one raised
                    log.warning("%s: its cost-model record was not saved: %s", self.pack_id, first_line(err))
            if seg.steps or seg.joined:
                with phase("mlflow"):
                    self.reporter.pack_segment(seg)
            self._segment = None
        if not self.slots:
            return
        ids = list(self.slots)
        configs = self._segment_configs = self._configs()
        decision = self.worker.admission.last
        self._segment = PackSegment(
            pack_id=self.pack_id,
            device=self.worker.name,
            policy=self.worker.admission.name,
            solver=decision.solver if decision else "",
            plan_seconds=decision.seconds if decision else 0.0,
            members=ids,
            labels=[self.slots[a].request.config.label() for a in ids],
            joined=self._joined,
            start=self.worker.clock(),
            predicted_step_seconds=self.worker.cost.step_seconds(configs, self.worker.degree),
            predicted_peak_gib=self.worker.predicted_memory(configs) / 2**30,
            memory_limit_gib=self.worker.memory_limit / 2**30,
        )
        self._joined = []

    # --- the loop ---------------------------------------------------------------------------
    def run(self) -> None:
        progress = self.worker.progress
        started = False
        try:
            self.admit(gather_seconds=self.config.pack.gather_seconds)
            if not self.slots:  # another worker took what was waiting
                return
            progress.pack_started(self.pack_id, len(self.slots), self._furthest_step())
            started = True
            while self.slots:
                self._let_go_withdrawn()
                self._collect_done()  # trials resumed at their last step need no more training
                if self.trainer.jobs:
                    self._step()
                    self._rotate()
                self.admit()
                progress.pack_update(self.pack_id, self.packed_steps, self._furthest_step(), len(self.slots))
                self.worker.raise_finishing_failure()
                if not self.slots:  # its trials' results bring the next proposals: they may join this pack
                    with phase("finishing"):
                        self.worker.drain_finishing()
                    self.admit(gather_seconds=self.config.pack.gather_seconds)
        except _Shutdown:  # the sweep is closing mid-pack (interrupted): keep what trained so far
            for adapter_id, slot in self.slots.items():
                if adapter_id in self.trainer.jobs:
                    self.worker.save_checkpoint(
                        slot.request,
                        self.capture_state(adapter_id, slot.curve),
                        {"run_id": slot.run_id, "adapter_id": adapter_id},
                    )
            self.worker.writer.flush()  # on disk before anyone may take the trials again
            for adapter_id, slot in list(self.slots.items()):
                self.reporter.trial_interrupted(slot)
                slot.ticket.fail(TrialInterrupted(f"{adapter_id}: the sweep stopped; a rerun resumes it"))
                self._leave(adapter_id)
            raise
        except BaseException as err:  # delivered to every trial of the pack; the worker serves on
            if self.worker.channel is not None:
                self._group_failed(err)
            full = isinstance(err, NoSpaceLeft)
            for adapter_id, slot in list(self.slots.items()):
                slot.ticket.fail(err)
                try:
                    if full:  # resumable from its last checkpoint once there is room
                        self.reporter.trial_interrupted(slot)
                    else:
                        self.reporter.trial_abandoned(slot.run_id)
                    self._leave(adapter_id)
                except Exception:  # the first error is the one to report
                    log.info("%s: cleaning up %s after an error failed too", self.pack_id, adapter_id)
            if full:  # every later checkpoint would fail too: the sweep stops here
                for ticket in self.worker.pool.close():
                    ticket.fail(TrialInterrupted(f"{ticket.request.adapter_id}: the sweep stopped ({err})"))
            if not isinstance(err, Exception):
                raise
        finally:
            try:
                self.worker.drain_finishing()  # trials that left before an error still get their results
            except BaseException as err:  # its own trial has it; the pack's first error is the one raised
                log.info("%s: recording a finished trial failed too: %s", self.pack_id, first_line(err))
            self._close_segment()
            if started:
                progress.pack_finished(self.pack_id)

    def _group_failed(self, err: BaseException) -> None:
        """A tensor-parallel pack that raised: its ranks may be out of step (or one is gone), so
        its trials, and those still waiting, go back to resume from their last checkpoints
        elsewhere, and this worker stops."""
        log.error("%s: the tensor-parallel group failed: %s", self.pack_id, first_line(err))
        why = f"the tensor-parallel group of {self.pack_id} failed ({type(err).__name__}: {first_line(err)})"
        for adapter_id, slot in list(self.slots.items()):
            with contextlib.suppress(Exception):  # the first error is the one to report
                self.reporter.trial_interrupted(slot)
            slot.ticket.fail(GroupFailed(f"{adapter_id}: {why}; it resumes from its last checkpoint"))
            del self.slots[adapter_id]
        for ticket in self.worker.pool.close():
            ticket.fail(GroupFailed(f"{ticket.request.adapter_id}: {why}"))
        raise GroupFailed(why) from err

    def _furthest_step(self) -> int:
        """Packed steps until the last current member finishes (the progress bar's total)."""
        remaining = [self.trainer.jobs[a].total_steps - self.trainer.steps_done[a] for a in self.trainer.jobs]
        return self.packed_steps + max(remaining, default=0)

    def _step(self) -> None:
        self.worker.release_removals(unless_recording=True)
        positions = stream_positions(self.trainer)
        try:
            if not self._compiled:
                self._compiled = True
                with phase("compile"):
                    self.trainer.compile_kernels()
            reports = self.train_step()
        except torch.OutOfMemoryError:
            if self.worker.channel is not None:  # the other ranks may be inside this step's collectives
                raise
            reports = None  # handled below: the error's traceback keeps the failed step's tensors alive
        if reports is None:
            self.undo_step(positions)
            self._split_after_oom()
            return
        self.packed_steps += 1
        for report in reports:
            slot = self.slots[report.adapter_id]
            if report.failed:  # already out of the trainer, before its update
                self._fail(slot, report.fail_reason)
            else:
                slot.curve.append((report.step, report.loss, report.lr))
        self._maybe_calibrate()
        self._report_progress()
        self._checkpoint(list(self.trainer.jobs))
        self._prune([a for a in self.trainer.jobs if not self.trainer.is_done(a)], reports)
        self._collect_done()

    def _collect_done(self) -> None:
        done = [a for a in self.trainer.jobs if self.trainer.is_done(a)]
        if done:
            for adapter_id in done:
                self.stop_training(adapter_id)
                self.reporter.trial_trained(self.slots[adapter_id])  # its curve goes out while it is scored
            self._evaluate_finished(done)

    def _report_progress(self) -> None:
        """Every ``LIVE_LOG_SECONDS``, the loss curves so far go to the reporter (MLflow is a live
        monitor, not only a record of finished trials)."""
        now = time.monotonic()
        if now - self._reported_at < LIVE_LOG_SECONDS:
            return
        self._reported_at = now
        with phase("mlflow"):
            for adapter_id in self.trainer.jobs:
                self.reporter.trial_progress(self.slots[adapter_id])

    # --- checkpoints, pruning, evaluation -------------------------------------------------------
    def _checkpoint(self, adapter_ids: list[str]) -> None:
        """A few times over each adapter's steps (``train.checkpoint_every``). A checkpoint is the
        adapter's fp32 weights and AdamW moments (12 bytes per LoRA parameter), copied to the
        host and written to disk, so the interval trades lost work against I/O; with the
        automatic interval the pacer also caps the device's share of time spent writing.

        A due save whose copy would not fit in the writer's queue (its host-memory bound) waits
        for a later step instead of stopping the loop until the writes ahead of it are on disk:
        the pack trains on meanwhile, and the save copies the adapter as it is then."""
        train = self.config.train
        for adapter_id in adapter_ids:
            step = self.trainer.steps_done[adapter_id]
            every = train.checkpoint_interval(self.trainer.jobs[adapter_id].total_steps)
            if not step % every and not self.trainer.is_done(adapter_id):
                self._saves_due[adapter_id] = None
        for adapter_id in list(self._saves_due):  # in the order they fell due
            if adapter_id not in self.trainer.jobs or self.trainer.is_done(adapter_id):
                del self._saves_due[adapter_id]  # left the pack, or finished: nothing to resume
                continue
            size = sum(p.numel() for p in self.worker.packed.parameters_of(adapter_id))
            if train.checkpoint_every is None and not self.worker.pacer.affordable(size):
                del self._saves_due[adapter_id]  # over the share: this one is skipped
                continue
            if not self.worker.writer.has_room(capture_bytes_bound(self.trainer, adapter_id)):
                return  # the writer frees room as it writes; the next step asks again
            del self._saves_due[adapter_id]
            slot = self.slots[adapter_id]
            started = time.monotonic()
            state = self.capture_state(adapter_id, slot.curve)
            self.worker.save_checkpoint(slot.request, state, {"run_id": slot.run_id, "adapter_id": adapter_id})
            self.worker.pacer.record(size, time.monotonic() - started)

    def _metric(self, task: str) -> str:
        return self.worker.resources.tasks[task].metric

    def _prune(self, training: list[str], reports: list[StepReport]) -> None:
        pruning = self.config.pruning
        if pruning.pruner == "none":
            return
        stepped = {r.adapter_id for r in reports if not r.failed}
        due = [
            a
            for a in training
            if a in stepped
            and self.trainer.steps_done[a] % pruning.interval == 0
            and self.slots[a].request.should_prune is not None
            and self.slots[a].ticket.withdrawn is None
        ]
        if not due:
            return
        for task in sorted({self.slots[a].request.task for a in due}):
            ids = [a for a in due if self.slots[a].request.task == task]
            metrics = self.score(task, ids, pruning.eval_limit)
            for adapter_id in ids:
                slot, step = self.slots[adapter_id], self.trainer.steps_done[adapter_id]
                value = metrics[adapter_id][self._metric(task)]
                slot.intermediate.append((step, value))
                if slot.request.should_prune(step, value):
                    self.stop_training(adapter_id)
                    self.reporter.trial_pruned(slot, self.pack_id, step, self._metric(task))
                    self._finish(slot, self._outcome(slot, value=slot.intermediate[-1][1], pruned_at=step))

    def _evaluate_finished(self, adapter_ids: list[str]) -> None:
        self.worker.progress.evaluating(self.pack_id)
        for task in sorted({self.slots[a].request.task for a in adapter_ids}):
            ids = [a for a in adapter_ids if self.slots[a].request.task == task]
            metrics = self.score(task, ids, self.config.evaluation.limit)
            for adapter_id in ids:
                slot = self.slots[adapter_id]
                write = self.export_adapter(adapter_id, self.worker.adapter_root / adapter_id)
                scores = metrics[adapter_id]
                outcome = self._outcome(slot, value=scores[self._metric(task)], metrics=scores)
                stats = dataclasses.replace(self.trainer.stats, step_seconds=[])  # the pack's figures until now
                held = 4 * self.worker.degree * sum(p.numel() for p in self.worker.packed.parameters_of(adapter_id))
                with phase("leave"):
                    self._leave(adapter_id)  # its slot trains the next trial while this one is recorded
                with phase("finishing"):  # waits only while the exports hold too many adapters' copies
                    self.worker.exporter.submit(
                        functools.partial(self._export_completed, slot, outcome, write, stats), nbytes=held
                    )

    def _export_completed(
        self, slot: _Slot, outcome: TrialOutcome, write: Callable[[], Path], stats: PackStats
    ) -> None:
        """On the export thread: the finished adapter's files; its run's last report and its trial's
        result are then queued for the finishing thread (:meth:`_report_completed`)."""
        if self._withdraw(slot.ticket):
            return
        with self._recording(slot, self.worker.adapter_root, "a finished adapter"), phase("export"):
            adapter_dir = write()
        self.worker.finisher.submit(functools.partial(self._report_completed, slot, outcome, adapter_dir, stats))

    def _report_completed(self, slot: _Slot, outcome: TrialOutcome, adapter_dir: Path, stats: PackStats) -> None:
        """On the finishing thread: the finished trial's run gets its last report, then the trial its result.
        A full tracking store resumes the trial as a full adapter disk does; the store may live anywhere."""
        if self._withdraw(slot.ticket):
            return
        with self._recording(slot, None, "the MLflow run of a finished trial"), phase("mlflow"):
            adapter_dir = self.reporter.trial_completed(slot, self.pack_id, outcome.metrics, adapter_dir, stats)
        self._settle(slot, dataclasses.replace(outcome, adapter_dir=adapter_dir))

    @contextlib.contextmanager
    def _recording(self, slot: _Slot, where: Path | None, what: str) -> Iterator[None]:
        """Around one stage of a finished trial's record. A failure settles the trial as the pack's
        own error would: its run ends FAILED, or KILLED to resume from its checkpoint when the disk
        (``where``; None: any) is full; the trial gets the error, which is raised for the training loop.
        After a record met a full disk (:attr:`DeviceWorker.full_disk`), the stages behind it do
        not write."""
        try:
            if self.worker.full_disk is not None:
                raise NoSpaceLeft(str(self.worker.full_disk))
            try:
                yield
            except Exception as err:
                full = as_no_space_left(err, where, what)
                if full is None:
                    raise
                raise full from err
        except BaseException as err:
            if isinstance(err, NoSpaceLeft) and self.worker.full_disk is None:
                self.worker.full_disk = err
            with contextlib.suppress(Exception):  # the first error is the one to report
                if isinstance(err, NoSpaceLeft):
                    self.reporter.trial_interrupted(slot)
                else:
                    self.reporter.trial_abandoned(slot.run_id)
            slot.ticket.fail(err)
            raise

    def _fail(self, slot: _Slot, reason: str) -> None:
        """A trial that left its pack non-finite (or out of memory alone): its run ends FAILED."""
        self.reporter.trial_failed(slot, self.pack_id, reason)
        self._finish(slot, self._outcome(slot, value=float("nan"), fail_reason=reason))

    def _outcome(self, slot: _Slot, **fields: Any) -> TrialOutcome:
        stats: PackStats = self.trainer.stats
        return TrialOutcome(
            request=slot.request,
            metrics=fields.pop("metrics", {}),
            losses=[loss for _, loss, _ in slot.curve],
            run_id=slot.run_id,  # a placeholder if created during an MLflow outage: see SweepTracker.resolve
            adapter_dir=fields.pop("adapter_dir", None),
            pack_id=self.pack_id,
            tokens_per_second=stats.tokens_per_second,
            resumed_from=slot.resumed_from,
            intermediate=list(slot.intermediate),
            **fields,
        )

    def _finish(self, slot: _Slot, outcome: TrialOutcome) -> None:
        with phase("leave"):
            self._leave(slot.request.adapter_id)
        self._settle(slot, outcome)

    def _settle(self, slot: _Slot, outcome: TrialOutcome) -> None:
        """A trial out of the pack: its checkpoint is to go (:meth:`DeviceWorker.remove_checkpoint`),
        its result is handed over."""
        with phase("checkpoint"):
            self.worker.remove_checkpoint(slot.request)
        with phase("optuna"):
            slot.ticket.finish(outcome)
        with phase("progress"):
            self.worker.progress.trial_finished(outcome)

    # --- out of memory --------------------------------------------------------------------------
    def _split_after_oom(self) -> None:
        """Keep the adapters that fit by the corrected estimate; park the rest in host memory."""
        worker = self.worker
        ids = list(self.trainer.jobs)
        configs = [self.slots[a].request.config for a in ids]
        predicted = worker.cost.peak_memory(configs, worker.degree)
        # the pack needed more than this process could hold: scale predictions up to at least that
        usable = usable_memory_bytes(worker.device, worker.gpu.memory_bytes)
        worker.memory_correction = max(worker.memory_correction, 1.05 * usable / predicted)
        gc.collect()  # the failed step's tensors that only reference cycles still hold: back before the split
        if worker.device.type == "cuda":
            torch.cuda.empty_cache()
        if len(ids) == 1:
            slot = self.slots[ids[0]]
            self.stop_training(ids[0])
            self._fail(slot, f"{ids[0]}: out of memory on {worker.name} even alone; lower its batch size or rank")
            return
        keep, limit = 1, worker.memory_limit
        while keep < len(ids) - 1 and worker.predicted_memory(configs[: keep + 1]) <= limit:
            keep += 1
        log.warning(
            "%s ran out of memory with %d adapters; %d train on, %d wait for room",
            self.pack_id,
            len(ids),
            keep,
            len(ids) - keep,
        )
        for adapter_id in reversed(ids[keep:]):  # parked in their original order
            self.worker.parked.appendleft(self._park(adapter_id))
        self._composition_changed()

    def _park(self, adapter_id: str) -> tuple[TrialTicket, AdapterState]:
        """Out of the pack, its state in host memory; it joins again from there (same MLflow run)."""
        slot = self.slots.pop(adapter_id)
        state = self.capture_state(adapter_id, slot.curve)
        self.drop_adapter(adapter_id)
        slot.ticket.request.run_id = slot.run_id
        return slot.ticket, state

    # --- rotation -------------------------------------------------------------------------------
    def _rotate(self) -> None:
        """Keep a full pack full to the sweep's end: longest remaining steps first.

        Once every trial left has been proposed (:attr:`~plora_hpo.trials.TrialPool.last_round`),
        trials that do not fit would wait for the pack to end and then train on their own, a small
        pack whose steps cost nearly what a full one's do. Instead a member far ahead (fewer steps
        left, by the lead :data:`ROTATE_MIN_LEAD` describes) is parked in host memory, as after an
        out-of-memory split, and the waiting trial furthest behind trains in its place (in the
        place of several such members if it is larger than any one of them); parked
        trials come back the same way, or once a member finishes. A trial trains exactly the steps
        it would have trained without rotation.
        """
        worker = self.worker
        pool = worker.pool
        # not with a pruner (a trial's intermediate scores live in its slot), nor for a tensor-parallel
        # group, nor while a device is idle (it takes the waiting trials itself)
        on = self.config.pack.rotate and self.config.pruning.pruner == "none" and worker.channel is None
        if not (on and pool.last_round) or pool.idle_workers:
            return
        for _ in range(len(worker.parked) + len(pool.waiting())):  # each swap moves one trial in
            waiting = [
                (worker.total_steps(t.request) - (state.steps_done if state is not None else 0), t, state)
                for t, state in worker.parked
            ]
            waiting += [(worker.total_steps(t.request), t, None) for t in pool.waiting()]
            if not waiting:
                return
            behind, ticket, state = max(waiting, key=lambda w: w[0])
            lead = max(ROTATE_MIN_LEAD, math.ceil(worker.total_steps(ticket.request) / ROTATION_TURNS))
            ahead = sorted(
                (self.trainer.jobs[a].total_steps - self.trainer.steps_done[a], a)
                for a in self.trainer.jobs
                if not self.trainer.is_done(a)
            )
            out = self._room_for(ticket, [a for left, a in ahead if behind - left >= lead])
            if out is None:
                return
            if state is None:
                try:
                    if not pool.take_ticket(ticket):  # another device took it
                        continue
                except PoolClosed:
                    raise _Shutdown from None
            else:
                worker.parked = deque(entry for entry in worker.parked if entry[0] is not ticket)
            for member in out:
                log.info("%s: %s waits in host memory while %s trains", self.pack_id, member, ticket.request.adapter_id)
                worker.parked.append(self._park(member))
            self._join(ticket, state)

    def _room_for(self, ticket: TrialTicket, eligible: list[str]) -> tuple[str, ...] | None:
        """The members the waiting trial trains instead of: the first of ``eligible`` (members far
        enough ahead, fewest steps left first) that it fits in place of; else, for a trial larger
        than any one of them, as many of them, in that order, as make room for it, so that a
        large trial does not wait for the small ones to end; None if even all of them do not."""
        single = next((a for a in eligible if self._fits_instead(ticket, (a,))), None)
        if single is not None:
            return (single,)
        for n in range(2, len(eligible) + 1):
            if self._fits_instead(ticket, tuple(eligible[:n])):
                return tuple(eligible[:n])
        return None

    def _fits_instead(self, ticket: TrialTicket, members: tuple[str, ...]) -> bool:
        """Whether the waiting trial fits in the pack in ``members``' place: the cost model predicts
        the pack with it within the device's limit, or within what the pack holds now. A pack that
        the model, refitted on its own peak, now puts above the limit is training all the same, so a
        swap that holds no more than it does fits. Asked once per composition (:meth:`_rotate`
        asks after every step)."""
        if self._unfit[0] != self._composition:
            self._unfit = (self._composition, set())
        unfit = self._unfit[1]
        if (ticket, members) not in unfit:
            worker = self.worker
            others = [s.request.config for a, s in self.slots.items() if a not in members]
            room = max(worker.memory_limit, worker.predicted_memory(self._configs()))
            if not worker.fits([*others, ticket.request.config], limit=room):
                unfit.add((ticket, members))
        return (ticket, members) not in unfit

    # --- cost model -----------------------------------------------------------------------------
    def _maybe_calibrate(self) -> None:
        """After ``CALIBRATION_STEPS`` warm steps of one composition, refit the cost model on them
        (admission then decides with it); the composition's end refits on all of its steps."""
        seconds = self.trainer.stats.step_seconds[self._stable_since :]
        if len(seconds) == CALIBRATION_STEPS + 1:
            with phase("calibrate"):
                self._calibrate(self._configs(), seconds[1:])

    def _calibrate(self, configs: list[AdapterConfig], seconds: list[float]) -> None:
        """Record the pack as it ran (the median of ``seconds``, its warm steps: a step slowed by a
        compile, the allocator growing or a finished neighbour's export does not stand for the
        pack; the peak memory since its composition began) and refit the cost model on it, for
        admission now and for later sweeps."""
        from plora_hpo.planner import CostModel, record_observation
        from plora_hpo.planner.model_names import shape_name_for_shape

        worker = self.worker
        shape_name = shape_name_for_shape(worker.base.shape)
        if shape_name is None:  # a model of unlisted shape: nothing to calibrate against
            return
        peak = torch.cuda.max_memory_allocated(worker.device) if worker.device.type == "cuda" else None
        workload = worker.cost.workload  # the engine settings the pack ran with
        calibration = record_observation(
            shape_name,
            worker.gpu,
            configs,
            workload.seq_len,
            workload.targets,
            step_seconds=statistics.median(seconds),
            peak_bytes=peak,
            steps_measured=len(seconds),
            degree=worker.degree,
            dtype_bytes=workload.dtype_bytes,
            checkpointing=workload.checkpointing,
            logits_chunk_tokens=workload.logits_chunk_tokens,
            micro_batch_tokens=workload.micro_batch_tokens,
        )
        if calibration is not None:
            worker.cost = CostModel(workload, worker.gpu, calibration)
