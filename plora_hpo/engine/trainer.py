"""Train a pack: K adapters, one frozen base, one forward/backward per step.

Each adapter has its own batch size, data order, learning rate and schedule, and its own
AdamW parameter group. The loss of adapter k is the mean token loss over its own rows; the
sum over adapters is backpropagated, so every adapter receives exactly the gradient it would
get if it trained alone. Adapters may join (:meth:`PackedTrainer.add_job`) and leave
(finished, pruned or failed) between steps without disturbing the others.
"""

from __future__ import annotations

import math
import resource
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from plora_hpo.adapter import AdapterConfig
from plora_hpo.engine.batching import IGNORE_INDEX, DataStream, PackedBatch, TokenizedExample, collate
from plora_hpo.engine.packed_lora import PackedLoraModel

_LOSS_CHUNK_TOKENS = 4096


@dataclass(frozen=True)
class OptimizerSettings:
    """What every adapter's AdamW group shares; the trial varies lr (and batch size)."""

    lr_schedule: str = "linear"  # constant | linear | cosine
    warmup_ratio: float = 0.0
    weight_decay: float = 0.0
    max_grad_norm: float | None = 1.0
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8


@dataclass
class AdapterJob:
    """One trial's training: its adapter, its data and how many optimizer steps it gets."""

    adapter_id: str
    config: AdapterConfig
    examples: Sequence[TokenizedExample]
    total_steps: int


@dataclass(frozen=True)
class StepReport:
    adapter_id: str
    step: int  # 1-based optimizer step of this adapter
    loss: float
    lr: float
    tokens: int


@dataclass
class PackStats:
    steps: int = 0
    tokens: int = 0
    seconds: float = 0.0
    peak_memory_bytes: int = 0
    step_seconds: list[float] = field(default_factory=list)

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0


def lr_multiplier(schedule: str, step: int, total: int, warmup_ratio: float) -> float:
    """LR factor for 0-based optimizer step ``step`` of ``total`` (HF-style warmup then decay)."""
    warmup = math.ceil(warmup_ratio * total)
    if step < warmup:
        return step / max(1, warmup)
    if schedule == "constant":
        return 1.0
    progress = (step - warmup) / max(1, total - warmup)
    if schedule == "linear":
        return max(0.0, 1.0 - progress)
    if schedule == "cosine":
        return 0.5 * (1.0 + math.cos(math.pi * progress))
    raise ValueError(f"unknown lr schedule {schedule!r}; use constant, linear or cosine")


def adapter_losses(
    hidden: torch.Tensor, lm_head: torch.nn.Module, labels: torch.Tensor, rows: dict[str, slice]
) -> dict[str, torch.Tensor]:
    """Mean next-token loss per adapter, computing logits only where labels are trained.

    Full-vocabulary logits of every position are never built: only label positions go through
    the LM head, in chunks.
    """
    targets = labels[:, 1:]
    keep = targets != IGNORE_INDEX
    # rows are grouped by adapter, so the kept tokens are too: one gather, then split
    selected = hidden[:, :-1][keep]
    counts = [int(keep[sl].sum()) for sl in rows.values()]
    losses: dict[str, torch.Tensor] = {}
    for adapter_id, hs, ts in zip(rows, selected.split(counts), targets[keep].split(counts)):
        if ts.numel() == 0:
            losses[adapter_id] = hidden.sum() * 0.0
            continue
        total = hs.new_zeros((), dtype=torch.float32)
        for start in range(0, ts.numel(), _LOSS_CHUNK_TOKENS):
            logits = lm_head(hs[start : start + _LOSS_CHUNK_TOKENS]).float()
            total = total + F.cross_entropy(logits, ts[start : start + _LOSS_CHUNK_TOKENS], reduction="sum")
        losses[adapter_id] = total / ts.numel()
    return losses


