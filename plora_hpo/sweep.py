"""Run packs of trials: engine → evaluator → tracker. The study layer decides what to run.

:class:`PackedSweep` loads the base model and each task's data once, then trains any list of
trials as one pack, scores every adapter in one batched evaluation, exports each adapter in
PEFT format, and records one MLflow child run per trial.
"""

from __future__ import annotations

import itertools
import math
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from plora_hpo.adapter import AdapterConfig
from plora_hpo.config import SweepConfig
from plora_hpo.engine import AdapterJob, OptimizerSettings, PackedLoraModel, PackedTrainer, StepReport
from plora_hpo.engine.export import export_peft_adapter
from plora_hpo.errors import ConfigError
from plora_hpo.tracking import SweepTracker

ReportCallback = Callable[[StepReport], None]
_LOAD_FACTOR = 0.9  # the planner's default C: plan packs to use at most 90% of device memory


class PackProgress:
    """Hooks a front end (the CLI's progress bars) gets called with; the default does nothing."""

    def pack_started(self, pack_id: str, n_adapters: int, steps: int) -> None: ...

    def step_done(self) -> None: ...

    def evaluating(self, pack_id: str) -> None: ...

    def pack_finished(self, pack_id: str, outcomes: list[TrialOutcome]) -> None: ...


@dataclass
class TrialRequest:
    """One Optuna trial to train: its number, its config, and who wants its step losses."""

    task: str
    number: int
    config: AdapterConfig
    on_report: ReportCallback | None = None

    @property
    def adapter_id(self) -> str:
        return f"{self.task}-t{self.number}"


@dataclass
class TrialOutcome:
    """One trial's result. A failed trial (``fail_reason`` set) has value NaN, no metrics and no
    adapter: it left its pack at a non-finite step and was neither evaluated nor exported."""

    request: TrialRequest
    value: float
    metrics: dict[str, float]
    losses: list[float]
    run_id: str
    adapter_dir: Path | None
    pack_id: str
    tokens_per_second: float
    fail_reason: str | None = None

    @property
    def failed(self) -> bool:
        return self.fail_reason is not None


@dataclass
class _TaskData:
    examples: list[Any]
    eval_tasks: dict[str, Any]
    metric: str
    spec: Any = field(repr=False, default=None)


