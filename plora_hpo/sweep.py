"""Run trials as packs on the machine's devices: engine → evaluator → tracker.

:class:`PackedSweep` loads each task's data once and the base model once per device, then
serves trial requests from any thread: :meth:`PackedSweep.submit` queues one, and the device
workers (:mod:`plora_hpo.worker`) train queued trials together, score every adapter in
batched evaluations, export each in PEFT format and record one MLflow child run per trial.
The study layer (:mod:`plora_hpo.study`) decides what to run.
"""

from __future__ import annotations

import itertools
import math
import queue
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from plora_hpo.adapter import AdapterConfig
from plora_hpo.checkpoints import CheckpointStore
from plora_hpo.config import SweepConfig
from plora_hpo.engine import OptimizerSettings, PackStats
from plora_hpo.engine.export import export_peft_adapter
from plora_hpo.errors import ConfigError
from plora_hpo.tracking import SweepTracker
from plora_hpo.trials import PackProgress, TrialInterrupted, TrialOutcome, TrialRequest, TrialTicket

if TYPE_CHECKING:
    from plora_hpo.worker import DeviceWorker, _Slot


@dataclass
class _TaskData:
    examples: list[Any]
    metric: str


def resolve_devices(spec: str | None) -> list[torch.device]:
    """``None``/``"cuda"``: every visible GPU (else the CPU); ``"cuda:1"``; ``"cuda:0,cuda:1"``;
    ``"cpu"``. Repeating a device (``"cpu,cpu"``) runs that many workers on it."""
    if spec is None or spec == "cuda":
        if torch.cuda.is_available():
            return [torch.device("cuda", i) for i in range(torch.cuda.device_count())]
        if spec == "cuda":
            raise ConfigError("--device cuda: no CUDA device is visible; use --device cpu")
        return [torch.device("cpu")]
    devices = []
    for part in spec.split(","):
        try:
            device = torch.device(part.strip())
        except RuntimeError:
            raise ConfigError(f"--device {spec}: {part!r} is not a device; use cpu, cuda or cuda:N") from None
        if device.type == "cuda" and (
            not torch.cuda.is_available() or (device.index or 0) >= torch.cuda.device_count()
        ):
            raise ConfigError(f"--device {spec}: {part} is not visible; use --device cpu or an existing cuda:N")
        if device.type not in ("cpu", "cuda"):
            raise ConfigError(f"--device {spec}: {device.type} is not supported; use cpu or cuda")
        devices.append(device)
    return devices


