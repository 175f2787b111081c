"""Train a pack: K adapters, one frozen base, one forward/backward per step.

Each adapter has its own batch size, data order, learning rate and schedule, and its own
AdamW parameter group. The loss of adapter k is the mean token loss over its own rows; the
sum over adapters is backpropagated, so every adapter receives exactly the gradient it would
get if it trained alone. Adapters may join (:meth:`PackedTrainer.add_job`) and leave
(finished, pruned or failed) between steps without disturbing the others.

On the CPU an adapter's losses and weights are bitwise those of training it alone, whoever
its packmates (a sweep resumed with other packmates continues exactly): its sequences are
padded to its own longest, attention runs within each sequence, one batched call per adapter
(:mod:`plora_hpo.engine.batching`, ``isolate``), its LoRA products and their weight-gradient
reductions run over its own tokens only, and micro-batching cuts its sequences into chunks on
their own. The base model's matrix products run over every adapter's rows at once; on the CPU
(MKL) a row of their result does not depend on the other rows. On the GPU, cuBLAS picks GEMM
kernels by problem size and the LoRA kernels split their reductions by the whole pack's work,
so results agree to rounding only whatever the layout; there padded rows keep pack-wide
padding, ``(rows, T)`` with one batched attention call, which measured faster for packs of
short sequences.

Speed knobs (all keep that contract; see the constructor): flat adapter storage with one
bf16 cast per step, micro-batching with length bucketing, padding-free (varlen) sequences,
activation checkpointing, fused RMSNorm/SwiGLU/rotary embedding, and a loss that keeps one chunk of logits alive.
A step reads nothing back from the GPU until its losses and gradient norms, once, just before
the update (an adapter whose loss or gradient is non-finite leaves the pack there, unupdated).
"""

from __future__ import annotations

import math
import os
import resource
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from plora_hpo.adapter import AdapterConfig
from plora_hpo.engine.batching import (
    ROW_LAYOUTS,
    DataStream,
    MicroBatch,
    TokenizedExample,
    plan_micro_batches,
    to_device,
)
from plora_hpo.engine.fused import (
    CU_SEQLENS_KWARG,
    MAX_SEQLEN_KWARG,
    SEQ_RUNS_KWARG,
    fuse_elementwise,
    install_varlen_attention,
    unfuse_elementwise,
)
from plora_hpo.engine.lora_dropout import forward_key
from plora_hpo.engine.loss import grouped_label_loss
from plora_hpo.engine.packed_lora import PackedLoraModel
from plora_hpo.kernels import can_compile_ahead, compile_ahead

LOSS_CHUNK_TOKENS = 4096


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
    fail_reason: str | None = None  # set when this step's loss or gradient was non-finite

    @property
    def failed(self) -> bool:
        return self.fail_reason is not None


@dataclass
class _Prefetched:
    """The next step's micro-batches, built while the GPU still runs this step's update."""

    ids: tuple[str, ...]  # the adapters (in pack order) they were built for
    positions: dict[str, tuple[int, int]]  # each one's stream position before the take
    micro_batches: list[MicroBatch]


@dataclass
class PackStats:
    steps: int = 0
    tokens: int = 0  # real (non-padding) tokens
    padded_tokens: int = 0  # tokens the base model computed, padding included
    micro_batches: int = 0
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