class PackedSweep:
    """The loaded base model, task data and tracker that every pack of a sweep shares."""

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
        from plora_hpo.models import load_base_model

        self.config = config
        self.tracker = tracker
        self.run_dir = run_dir
        self.data_dir = data_dir
        self.progress = progress or PackProgress()
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        dtype = None if config.dtype == "auto" else getattr(torch, config.dtype)
        self.base = load_base_model(config.model, dtype=dtype, device=self.device, seed=config.seed)
        if self.base.tokenizer is None:
            raise ConfigError(
                f"model {config.model!r} has no tokenizer (random-init shapes are for benchmarks); "
                "use 'smollm2-135m', a hub id or a local model directory"
            )
        self.packed = PackedLoraModel(self.base.model, config.target_modules)
        self.tasks = {task: self._load_task(task) for task in config.tasks}
        self._pack_ids = itertools.count()
        self._lock = threading.Lock()  # one pack at a time on one device

    def _load_task(self, name: str) -> _TaskData:
        from plora_hpo.tasks import build_eval_tasks, get_task, load_train_examples

        cfg = self.config
        spec = get_task(name)
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
        eval_tasks = build_eval_tasks(name, data_dir=self.data_dir, num_fewshot=cfg.evaluation.num_fewshot)
        return _TaskData(examples=examples, eval_tasks=eval_tasks, metric=spec.primary_metric, spec=spec)

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

    # --- planning -------------------------------------------------------------------------
    def device_spec(self) -> Any:
        """The device as the planner's cost model sees it (the CPU host counts as one "GPU")."""
        from plora_hpo.planner import GpuSpec

        if self.device.type == "cuda":
            props = torch.cuda.get_device_properties(self.device)
            return GpuSpec(props.name, props.total_memory / 2**30)
        return GpuSpec.host()

    def _dtype_bytes(self) -> int:
        return next(self.base.model.parameters()).element_size()

    def split_into_packs(self, requests: Sequence[TrialRequest]) -> list[list[TrialRequest]]:
        """Group concurrent trials into packs that fit this device, as few packs as possible.

        On one device the restricted problem F(1, K) keeps every adapter that fits: they share
        one pass of the base model. Adapters are placed largest-memory first into the first pack
        with room (pack.size and the cost model's calibrated memory, at the planner's load
        factor). Multi-GPU schedules (degree > 1, DTM) are planned by ``plora-hpo plan`` but not
        executed yet.
        """
        from plora_hpo.planner import CostModel, UnschedulableError, Workload, load_calibration
        from plora_hpo.planner.model_names import shape_name_of

        cfg, gpu = self.config, self.device_spec()
        shape_name = shape_name_of(self.base.shape)
        cost = CostModel(
            Workload(self.base.shape, cfg.seq_len, tuple(cfg.target_modules), self._dtype_bytes()),
            gpu,
            load_calibration(shape_name, gpu.name) if shape_name else None,
        )
        limit = _LOAD_FACTOR * gpu.memory_bytes
        packs: list[list[TrialRequest]] = []
        for r in sorted(requests, key=lambda r: -cost.peak_memory([r.config])):
            if cost.peak_memory([r.config]) > limit:
                raise UnschedulableError(
                    f"trial {r.number} ({r.config.label()}) needs {cost.peak_memory([r.config]) / 2**30:.1f} GiB, "
                    f"more than {limit / 2**30:.1f} GiB of {gpu.name}; lower its batch size or rank",
                    [r.number],
                )
            home = next(
                (
                    p
                    for p in packs
                    if len(p) < cfg.pack.size and cost.peak_memory([*(q.config for q in p), r.config]) <= limit
                ),
                None,
            )
            if home is None:
                packs.append([r])
            else:
                home.append(r)
        return packs

    def _calibrate(self, requests: Sequence[TrialRequest], stats: Any) -> None:
        """Feed the measured step time and peak memory back into the planner's cost model."""
        from plora_hpo.planner import record_observation
        from plora_hpo.planner.model_names import shape_name_of

        shape_name = shape_name_of(self.base.shape)
        if shape_name is None:  # a model of unlisted shape: nothing to calibrate against
            return
        warm = stats.step_seconds[1 : 1 + 8] or stats.step_seconds
        record_observation(
            shape_name,
            self.device_spec(),
            [r.config for r in requests],
            self.config.seq_len,
            tuple(self.config.target_modules),
            step_seconds=sum(warm) / len(warm),
            peak_bytes=stats.peak_memory_bytes if self.device.type == "cuda" else None,
            dtype_bytes=self._dtype_bytes(),
        )

    # --- one pack -----------------------------------------------------------------------
    def run_pack(self, requests: Sequence[TrialRequest]) -> list[TrialOutcome]:
        """Train ``requests`` together, evaluate them together, log and export each one."""
        with self._lock:
            pack_id = f"pack-{next(self._pack_ids)}"
            run_ids: dict[str, str] = {}
            try:
                for r in requests:
                    run_ids[r.adapter_id] = self.tracker.start_trial(
                        r.adapter_id,
                        self.trial_params(r),
                        {"plora.pack_id": pack_id, "plora.trial_number": str(r.number), "plora.task": r.task},
                    )
                outcomes = self._train_evaluate_export(pack_id, requests, run_ids)
            except BaseException:
                for run_id in run_ids.values():
                    self.tracker.end_trial(run_id, "FAILED")
                raise
            finally:
                for r in requests:
                    if r.adapter_id in self.packed.configs:
                        self.packed.remove_adapter(r.adapter_id)
            return outcomes

    def _train_evaluate_export(
        self, pack_id: str, requests: Sequence[TrialRequest], run_ids: dict[str, str]
    ) -> list[TrialOutcome]:
        from plora_hpo.evaluation import evaluate_adapters

        trainer = PackedTrainer(
            self.packed,
            settings=self.optimizer_settings(),
            pad_id=self.base.tokenizer.pad_token_id,
            device=self.device,
        )
        by_id = {r.adapter_id: r for r in requests}
        for r in requests:
            examples = self.tasks[r.task].examples
            trainer.add_job(AdapterJob(r.adapter_id, r.config, examples, self.total_steps(r.task, r.config)))
        losses: dict[str, list[tuple[int, float, float]]] = {r.adapter_id: [] for r in requests}
        failures: dict[str, str] = {}
        every = self.config.train.report_every

        def on_step(report: StepReport) -> bool:
            if report.failed:  # already out of the pack; the others train on
                failures[report.adapter_id] = report.fail_reason
                return False
            losses[report.adapter_id].append((report.step, report.loss, report.lr))
            request = by_id[report.adapter_id]
            if request.on_report is not None and (report.step % every == 0 or trainer.is_done(report.adapter_id)):
                request.on_report(report)
            return True

        self.progress.pack_started(pack_id, len(requests), max(j.total_steps for j in trainer.jobs.values()))

        furthest = 0  # packed steps so far = the furthest step any adapter has reached

        def on_step_with_progress(report: StepReport) -> bool:
            nonlocal furthest
            if report.step > furthest:
                furthest = report.step
                self.progress.step_done()
            return on_step(report)

        stats = trainer.run(on_step_with_progress)
        self._calibrate(requests, stats)
        self.progress.evaluating(pack_id)
        metrics: dict[str, dict[str, float]] = {}
        for task in {r.task for r in requests}:
            ids = [r.adapter_id for r in requests if r.task == task and r.adapter_id not in failures]
            if not ids:
                continue
            ev = self.config.evaluation
            metrics.update(
                evaluate_adapters(
                    self.packed,
                    self.base.tokenizer,
                    ids,
                    self.tasks[task].eval_tasks,
                    limit=ev.limit,
                    batch_size=ev.batch_size,
                    max_new_tokens=ev.max_new_tokens,
                    bootstrap_iters=ev.bootstrap_iters,
                )
            )

        outcomes = []
        for r in requests:
            run_id = run_ids[r.adapter_id]
            if r.adapter_id in failures:
                outcomes.append(self._record_failure(r, run_id, pack_id, failures[r.adapter_id], losses, stats))
                continue
            adapter_dir = export_peft_adapter(
                self.packed, r.adapter_id, self.run_dir / "adapters" / r.adapter_id, self.base.name
            )
            rows = _curve_rows(losses[r.adapter_id])
            rows += [(_metric_key(k), v, 0) for k, v in metrics[r.adapter_id].items()]
            rows.append(("pack_tokens_per_second", stats.tokens_per_second, 0))
            rows.append(("pack_peak_memory_gib", stats.peak_memory_bytes / 2**30, 0))
            self.tracker.log_metrics(run_id, rows)
            self.tracker.set_tags(run_id, {"plora.pack_size": str(len(requests))})
            self.tracker.log_adapter(run_id, adapter_dir)
            self.tracker.end_trial(run_id)
            metric = self.tasks[r.task].metric
            outcomes.append(
                TrialOutcome(
                    request=r,
                    value=metrics[r.adapter_id][metric],
                    metrics=metrics[r.adapter_id],
                    losses=[loss for _, loss, _ in losses[r.adapter_id]],
                    run_id=run_id,
                    adapter_dir=adapter_dir,
                    pack_id=pack_id,
                    tokens_per_second=stats.tokens_per_second,
                )
            )
        self.progress.pack_finished(pack_id, sorted(outcomes, key=lambda o: o.failed))  # healthy first
        return outcomes

    def _record_failure(
        self,
        request: TrialRequest,
        run_id: str,
        pack_id: str,
        reason: str,
        losses: dict[str, list[tuple[int, float, float]]],
        stats: Any,
    ) -> TrialOutcome:
        """A trial that left its pack non-finite: its losses so far and the reason, run FAILED."""
        self.tracker.log_metrics(run_id, _curve_rows(losses[request.adapter_id]))
        self.tracker.set_tags(run_id, {"plora.fail_reason": reason, "plora.pack_size": str(len(losses))})
        self.tracker.end_trial(run_id, "FAILED")
        return TrialOutcome(
            request=request,
            value=math.nan,
            metrics={},
            losses=[loss for _, loss, _ in losses[request.adapter_id]],
            run_id=run_id,
            adapter_dir=None,
            pack_id=pack_id,
            tokens_per_second=stats.tokens_per_second,
            fail_reason=reason,
        )


def _curve_rows(steps: list[tuple[int, float, float]]) -> list[tuple[str, float, int]]:
    """MLflow rows of one adapter's per-step (step, loss, lr) records."""
    return [("train_loss", loss, step) for step, loss, _ in steps] + [
        ("learning_rate", lr, step) for step, _, lr in steps
    ]


def _metric_key(lm_eval_key: str) -> str:
    """MLflow names cannot hold commas: ``exact_match,flexible-extract`` → ``exact_match/flexible-extract``."""
    name, _, filt = lm_eval_key.partition(",")
    return name if filt in ("", "none") else f"{name}/{filt}"