class PackedSweep:
    """Task data, tracker, checkpoints and one worker per device, shared by every trial."""

    def __init__(
        self,
        config: SweepConfig,
        *,
        tracker: SweepTracker,
        run_dir: Path,
        data_dir: str | None = None,
        device: str | None = None,
        progress: PackProgress | None = None,
    ) -> None:
        from plora_hpo.worker import DeviceWorker

        self.config = config
        self.tracker = tracker
        self.run_dir = run_dir
        self.data_dir = data_dir
        self.progress = progress or PackProgress()
        self.devices = resolve_devices(device)
        self.base = self._load_base(self.devices[0])
        self._first_eval_tasks: dict[str, Any] = {}
        self.tasks = {task: self._load_task(task) for task in config.tasks}
        self.inbox: queue.Queue[TrialTicket | None] = queue.Queue()
        self._pack_ids = itertools.count()
        self._started = False
        self._lock = threading.Lock()
        self._models = {0: self.base}
        names = [f"{d}" if self.devices.count(d) == 1 else f"{d}#{i}" for i, d in enumerate(self.devices)]
        self.workers: list[DeviceWorker] = [
            DeviceWorker(self, d, name, replica=i) for i, (d, name) in enumerate(zip(self.devices, names))
        ]
        del self._models, self._first_eval_tasks  # each worker holds its own replica and tasks now

    # --- loading ------------------------------------------------------------------------------
    def _load_base(self, device: torch.device) -> Any:
        from plora_hpo.models import load_base_model

        cfg = self.config
        dtype = None if cfg.dtype == "auto" else getattr(torch, cfg.dtype)
        base = load_base_model(cfg.model, dtype=dtype, device=device, seed=cfg.seed)
        if base.tokenizer is None:
            raise ConfigError(
                f"model {cfg.model!r} has no tokenizer (random-init shapes are for benchmarks); "
                "use 'smollm2-135m', a hub id or a local model directory"
            )
        return base

    def base_on(self, device: torch.device, replica: int) -> Any:
        """The base model for worker ``replica`` (the first one is already loaded)."""
        return self._models.pop(replica, None) or self._load_base(device)

    def _load_task(self, name: str) -> _TaskData:
        from plora_hpo.tasks import get_task, load_train_examples

        cfg = self.config
        examples = load_train_examples(
            name,
            self.base.tokenizer,
            seq_len=cfg.seq_len,
            data_dir=self.data_dir,
            max_examples=cfg.budget.max_train_examples,
            seed=cfg.seed,
        )
        largest_batch = max(cfg.space.batch_size.choices or [cfg.space.batch_size.high])
        if largest_batch > len(examples):
            raise ConfigError(
                f"space.batch_size: {int(largest_batch)} is larger than the {len(examples)} training "
                f"examples of task {name!r}; lower the batch size or raise budget.max_train_examples"
            )
        # built now so missing eval data fails with one clear line; the first worker uses these
        self._first_eval_tasks.update(self.build_eval_tasks([name]))
        return _TaskData(examples=examples, metric=get_task(name).primary_metric)

    def eval_tasks_for(self, replica: int) -> dict[str, Any]:
        """Worker ``replica``'s lm-eval tasks: the ones built while loading for the first worker."""
        return self._first_eval_tasks if replica == 0 else self.build_eval_tasks()

    def build_eval_tasks(self, tasks: Sequence[str] | None = None) -> dict[str, Any]:
        """Fresh lm-eval task objects (they keep per-run state, so each worker gets its own)."""
        from plora_hpo.tasks import build_eval_tasks

        return {
            task: build_eval_tasks(task, data_dir=self.data_dir, num_fewshot=self.config.evaluation.num_fewshot)
            for task in (tasks or self.config.tasks)
        }

    # --- what workers share -------------------------------------------------------------------
    def total_steps(self, task: str, config: AdapterConfig) -> int:
        budget = self.config.budget
        if budget.steps is not None:
            return budget.steps
        return max(1, math.ceil(budget.epochs * len(self.tasks[task].examples) / config.batch_size))

    def optimizer_settings(self) -> OptimizerSettings:
        t = self.config.train
        return OptimizerSettings(
            lr_schedule=t.lr_schedule,
            warmup_ratio=t.warmup_ratio,
            weight_decay=t.weight_decay,
            max_grad_norm=t.max_grad_norm,
        )

    def checkpoints(self, task: str) -> CheckpointStore:
        return CheckpointStore(checkpoint_dir(self.run_dir, self.config, task))

    def next_pack_id(self, worker_name: str) -> str:
        n = next(self._pack_ids)
        return f"pack-{n}" if len(self.workers) == 1 else f"pack-{n}@{worker_name}"

    def device_spec(self, device: torch.device) -> Any:
        """The device as the planner's cost model sees it (the CPU host counts as one "GPU")."""
        from plora_hpo.planner import GpuSpec

        if device.type == "cuda":
            props = torch.cuda.get_device_properties(device)
            return GpuSpec(props.name, props.total_memory / 2**30)
        return GpuSpec.host()

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
        """Queue a trial; a worker trains it in its next pack with room. Thread-safe."""
        with self._lock:
            if not self._started:
                for worker in self.workers:
                    worker.start()
                self._started = True
        ticket = TrialTicket(request)
        self.inbox.put(ticket)
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

    def __enter__(self) -> PackedSweep:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Stop the workers (a pack still training checkpoints its adapters first; idempotent)."""
        if self._started:
            self.inbox.put(None)
            for worker in self.workers:
                worker.join()
            self._started = False
        while not self.inbox.empty():  # the shutdown marker, and trials no worker took any more
            ticket = self.inbox.get_nowait()
            if ticket is not None:
                ticket.fail(TrialInterrupted(f"{ticket.request.adapter_id}: the sweep stopped before it started"))

    # --- per-trial bookkeeping (called from worker threads) ----------------------------------
    def open_trial_run(self, request: TrialRequest, run_id: str | None, pack_id: str) -> str:
        """The trial's MLflow run: its crashed predecessor's, reopened, or a new one."""
        tags = {"plora.pack_id": pack_id, "plora.trial_number": str(request.number), "plora.task": request.task}
        if run_id is not None and self.tracker.resume_trial(run_id, tags):
            return run_id
        return self.tracker.start_trial(request.adapter_id, self.trial_params(request), tags)

    def score(self, worker: DeviceWorker, task: str, adapter_ids: list[str], *, limit: int) -> dict[str, float]:
        """Intermediate scores (the task's primary metric on the first ``limit`` eval documents)."""
        metrics = self._evaluate(worker, task, adapter_ids, limit)
        return {a: metrics[a][self.tasks[task].metric] for a in adapter_ids}

    def evaluate(self, worker: DeviceWorker, task: str, adapter_ids: list[str]) -> dict[str, dict[str, float]]:
        return self._evaluate(worker, task, adapter_ids, self.config.evaluation.limit)

    def _evaluate(
        self, worker: DeviceWorker, task: str, adapter_ids: list[str], limit: int | None
    ) -> dict[str, dict[str, float]]:
        from plora_hpo.evaluation import evaluate_adapters

        ev = self.config.evaluation
        return evaluate_adapters(
            worker.packed,
            worker.base.tokenizer,
            adapter_ids,
            worker.eval_tasks[task],
            limit=limit,
            batch_size=ev.batch_size,
            max_new_tokens=ev.max_new_tokens,
            bootstrap_iters=ev.bootstrap_iters,
        )

    def calibrate(
        self, worker: DeviceWorker, configs: list[AdapterConfig], step_seconds: float, peak_bytes: int | None
    ) -> None:
        """Feed a pack's measured step time (and GPU peak memory) back into the planner's cost model,
        which the worker then admits trials with (and later sweeps start from)."""
        from plora_hpo.planner import CostModel, record_observation
        from plora_hpo.planner.model_names import shape_name_of

        shape_name = shape_name_of(worker.base.shape)
        if shape_name is None:  # a model of unlisted shape: nothing to calibrate against
            return
        workload = worker.cost.workload  # the engine settings the pack ran with
        calibration = record_observation(
            shape_name,
            worker.gpu,
            configs,
            workload.seq_len,
            workload.targets,
            step_seconds=step_seconds,
            peak_bytes=peak_bytes,
            dtype_bytes=workload.dtype_bytes,
            checkpointing=workload.checkpointing,
            logits_chunk_tokens=workload.logits_chunk_tokens,
            micro_batch_tokens=workload.micro_batch_tokens,
        )
        if calibration is not None:
            worker.cost = CostModel(workload, worker.gpu, calibration)

    def completed_outcome(
        self, worker: DeviceWorker, slot: _Slot, pack_id: str, metrics: dict[str, float], stats: PackStats
    ) -> TrialOutcome:
        """Export the adapter, log its curve, metrics and artifact, and close its run."""
        request = slot.request
        adapter_dir = export_peft_adapter(
            worker.packed, request.adapter_id, self.run_dir / "adapters" / request.adapter_id, self.base.name
        )
        rows = _curve_rows(slot.curve) + _intermediate_rows(slot.intermediate, self.tasks[request.task].metric)
        rows += [(_metric_key(k), v, 0) for k, v in metrics.items()]
        rows.append(("pack_tokens_per_second", stats.tokens_per_second, 0))
        rows.append(("pack_peak_memory_gib", stats.peak_memory_bytes / 2**30, 0))
        self.tracker.log_metrics(slot.run_id, rows)
        self.tracker.set_tags(slot.run_id, self._end_tags(slot, "COMPLETE"))
        self.tracker.log_adapter(slot.run_id, adapter_dir)
        self.tracker.end_trial(slot.run_id)
        return self._outcome(
            slot,
            pack_id,
            stats,
            value=metrics[self.tasks[request.task].metric],
            metrics=metrics,
            adapter_dir=adapter_dir,
        )

    def pruned_outcome(self, slot: _Slot, pack_id: str, step: int, stats: PackStats) -> TrialOutcome:
        """A trial its pruner stopped at ``step``: curve and intermediate scores logged, run KILLED."""
        self.tracker.log_metrics(
            slot.run_id,
            _curve_rows(slot.curve) + _intermediate_rows(slot.intermediate, self.tasks[slot.request.task].metric),
        )
        self.tracker.set_tags(slot.run_id, {**self._end_tags(slot, "PRUNED"), "plora.pruned_at_step": str(step)})
        self.tracker.end_trial(slot.run_id, "KILLED")
        return self._outcome(slot, pack_id, stats, value=slot.intermediate[-1][1], pruned_at=step)

    def failed_outcome(self, slot: _Slot, pack_id: str, reason: str, stats: PackStats) -> TrialOutcome:
        """A trial that left its pack non-finite (or out of memory alone): curve and reason, run FAILED."""
        self.tracker.log_metrics(slot.run_id, _curve_rows(slot.curve))
        self.tracker.set_tags(slot.run_id, {**self._end_tags(slot, "FAIL"), "plora.fail_reason": reason})
        self.tracker.end_trial(slot.run_id, "FAILED")
        return self._outcome(slot, pack_id, stats, value=math.nan, fail_reason=reason)

    def abandon(self, run_id: str) -> None:
        """A trial that met an unexpected error: its run ends FAILED (its trial gets the error)."""
        self.tracker.end_trial(run_id, "FAILED")

    @staticmethod
    def _end_tags(slot: _Slot, state: str) -> dict[str, str]:
        return {"plora.state": state, "plora.resumed_from_step": str(slot.resumed_from)}

    @staticmethod
    def _outcome(slot: _Slot, pack_id: str, stats: PackStats, **fields: Any) -> TrialOutcome:
        return TrialOutcome(
            request=slot.request,
            metrics=fields.pop("metrics", {}),
            losses=[loss for _, loss, _ in slot.curve],
            run_id=slot.run_id,  # a placeholder if created during an MLflow outage: see SweepTracker.resolve
            adapter_dir=fields.pop("adapter_dir", None),
            pack_id=pack_id,
            tokens_per_second=stats.tokens_per_second,
            resumed_from=slot.resumed_from,
            intermediate=list(slot.intermediate),
            **fields,
        )


def checkpoint_dir(run_dir: Path, config: SweepConfig, task: str) -> Path:
    return run_dir / "checkpoints" / f"{config.name}-{task}"


def _curve_rows(steps: list[tuple[int, float, float]]) -> list[tuple[str, float, int]]:
    """MLflow rows of one adapter's per-step (step, loss, lr) records."""
    return [("train_loss", loss, step) for step, loss, _ in steps] + [
        ("learning_rate", lr, step) for step, _, lr in steps
    ]


def _intermediate_rows(scores: list[tuple[int, float]], metric: str) -> list[tuple[str, float, int]]:
    return [(f"intermediate_{_metric_key(metric)}", value, step) for step, value in scores]


def _metric_key(lm_eval_key: str) -> str:
    """MLflow names cannot hold commas: ``exact_match,flexible-extract`` → ``exact_match/flexible-extract``."""
    name, _, filt = lm_eval_key.partition(",")
    return name if filt in ("", "none") else f"{name}/{filt}"
