"""One device's training loop: packs that trials join when there is room and leave when done.

A :class:`DeviceWorker` owns a replica of the frozen base model on its device and serves the
sweep's queue of trial requests. A pack starts with the trials that arrive within
``pack.gather_seconds``; after that, every step boundary admits waiting trials while the pack
has room (``pack.size`` and the cost model's memory estimate), so the slot of a finished,
pruned or failed adapter trains the next proposed trial without restarting the pack.

Per step the worker also: checkpoints adapters every ``train.checkpoint_every`` of their steps;
scores adapters on a slice of the eval set every ``pruning.interval`` steps and asks their
trial whether to stop; evaluates, exports and logs adapters that finished. A step that runs out
of device memory is undone and the pack split: the adapters that still fit (by the corrected
memory estimate) train on, the others wait in host memory and rejoin when room frees up.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from plora_hpo.engine import AdapterJob, PackedLoraModel, PackedTrainer, StepReport
from plora_hpo.engine.resume import AdapterState, abort_step, capture, restore, stream_positions
from plora_hpo.errors import CheckpointError
from plora_hpo.trials import TrialInterrupted

if TYPE_CHECKING:
    from plora_hpo.sweep import PackedSweep
    from plora_hpo.trials import TrialOutcome, TrialRequest, TrialTicket

log = logging.getLogger(__name__)
LOAD_FACTOR = 0.9  # the planner's default C: packs use at most 90% of device memory
CALIBRATION_STEPS = 8  # warm steps of one pack composition that become a cost-model observation


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
    """Trains the sweep's trials on one device, one continuously refilled pack at a time."""

    def __init__(self, sweep: PackedSweep, device: torch.device, name: str, *, replica: int) -> None:
        from plora_hpo.planner import CostModel, Workload, load_calibration
        from plora_hpo.planner.model_names import shape_name_of

        self.sweep = sweep
        self.device = device
        self.name = name
        self.base = sweep.base_on(device, replica)
        self.packed = PackedLoraModel(self.base.model, sweep.config.target_modules)
        self.eval_tasks = sweep.eval_tasks_for(replica)  # lm-eval tasks hold per-run state: one set each
        self.gpu = sweep.device_spec(device)
        shape_name = shape_name_of(self.base.shape)
        self.cost = CostModel(
            Workload(
                self.base.shape,
                sweep.config.seq_len,
                tuple(sweep.config.target_modules),
                self.dtype_bytes(),
                checkpointing=sweep.config.pack.activation_checkpointing,
                micro_batch_tokens=sweep.config.pack.micro_batch_tokens,
            ),
            self.gpu,
            load_calibration(shape_name, self.gpu.name) if shape_name else None,
        )
        self.memory_correction = 1.0  # raised after an out-of-memory step: measured need ÷ prediction
        self.parked: deque[tuple[TrialTicket, AdapterState | None]] = deque()  # waiting to (re)join
        self._thread = threading.Thread(target=self._serve, name=f"plora-{name}", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def join(self, timeout: float | None = None) -> None:
        self._thread.join(timeout)

    def dtype_bytes(self) -> int:
        return next(self.base.model.parameters()).element_size()

    # --- admission --------------------------------------------------------------------------
    @property
    def memory_limit(self) -> float:
        return LOAD_FACTOR * self.gpu.memory_bytes

    def predicted_memory(self, configs: list[Any]) -> float:
        return self.memory_correction * self.cost.peak_memory(configs)

    def fits(self, configs: list[Any]) -> bool:
        return len(configs) <= self.sweep.config.pack.size and self.predicted_memory(configs) <= self.memory_limit

    def _next_ticket(self, timeout: float | None) -> TrialTicket | None:
        """The next trial from the sweep's queue; None: nothing came within ``timeout``."""
        try:
            ticket = self.sweep.inbox.get(timeout=timeout) if timeout != 0 else self.sweep.inbox.get_nowait()
        except queue.Empty:
            return None
        if ticket is None:  # shutdown: pass it on to the other workers
            self.sweep.inbox.put(None)
            raise _Shutdown
        return ticket

    def _serve(self) -> None:
        if self.device.type == "cuda":  # Triton launches on the thread's current device
            torch.cuda.set_device(self.device)
        while True:
            try:
                first = self._next_ticket(timeout=None)
            except _Shutdown:
                return
            assert first is not None
            self.parked.append((first, None))
            while self.parked:
                try:
                    _Pack(self).run()
                except _Shutdown:
                    self._interrupt_parked()
                    return
                except BaseException as err:  # a pack that could not start: its waiting trials get the error
                    log.exception("%s: a pack failed to start", self.name)
                    while self.parked:
                        self.parked.popleft()[0].fail(err)

    def _interrupt_parked(self) -> None:
        """The sweep is closing: trials waiting for room keep their state for a rerun."""
        while self.parked:
            ticket, state = self.parked.popleft()
            request = ticket.request
            if state is not None:
                self.sweep.checkpoints(request.task).save(
                    request.lineage, state, {"run_id": request.run_id or "", "adapter_id": request.adapter_id}
                )
            ticket.fail(TrialInterrupted(f"{request.adapter_id}: the sweep stopped; a rerun resumes it"))


class _Shutdown(Exception):
    """The sweep is closing: the worker stops at its next look at the queue."""


class _Pack:
    """One pack's life on a worker: from its first admitted trial until it has none left."""

    def __init__(self, worker: DeviceWorker) -> None:
        self.worker = worker
        self.sweep = worker.sweep
        self.config = worker.sweep.config
        self.pack_id = worker.sweep.next_pack_id(worker.name)
        self.trainer = PackedTrainer(
            worker.packed,
            settings=self.sweep.optimizer_settings(),
            pad_id=worker.base.tokenizer.pad_token_id,
            device=worker.device,
            micro_batch_tokens=self.config.pack.micro_batch_tokens,
            activation_checkpointing=self.config.pack.activation_checkpointing,
        )
        self.slots: dict[str, _Slot] = {}
        self.packed_steps = 0
        self._stable_since = 0  # index into stats.step_seconds where the composition last changed

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
        """Parked trials first; then queued ones while the pack has room (waiting up to
        ``gather_seconds`` for more when the pack is just starting)."""
        self._admit_parked()
        if self.worker.parked:  # the ones that were here first do not fit yet: queue stays
            return
        deadline = time.monotonic() + gather_seconds
        while len(self.slots) < self.config.pack.size:
            ticket = self.worker._next_ticket(timeout=max(0.0, deadline - time.monotonic()))
            if ticket is None:
                return
            if self.slots and not self.worker.fits(self._configs(ticket.request.config)):
                self.worker.parked.append((ticket, None))
                return
            self._join(ticket, None)

    def _join(self, ticket: TrialTicket, state: AdapterState | None) -> None:
        request = ticket.request
        run_id = None
        try:
            store = self.sweep.checkpoints(request.task)
            saved_run_id, from_disk = None, state is None
            if state is None:
                found = store.load(request.lineage)
                if found is not None:
                    state, extra = found
                    saved_run_id = extra.get("run_id")
            run_id = self.sweep.open_trial_run(request, saved_run_id or request.run_id, self.pack_id)
            job = AdapterJob(
                request.adapter_id,
                request.config,
                self.sweep.tasks[request.task].examples,
                self.sweep.total_steps(request.task, request.config),
            )
            if state is None:
                self.trainer.add_job(job)
            else:
                try:
                    restore(self.trainer, job, state)
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
                self.sweep.abandon(run_id)
            if request.adapter_id in self.trainer.jobs:
                self.trainer.remove_job(request.adapter_id)
            if request.adapter_id in self.worker.packed.configs:
                self.worker.packed.remove_adapter(request.adapter_id)
            return
        slot = _Slot(ticket, run_id)
        if state is not None:
            slot.curve, slot.resumed_from = list(state.curve), state.steps_done
            log.info("%s resumes at step %d", request.adapter_id, state.steps_done)
        self.slots[request.adapter_id] = slot
        if request.on_started is not None:
            request.on_started(run_id)
        self._composition_changed()

    def _leave(self, adapter_id: str) -> None:
        """Out of the pack and out of the model (its outcome is already recorded)."""
        if adapter_id in self.trainer.jobs:
            self.trainer.remove_job(adapter_id)
        if adapter_id in self.worker.packed.configs:
            self.worker.packed.remove_adapter(adapter_id)
        del self.slots[adapter_id]
        self._composition_changed()

    def _composition_changed(self) -> None:
        self._stable_since = len(self.trainer.stats.step_seconds)
        if self.worker.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.worker.device)

    # --- the loop ---------------------------------------------------------------------------
    def run(self) -> None:
        progress = self.sweep.progress
        try:
            self.admit(gather_seconds=self.config.pack.gather_seconds)
            progress.pack_started(self.pack_id, len(self.slots), self._furthest_step())
            while self.slots:
                self._collect_done()  # trials resumed at their last step need no more training
                if self.trainer.jobs:
                    self._step()
                self.admit()
                progress.pack_update(self.pack_id, self.packed_steps, self._furthest_step(), len(self.slots))
        except _Shutdown:  # the sweep is closing mid-pack (interrupted): keep what trained so far
            for adapter_id, slot in list(self.slots.items()):
                if adapter_id in self.trainer.jobs:
                    self.sweep.checkpoints(slot.request.task).save(
                        slot.request.lineage,
                        capture(self.trainer, adapter_id, slot.curve),
                        {"run_id": slot.run_id, "adapter_id": adapter_id},
                    )
                slot.ticket.fail(TrialInterrupted(f"{adapter_id}: the sweep stopped; a rerun resumes it"))
                self._leave(adapter_id)
            raise
        except BaseException as err:  # delivered to every trial of the pack; the worker serves on
            for adapter_id, slot in list(self.slots.items()):
                slot.ticket.fail(err)
                try:
                    self.sweep.abandon(slot.run_id)
                    self._leave(adapter_id)
                except Exception:  # the first error is the one to report
                    log.exception("%s: cleaning up %s after an error failed too", self.pack_id, adapter_id)
            if not isinstance(err, Exception):
                raise
        finally:
            progress.pack_finished(self.pack_id)

    def _furthest_step(self) -> int:
        """Packed steps until the last current member finishes (the progress bar's total)."""
        remaining = [self.trainer.jobs[a].total_steps - self.trainer.steps_done[a] for a in self.trainer.jobs]
        return self.packed_steps + max(remaining, default=0)

    def _step(self) -> None:
        positions = stream_positions(self.trainer)
        try:
            reports = self.trainer.step()
        except torch.OutOfMemoryError:
            abort_step(self.trainer, positions)
            self._split_after_oom()
            return
        self.packed_steps += 1
        for report in reports:
            slot = self.slots[report.adapter_id]
            if report.failed:  # already out of the trainer, before its update
                self._finish(
                    slot, self.sweep.failed_outcome(slot, self.pack_id, report.fail_reason, self.trainer.stats)
                )
            else:
                slot.curve.append((report.step, report.loss, report.lr))
        self._maybe_calibrate()
        self._checkpoint(list(self.trainer.jobs))
        self._prune([a for a in self.trainer.jobs if not self.trainer.is_done(a)], reports)
        self._collect_done()

    def _collect_done(self) -> None:
        done = [a for a in self.trainer.jobs if self.trainer.is_done(a)]
        if done:
            for adapter_id in done:
                self.trainer.remove_job(adapter_id)
            self._evaluate_finished(done)

    # --- checkpoints, pruning, evaluation -------------------------------------------------------
    def _checkpoint(self, adapter_ids: list[str]) -> None:
        """Every ``checkpoint_every`` steps of an adapter still training. A checkpoint is the
        adapter's fp32 weights and AdamW moments (12 bytes per LoRA parameter), copied to the
        host and written to disk, so the interval trades lost work against I/O."""
        every = self.config.train.checkpoint_every
        for adapter_id in adapter_ids:
            step = self.trainer.steps_done[adapter_id]
            if step % every == 0 and not self.trainer.is_done(adapter_id):
                slot = self.slots[adapter_id]
                state = capture(self.trainer, adapter_id, slot.curve)
                self.sweep.checkpoints(slot.request.task).save(
                    slot.request.lineage, state, {"run_id": slot.run_id, "adapter_id": adapter_id}
                )

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
        ]
        if not due:
            return
        for task in sorted({self.slots[a].request.task for a in due}):
            ids = [a for a in due if self.slots[a].request.task == task]
            scores = self.sweep.score(self.worker, task, ids, limit=pruning.eval_limit)
            for adapter_id in ids:
                slot, step = self.slots[adapter_id], self.trainer.steps_done[adapter_id]
                value = scores[adapter_id]
                slot.intermediate.append((step, value))
                if slot.request.should_prune(step, value):
                    self.trainer.remove_job(adapter_id)
                    self._finish(slot, self.sweep.pruned_outcome(slot, self.pack_id, step, self.trainer.stats))

    def _evaluate_finished(self, adapter_ids: list[str]) -> None:
        self.sweep.progress.evaluating(self.pack_id)
        for task in sorted({self.slots[a].request.task for a in adapter_ids}):
            ids = [a for a in adapter_ids if self.slots[a].request.task == task]
            metrics = self.sweep.evaluate(self.worker, task, ids)
            for adapter_id in ids:
                slot = self.slots[adapter_id]
                outcome = self.sweep.completed_outcome(
                    self.worker, slot, self.pack_id, metrics[adapter_id], self.trainer.stats
                )
                self._finish(slot, outcome)

    def _finish(self, slot: _Slot, outcome: TrialOutcome) -> None:
        self.sweep.checkpoints(slot.request.task).delete(slot.request.lineage)
        self._leave(slot.request.adapter_id)
        slot.ticket.finish(outcome)
        self.sweep.progress.trial_finished(outcome)

    # --- out of memory --------------------------------------------------------------------------
    def _split_after_oom(self) -> None:
        """Keep the adapters that fit by the corrected estimate; park the rest in host memory."""
        worker = self.worker
        ids = list(self.trainer.jobs)
        configs = [self.slots[a].request.config for a in ids]
        predicted = worker.cost.peak_memory(configs)
        # the pack needed more than the device has: scale predictions up to at least that
        worker.memory_correction = max(worker.memory_correction, 1.05 * worker.gpu.memory_bytes / predicted)
        if worker.device.type == "cuda":
            torch.cuda.empty_cache()
        if len(ids) == 1:
            slot = self.slots[ids[0]]
            self.trainer.remove_job(ids[0])
            reason = f"{ids[0]}: out of memory on {worker.name} even alone; lower its batch size or rank"
            self._finish(slot, self.sweep.failed_outcome(slot, self.pack_id, reason, self.trainer.stats))
            return
        keep = 1
        while keep < len(ids) - 1 and worker.predicted_memory(configs[: keep + 1]) <= worker.memory_limit:
            keep += 1
        log.warning(
            "%s ran out of memory with %d adapters; %d train on, %d wait for room",
            self.pack_id,
            len(ids),
            keep,
            len(ids) - keep,
        )
        for adapter_id in reversed(ids[keep:]):  # parked in their original order
            slot = self.slots[adapter_id]
            state = capture(self.trainer, adapter_id, slot.curve)
            self.trainer.remove_job(adapter_id)
            self.worker.packed.remove_adapter(adapter_id)
            del self.slots[adapter_id]
            slot.ticket.request.run_id = slot.run_id
            self.worker.parked.appendleft((slot.ticket, state))
        self._composition_changed()

    # --- cost model -----------------------------------------------------------------------------
    def _maybe_calibrate(self) -> None:
        """After ``CALIBRATION_STEPS`` warm steps of one composition, feed them to the cost model."""
        seconds = self.trainer.stats.step_seconds[self._stable_since :]
        if len(seconds) != CALIBRATION_STEPS + 1:
            return
        peak = torch.cuda.max_memory_allocated(self.worker.device) if self.worker.device.type == "cuda" else None
        self.sweep.calibrate(
            self.worker, [s.request.config for s in self.slots.values()], sum(seconds[1:]) / CALIBRATION_STEPS, peak
        )