class PackedTrainer:
    """Runs packed optimizer steps over the active adapters of a :class:`PackedLoraModel`."""

    def __init__(
        self,
        packed: PackedLoraModel,
        *,
        settings: OptimizerSettings,
        pad_id: int,
        device: torch.device | str,
    ) -> None:
        self.packed = packed
        self.settings = settings
        self.pad_id = pad_id
        self.device = torch.device(device)
        self.jobs: dict[str, AdapterJob] = {}
        self.streams: dict[str, DataStream] = {}
        self.steps_done: dict[str, int] = {}
        self.optimizer: torch.optim.AdamW | None = None
        self.stats = PackStats()

    # --- membership -------------------------------------------------------------------
    def add_job(self, job: AdapterJob) -> None:
        """Create the adapter and its AdamW group; it trains from the next step on."""
        if job.total_steps <= 0:
            raise ValueError(f"{job.adapter_id}: total_steps must be positive, got {job.total_steps}")
        if job.adapter_id not in self.packed.configs:
            self.packed.add_adapter(job.adapter_id, job.config)
        group = {
            "params": self.packed.parameters_of(job.adapter_id),
            "lr": job.config.learning_rate,
            "adapter_id": job.adapter_id,
        }
        for p in group["params"]:
            p.requires_grad_(True)
        if self.optimizer is None:
            fused = self.device.type == "cuda"
            self.optimizer = torch.optim.AdamW(
                [group],
                lr=job.config.learning_rate,
                betas=self.settings.betas,
                eps=self.settings.eps,
                weight_decay=self.settings.weight_decay,
                fused=fused or None,
                foreach=None if fused else True,
            )
        else:
            self.optimizer.add_param_group(group)
        self.jobs[job.adapter_id] = job
        self.streams[job.adapter_id] = DataStream(job.examples, job.config.seed)
        self.steps_done[job.adapter_id] = 0

    def remove_job(self, adapter_id: str) -> None:
        """Stop training an adapter (finished, pruned or failed); its weights stay in the model."""
        assert self.optimizer is not None
        groups = self.optimizer.param_groups
        for group in [g for g in groups if g["adapter_id"] == adapter_id]:
            for p in group["params"]:
                self.optimizer.state.pop(p, None)
                p.requires_grad_(False)
                p.grad = None
            del groups[next(i for i, g in enumerate(groups) if g is group)]
        del self.jobs[adapter_id]
        del self.streams[adapter_id]

    @property
    def active(self) -> list[str]:
        return list(self.jobs)

    def is_done(self, adapter_id: str) -> bool:
        return self.steps_done[adapter_id] >= self.jobs[adapter_id].total_steps

    # --- one step ---------------------------------------------------------------------
    def next_batch(self) -> PackedBatch:
        groups = [(a, self.streams[a].take(self.jobs[a].config.batch_size)) for a in self.active]
        return collate(groups, self.pad_id, self.device)

    def step(self) -> list[StepReport]:
        """One optimizer step for every active adapter; returns their losses."""
        assert self.optimizer is not None and self.jobs, "add a job before stepping"
        started = time.perf_counter()
        batch = self.next_batch()
        model = self.packed.model
        with self.packed.route(batch.groups):
            hidden = model.base_model(
                input_ids=batch.input_ids, attention_mask=batch.attention_mask, use_cache=False
            ).last_hidden_state
            losses = adapter_losses(hidden, model.get_output_embeddings(), batch.labels, batch.rows_of())
        torch.stack(list(losses.values())).sum().backward()

        reports = []
        for group in self.optimizer.param_groups:
            adapter_id = group["adapter_id"]
            job = self.jobs[adapter_id]
            factor = lr_multiplier(
                self.settings.lr_schedule,
                self.steps_done[adapter_id],
                job.total_steps,
                self.settings.warmup_ratio,
            )
            group["lr"] = job.config.learning_rate * factor
            if self.settings.max_grad_norm is not None:
                torch.nn.utils.clip_grad_norm_(group["params"], self.settings.max_grad_norm, foreach=True)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

        rows = batch.rows_of()
        for adapter_id, loss in losses.items():
            self.steps_done[adapter_id] += 1
            group_lr = next(g["lr"] for g in self.optimizer.param_groups if g["adapter_id"] == adapter_id)
            reports.append(
                StepReport(
                    adapter_id=adapter_id,
                    step=self.steps_done[adapter_id],
                    loss=float(loss.detach()),
                    lr=group_lr,
                    tokens=int(batch.attention_mask[rows[adapter_id]].sum()),
                )
            )
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self._account(batch, time.perf_counter() - started)
        return reports

    def _account(self, batch: PackedBatch, seconds: float) -> None:
        if self.device.type == "cuda":
            peak = torch.cuda.max_memory_allocated(self.device)
        else:
            peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        self.stats.steps += 1
        self.stats.tokens += batch.real_tokens
        self.stats.seconds += seconds
        self.stats.step_seconds.append(seconds)
        self.stats.peak_memory_bytes = max(self.stats.peak_memory_bytes, peak)

    # --- a whole pack -----------------------------------------------------------------
    def run(self, on_step: Callable[[StepReport], bool] | None = None) -> PackStats:
        """Step until every adapter has finished; ``on_step`` returning False removes that adapter."""
        while self.jobs:
            for report in self.step():
                keep = on_step(report) if on_step is not None else True
                if keep is False or self.is_done(report.adapter_id):
                    self.remove_job(report.adapter_id)
        return self.stats