class PackedTrainer:
    """Runs packed optimizer steps over the active adapters of a :class:`PackedLoraModel`.

    Args:
        packed: the model with its adapter layers.
        settings: what every adapter's AdamW group shares.
        pad_id: token written into padding.
        device: where the model lives.
        micro_batch_tokens: split each step into forwards/backwards of at most this many tokens
            (padded tokens for ``row_layout="padded"``, real tokens for ``"varlen"``) and accumulate
            the gradients; the losses and gradients equal the unsplit step's. ``None``: one
            forward per step. Padded micro-batches are bucketed by sequence length; on the CPU
            each adapter's sequences are cut into chunks on their own, at most one chunk of each
            adapter per micro-batch.
        row_layout: ``"padded"`` (right-padded sequences: on the GPU one row per sequence, padded
            to the micro-batch's longest; on the CPU each sequence padded to the longest of its
            own adapter's, all back to back in one row) or ``"varlen"`` (padding-free: each
            micro-batch is one row of sequences concatenated back to back, attention kept within
            sequences). One row of sequences needs the model loaded with
            ``attn_implementation="sdpa"``.
        activation_checkpointing: recompute each decoder layer in the backward (keeps only layer
            inputs, at the cost of a second forward).
        fused_elementwise: fused RMSNorm, SwiGLU and rotary embedding (:mod:`plora_hpo.engine.fused`); ``None``
            means on for CUDA, off elsewhere.
        flat_storage: keep the trained adapters' factors in one fp32 buffer, one flat
            parameter per adapter (one kernel input per layer instead of K, one bf16 cast per
            step, and AdamW / gradient norms / clipping on K flat tensors; see
            :mod:`plora_hpo.engine.packed_lora`). Off: per-layer parameters, per-call casts.
        loss_chunk_tokens: rows per LM-head chunk of the loss.
        prefetch: build the next step's batches during each step, while the GPU computes (given
            back to their streams if the pack's membership changes first, a failing adapter's too).

    Tensor parallelism (a model split by :func:`~plora_hpo.engine.tensor_parallel.shard_model`):
    every rank of the group builds its own trainer the same way, adds and removes the same jobs
    and calls :meth:`step` for the same steps; the data streams are seeded, so every rank feeds
    the same batches, and the losses, reports and updates are the same on every rank. Needs
    ``flat_storage``.
    """

    def __init__(
        self,
        packed: PackedLoraModel,
        *,
        settings: OptimizerSettings,
        pad_id: int,
        device: torch.device | str,
        micro_batch_tokens: int | None = None,
        row_layout: str = "padded",
        activation_checkpointing: bool = False,
        fused_elementwise: bool | None = None,
        flat_storage: bool = True,
        loss_chunk_tokens: int = LOSS_CHUNK_TOKENS,
        prefetch: bool = True,
    ) -> None:
        if row_layout not in ROW_LAYOUTS:
            raise ValueError(f"unknown row_layout {row_layout!r}; use one of {ROW_LAYOUTS}")
        if micro_batch_tokens is not None and micro_batch_tokens <= 0:
            raise ValueError(f"micro_batch_tokens must be positive, got {micro_batch_tokens}")
        if packed.parallel is not None and not flat_storage:
            raise ValueError("a tensor-parallel pack trains with flat_storage=True; drop flat_storage=False")
        self.packed = packed
        self.settings = settings
        self.pad_id = pad_id
        self.device = torch.device(device)
        self.micro_batch_tokens = micro_batch_tokens
        self.row_layout = row_layout
        self.flat_storage = flat_storage
        self.loss_chunk_tokens = loss_chunk_tokens
        self.jobs: dict[str, AdapterJob] = {}
        self.streams: dict[str, DataStream] = {}
        self.steps_done: dict[str, int] = {}
        self.optimizer: torch.optim.AdamW | None = None
        self.stats = PackStats()
        self.prefetch = prefetch
        self._prefetched: _Prefetched | None = None
        self._copies_pending: list[torch.cuda.Event] = []  # host copies the next update waits for
        packed.set_activation_checkpointing(activation_checkpointing)
        if fused_elementwise is None:
            fused_elementwise = self.device.type == "cuda"
        if fused_elementwise:
            fuse_elementwise(packed.model)
        else:
            unfuse_elementwise(packed.model)
        # CPU: each adapter's part of a micro-batch from its own sequences alone (bitwise packmate independence)
        self.isolate = self.device.type == "cpu"
        self._row_mask: torch.Tensor | None = None
        if row_layout == "varlen" or self.isolate:  # micro-batches of one row of sequences
            implementation = getattr(packed.model.config, "_attn_implementation", None)
            if implementation != "sdpa":
                raise ValueError(
                    f"row_layout={row_layout!r} on {self.device.type} needs the model loaded with "
                    f"attn_implementation='sdpa', not {implementation!r}"
                )
            install_varlen_attention()
            # placeholder, never read: attention over concatenated sequences ignores masks
            self._row_mask = torch.ones((1, 1, 1, 1), dtype=torch.bool, device=self.device)

    # --- membership -------------------------------------------------------------------
    def add_job(self, job: AdapterJob) -> None:
        """Create the adapter and its AdamW group; it trains from the next step on."""
        if job.total_steps <= 0:
            raise ValueError(f"{job.adapter_id}: total_steps must be positive, got {job.total_steps}")
        if job.adapter_id in self.jobs:
            raise ValueError(f"{job.adapter_id} is already training in this pack")
        self.discard_prefetched()
        if job.adapter_id not in self.packed.configs:
            self.packed.add_adapter(job.adapter_id, job.config)
        # flat storage: one flat parameter per adapter (and chunk of layers); else per-layer ones
        if self.flat_storage:
            params = list(self.packed.flat_parameters(job.adapter_id))
        else:
            self.packed.separate(job.adapter_id)  # dense per-layer storage, not views of a flat one
            params = self.packed.parameters_of(job.adapter_id)
        group = {"params": params, "lr": job.config.learning_rate, "adapter_id": job.adapter_id}
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
        if self._prefetched is not None and adapter_id in self._prefetched.ids:
            self.discard_prefetched()
        if adapter_id in self.packed.stored_ids:
            self.packed.release_storage()  # rebuilt without it at the next step
        self._drop_group(adapter_id)
        del self.jobs[adapter_id]
        del self.streams[adapter_id]

    def _drop_group(self, adapter_id: str) -> None:
        """Take an adapter out of the optimizer (its group, state and grads), nothing else.

        Mid-step (a non-finite adapter) this must not release the flat storage: releasing drops
        every adapter's accumulated gradients, and the healthy ones still need theirs for this step's update.
        """
        assert self.optimizer is not None
        groups = self.optimizer.param_groups
        for group in [g for g in groups if g["adapter_id"] == adapter_id]:
            for p in group["params"]:
                self.optimizer.state.pop(p, None)
                p.requires_grad_(False)
                p.grad = None
            del groups[next(i for i, g in enumerate(groups) if g is group)]

    @property
    def active(self) -> list[str]:
        return list(self.jobs)

    def is_done(self, adapter_id: str) -> bool:
        return self.steps_done[adapter_id] >= self.jobs[adapter_id].total_steps

    # --- data -------------------------------------------------------------------------
    def next_micro_batches(self) -> list[MicroBatch]:
        """Take every active adapter's next batch and split the step into micro-batches."""
        prefetched, self._prefetched = self._prefetched, None
        if prefetched is not None and prefetched.ids == tuple(self.active):
            return prefetched.micro_batches
        if prefetched is not None:
            self._rewind(prefetched)
        return self._build_micro_batches(self.active)

    def _build_micro_batches(self, ids: Sequence[str]) -> list[MicroBatch]:
        groups = [(a, self.streams[a].take(self.jobs[a].config.batch_size)) for a in ids]
        return plan_micro_batches(
            groups,
            self.pad_id,
            self.device,
            row_layout=self.row_layout,
            max_tokens=self.micro_batch_tokens,
            isolate=self.isolate,
        )

    def _prefetch(self) -> None:
        """Build the next step's batches now, during this step (before its results are read back),
        for the adapters that go on after it, so the host does it while the GPU computes instead
        of the GPU waiting for it at the next step."""
        ids = tuple(a for a in self.active if self.steps_done[a] + 1 < self.jobs[a].total_steps)
        if self.prefetch and ids:
            positions = {a: self.streams[a].position() for a in ids}
            self._prefetched = _Prefetched(ids, positions, self._build_micro_batches(ids))

    def _rewind(self, prefetched: _Prefetched) -> None:
        for adapter_id, position in prefetched.positions.items():
            if adapter_id in self.streams:
                self.streams[adapter_id].seek(*position)

    def discard_prefetched(self) -> None:
        """Give the prefetched batches back to their streams (the pack's membership changed)."""
        prefetched, self._prefetched = self._prefetched, None
        if prefetched is not None:
            self._rewind(prefetched)

    def stream_position(self, adapter_id: str) -> tuple[int, int]:
        """Where an adapter's data stands for the steps taken so far (prefetched data excluded)."""
        if self._prefetched is not None and adapter_id in self._prefetched.positions:
            return self._prefetched.positions[adapter_id]
        return self.streams[adapter_id].position()

    # --- one step ---------------------------------------------------------------------

    def _ensure_storage(self) -> None:
        if not self.flat_storage:
            return
        if not self.packed.storage_intact(self.active):
            self.packed.build_storage(self.active)
            self._sync_flat_params()
        self.packed.refresh_compute()  # this step's bf16 copy of every adapter: one cast kernel

    def _sync_flat_params(self) -> None:
        """After the storage was rebuilt, make sure each group holds its adapter's flat parameter (the same
        object unless the adapter's storage was rebuilt from its per-layer parameters)."""
        assert self.optimizer is not None
        for group in self.optimizer.param_groups:
            flats = self.packed.flat_parameters(group["adapter_id"])
            for i, flat in enumerate(flats):
                if group["params"][i] is not flat:
                    state = self.optimizer.state.pop(group["params"][i], None)
                    group["params"][i] = flat
                    if state is not None:
                        self.optimizer.state[flat] = state
                flat.requires_grad_(True)

    def _clip_flat(self, ids: list[str]) -> dict[str, torch.Tensor]:
        """Per-adapter gradient norms, and clipping, on the adapters' flat gradients (a few
        launches for the whole pack instead of a clip_grad_norm_ call per adapter)."""
        assert self.optimizer is not None
        groups = {g["adapter_id"]: g for g in self.optimizer.param_groups}
        if self.packed.parallel is not None:
            norms = self.packed.storage_grad_norms()  # over the whole model: a collective
        else:
            grads = [p.grad for a in ids for p in groups[a]["params"]]
            chunks = len(grads) // len(ids)
            # like clip_grad_norm_: the norm of the per-tensor norms, per adapter
            norms = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads)).view(len(ids), chunks), dim=1)
        max_norm = self.settings.max_grad_norm
        if max_norm is not None:
            # clip_grad_norm_'s coefficient, per adapter
            coefs = torch.clamp(max_norm / (norms + 1e-6), max=1.0)
            storage = self.packed.flat_storage
            assert storage is not None and tuple(ids) == storage.ids  # _ensure_storage stored exactly these
            row_coefs = coefs.index_select(0, storage.row_adapter).unsqueeze(1)  # one kernel per buffer
            for grad in storage.grad:
                grad.mul_(row_coefs)
        return dict(zip(ids, norms.unbind()))

    def _dropout_keys(self, micro_batches: list[MicroBatch]) -> list[list[int] | None]:
        """Per micro-batch, each group's :func:`forward_key` (its adapter's seed, step and how many
        of its micro-batches came before); None for all when no adapter of the step uses dropout."""
        if not any(self.jobs[a].config.lora_dropout for a in self.active):
            return [None] * len(micro_batches)
        seen: dict[str, int] = {}
        keys = []
        for mb in micro_batches:
            keys.append(
                [forward_key(self.jobs[a].config.seed, self.steps_done[a], seen.get(a, 0)) for a, _ in mb.groups]
            )
            for a, rows in mb.groups:
                seen[a] = seen.get(a, 0) + (rows > 0)
        return keys

    def _forward_backward(
        self, mb: MicroBatch, normalizers: torch.Tensor, dropout_keys: list[int] | None = None
    ) -> torch.Tensor:
        """One micro-batch: per-adapter loss contributions (detached), gradients accumulated."""
        model = self.packed.model
        # Padding is on the right, so causal attention never lets a real token see it: (rows, T)
        # micro-batches need no padding mask, and SDPA takes its fast is_causal path. One row of
        # sequences: attention is kept within each sequence; a prepared 4-D mask makes Hugging
        # Face skip building a T×T one.
        kwargs = {}
        if mb.cu_seqlens is not None:
            kwargs = {
                "attention_mask": self._row_mask,
                "position_ids": mb.position_ids,
                CU_SEQLENS_KWARG: mb.cu_seqlens,
                MAX_SEQLEN_KWARG: mb.max_seqlen,
                SEQ_RUNS_KWARG: mb.seq_runs,
            }
        with self.packed.route(mb.groups, token_counts=mb.token_counts, dropout_keys=dropout_keys):
            hidden = model.base_model(input_ids=mb.input_ids, use_cache=False, **kwargs).last_hidden_state
            selected = hidden.reshape(-1, hidden.shape[-1]).index_select(0, mb.label_index)
            sums = grouped_label_loss(
                selected,
                model.get_output_embeddings(),
                mb.targets,
                mb.label_group,
                len(mb.groups),
                chunk_tokens=self.loss_chunk_tokens,
            )
        contributions = sums / normalizers
        if mb.label_index.numel():
            contributions.sum().backward()
        return contributions.detach()

    def step(self) -> list[StepReport]:
        """One optimizer step for every active adapter; returns their losses."""
        assert self.optimizer is not None and self.jobs, "add a job before stepping"
        started = time.perf_counter()
        self._ensure_storage()
        micro_batches = self.next_micro_batches()
        ids = self.active
        label_totals = [sum(mb.label_counts[g] for mb in micro_batches) for g in range(len(ids))]
        normalizers = to_device(torch.tensor([max(1, n) for n in label_totals], dtype=torch.float32), self.device)
        losses = torch.zeros(len(ids), dtype=torch.float32, device=self.device)
        for mb, keys in zip(micro_batches, self._dropout_keys(micro_batches)):
            losses += self._forward_backward(mb, normalizers, keys)
        self.packed.reduce_storage_grads()  # tensor parallelism: complete replicated factors' gradients

        lrs, norms = {}, []
        flat_norms = self._clip_flat(ids) if self.flat_storage else None
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
            lrs[adapter_id] = group["lr"]
            if flat_norms is not None:
                norms.append(flat_norms[adapter_id])
                continue
            params = [p for p in group["params"] if p.grad is not None]
            if self.settings.max_grad_norm is not None:
                norm = torch.nn.utils.clip_grad_norm_(params, self.settings.max_grad_norm, foreach=True)
            else:
                norm = torch.nn.utils.get_total_norm([p.grad for p in params], foreach=True)
            norms.append(norm.reshape(()).to(device=self.device, dtype=torch.float32))
        self._prefetch()  # host work while the GPU finishes this step's backward pass
        # The step's one device→host read, before the update: a non-finite adapter must leave
        # the pack before optimizer.step() touches its weights or AdamW state.
        grad_norms = dict(zip([g["adapter_id"] for g in self.optimizer.param_groups], norms))
        checks = torch.stack([losses, torch.stack([grad_norms[a] for a in ids])]).tolist()
        values, norm_values = checks
        failures = {
            a: _fail_reason(a, values[g], norm_values[g])
            for g, a in enumerate(ids)
            if not (math.isfinite(values[g]) and math.isfinite(norm_values[g]))
        }
        for adapter_id in failures:
            self._drop_group(adapter_id)
        if self.optimizer.param_groups:
            self._await_copies()
            self.optimizer.step()
        self.packed.mark_stale()  # the bf16 copy is recast at the next step
        self.zero_grads()
        for adapter_id in failures:
            self.remove_job(adapter_id)

        reports = []
        for g, adapter_id in enumerate(ids):
            step = self.steps_done[adapter_id] + 1
            if adapter_id not in failures:  # a failed step was never applied
                self.steps_done[adapter_id] = step
            reports.append(
                StepReport(
                    adapter_id=adapter_id,
                    step=step,
                    loss=values[g],
                    lr=lrs[adapter_id],
                    tokens=sum(mb.tokens_per_group[g] for mb in micro_batches),
                    fail_reason=failures.get(adapter_id),
                )
            )
        # No synchronisation here: the GPU runs the update while the host returns. The losses'
        # read above paces the host to at most one step ahead, so a step's seconds (start to
        # that read, plus the launches after it) sum to a run's time.
        self._account(micro_batches, time.perf_counter() - started)
        return reports

    def update_after(self, events: list[torch.cuda.Event]) -> None:
        """The next optimizer update waits, on the device, until ``events`` complete: copies of
        the weights or AdamW state still being read (:func:`~plora_hpo.engine.host_copy.queue_host_copies`).
        The forward and backward passes before it only read them, so they run meanwhile."""
        self._copies_pending.extend(events)

    def _await_copies(self) -> None:
        for event in self._copies_pending:
            torch.cuda.current_stream(self.device).wait_event(event)
        self._copies_pending.clear()

    def compile_kernels(self, threads: int | None = None) -> bool:
        """Compile the Triton kernels of the next step, and the variants later steps may take, on
        ``threads`` threads (default: every core this process may use) instead of one at a time
        inside the first steps. One forward and backward of the next step's first micro-batch runs
        with the LoRA kernels compiled but not launched; it updates nothing, and the next step
        trains on the same batches. Returns whether anything was compiled: only on a GPU, for a pack
        of one device, with a Triton that compiles asynchronously."""
        if not self.jobs or not can_compile_ahead(self.device) or self.packed.parallel is not None:
            return False
        self._ensure_storage()
        self.discard_prefetched()
        ids = tuple(self.active)
        positions = {a: self.streams[a].position() for a in ids}
        micro_batches = self._build_micro_batches(ids)
        self._prefetched = _Prefetched(ids, positions, micro_batches)
        normalizers = torch.ones(len(ids), dtype=torch.float32, device=self.device)
        with compile_ahead(threads or len(os.sched_getaffinity(0))):
            self._forward_backward(micro_batches[0], normalizers, self._dropout_keys(micro_batches)[0])
        self.zero_grads()
        return True

    def zero_grads(self) -> None:
        """Drop every adapter's accumulated gradients (after an update, or to undo a step)."""
        if self.packed.stored_ids:
            self.packed.zero_storage_grads()  # in place: the parameters' grads are views of these
        elif self.optimizer is not None:
            self.optimizer.zero_grad(set_to_none=True)

    def _account(self, micro_batches: Sequence[MicroBatch], seconds: float) -> None:
        if self.device.type == "cuda":
            peak = torch.cuda.max_memory_allocated(self.device)
        else:
            peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        self.stats.steps += 1
        self.stats.tokens += sum(mb.real_tokens for mb in micro_batches)
        self.stats.padded_tokens += sum(mb.padded_tokens for mb in micro_batches)
        self.stats.micro_batches += len(micro_batches)
        self.stats.seconds += seconds
        self.stats.step_seconds.append(seconds)
        self.stats.peak_memory_bytes = max(self.stats.peak_memory_bytes, peak)

    # --- a whole pack -----------------------------------------------------------------
    def run(self, on_step: Callable[[StepReport], bool] | None = None) -> PackStats:
        """Step until every adapter has finished; ``on_step`` returning False removes that adapter.

        An adapter whose loss or gradient norm turns non-finite is removed inside :meth:`step`
        (before the update); its report carries ``fail_reason`` and the others go on untouched.
        """
        while self.jobs:
            for report in self.step():
                keep = on_step(report) if on_step is not None else True
                if report.failed:  # already out of the pack (see step)
                    continue
                if keep is False or self.is_done(report.adapter_id):
                    self.remove_job(report.adapter_id)
        return self.stats


def _fail_reason(adapter_id: str, loss: float, grad_norm: float) -> str:
    what = f"loss {loss}" if not math.isfinite(loss) else f"gradient norm {grad_norm}"
    return f"{adapter_id}: non-finite {what}; the adapter left its pack before the update"
