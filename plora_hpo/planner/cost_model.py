"""Analytic cost model of a pack: peak memory per GPU and seconds per packed step.

Why: the planner must know, before anything runs, whether a set of adapters fits on ``d`` GPUs
and how fast the pack trains. The model is analytic: memory counts the tensors the engine keeps
alive (weights, each layer's saved activations, one logits chunk, adapter factors, gradients and
AdamW states; see :class:`Prior`), time is FLOPs ÷ measured matmul rate plus bytes ÷ bandwidth
plus host launch time. It is scaled per (model, GPU) by a
:class:`~plora_hpo.planner.calibration.Calibration` fitted from the first iterations of real
packs (:mod:`plora_hpo.planner.observations`).

Every quantity splits into a part shared by the pack (``overhead_terms``, ``base_memory_terms``)
plus one part per adapter (``adapter_terms``, ``adapter_memory_terms``). That additivity is what
lets the ILP stay linear in the selection. It is exact for one forward per step (the sweep's
default); with micro-batching (``Workload.micro_batch_tokens``) the whole-pack functions
(``memory_terms``, ``step_terms``) count the forwards and the largest forward's activations, while
the per-adapter parts stay an upper bound on memory.

Multi-GPU packs (degree ``d > 1``) run tensor-parallel, as :mod:`plora_hpo.engine.tensor_parallel`
splits them: every one of the ``d`` GPUs holds the embeddings, norms and LM head whole and
``1/d`` of each decoder projection (q/k/v/gate/up by output rows, o/down by input columns), and
processes *all* of the pack's rows. Per GPU, the residual stream, the norms' inputs and outputs,
the loss's hidden rows and the logits chunk are kept for every token, the attention heads' and
the MLP's intermediate activations for ``1/d`` of their features; an adapter keeps its replicated
factors whole (A of a column-parallel projection, B of a row-parallel one) and ``1/d`` of the
split ones, with their gradients and AdamW states. Projection and attention FLOPs divide by
``d``, the LM head's do not; the LoRA work follows the factors each GPU holds. Each step adds a
ring all-reduce (``2(d-1)/d`` of the bytes over the GPU link) of the block's hidden states per
attention and MLP block in the forward, again in the backward (but the first block's: the frozen
embeddings need no gradient) and the attention block's in the recomputed forward under
checkpointing, and one of the replicated factors' fp32 gradients. Activations and
communication grow with each adapter's tokens, so they stay per-adapter terms; the ``comm`` term
has its own calibration factor, fitted once packs of degree > 1 have been measured.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, fields, replace

from plora_hpo.adapter import AdapterConfig
from plora_hpo.errors import ConfigError, PloraError
from plora_hpo.planner.calibration import Calibration
from plora_hpo.shapes import TARGET_MODULES, ModelShape

GIB = 2**30
# the row-parallel projections of :mod:`plora_hpo.engine.tensor_parallel` (split by input columns;
# every other projection by output rows); repeated here so that the planner needs no torch
ROW_PARALLEL = ("o_proj", "down_proj")
ROTATION_TURNS = 8
"""Turns a full pack with ``pack.rotate`` takes to train its members: a waiting trial takes a
member's place once it is behind by 1 / ``ROTATION_TURNS`` of its steps (the sweep's worker), and
:meth:`CostModel.rotating_pack_seconds` plays the pack in that many turns."""


@dataclass(frozen=True)
class GpuSpec:
    """One accelerator kind as the cost model sees it (defaults: the H200 measured here).

    Attributes:
        name: GPU kind; calibrations are stored per (model, ``name``).
        memory_gib: memory of one device.
        matmul_tflops: measured bf16 dense matmul rate (8192³ on the H200: 789 TFLOP/s).
        bandwidth_tbs: device memory bandwidth.
        link_gbs: per-direction GPU-to-GPU bandwidth (NVLink on the H200), for degree > 1.
        async_launch: kernels are queued asynchronously, so host launch time overlaps GPU
            work (step = max of the two). False for CPU runs, where the two add up.
    """

    name: str
    memory_gib: float
    matmul_tflops: float = 789.0
    bandwidth_tbs: float = 4.3
    link_gbs: float = 450.0
    async_launch: bool = True

    def __post_init__(self) -> None:
        if not self.name.strip():
            raise PloraError("GPU name is empty; name the GPU kind, e.g. 'H200'")
        if not (math.isfinite(self.memory_gib) and self.memory_gib > 0):
            raise PloraError(
                f"GPU memory must be a positive number of GiB, got {self.memory_gib}; "
                "pass the memory of one GPU, e.g. --gpu-memory-gib 80"
            )
        for name in ("matmul_tflops", "bandwidth_tbs", "link_gbs"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise PloraError(f"GPU {name} must be positive, got {value}")

    @property
    def memory_bytes(self) -> float:
        return self.memory_gib * GIB

    @classmethod
    def host(cls, memory_gib: float | None = None) -> GpuSpec:
        """The CPU host as a one-device "GPU": memory budget = RAM unless given; rough CPU rates."""
        if memory_gib is None:
            memory_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GIB
        return cls("cpu", memory_gib, matmul_tflops=0.1, bandwidth_tbs=0.02, link_gbs=1.0, async_launch=False)


ENGINES = ("packed", "peft")


@dataclass(frozen=True)
class Workload:
    """What every pack of a sweep shares: base model shape, sequence length, targets, dtype, engine.

    Attributes:
        shape: decoder dimensions of the frozen base model.
        seq_len: tokens per training sequence (sequences are padded/truncated to it).
        targets: projections that carry adapters.
        dtype_bytes: bytes per element of base weights and activations (2 for bf16).
        checkpointing: activation checkpointing per decoder layer (recompute in backward).
        logits_chunk_tokens: the loss is computed over this many tokens at a time, so only one
            chunk of full-vocabulary logits is alive (the engine's default chunk is 4096);
            ``None`` means all logits at once (PEFT).
        micro_batch_tokens: the engine's ``micro_batch_tokens`` (each step split into forwards of
            at most this many padded tokens, whole rows); ``None``: one forward per step.
        engine: ``"packed"`` (this package's trainer: packed adapter storage, fused RMSNorm/SwiGLU/rotary
            and chunked cross-entropy on CUDA) or ``"peft"`` (eager transformers + PEFT, one
            adapter; the baseline the benchmarks compare against).
    """

    shape: ModelShape
    seq_len: int
    targets: tuple[str, ...] = TARGET_MODULES
    dtype_bytes: int = 2
    checkpointing: bool = False
    logits_chunk_tokens: int | None = 4096
    micro_batch_tokens: int | None = None
    engine: str = "packed"

    def __post_init__(self) -> None:
        if self.seq_len <= 0:
            raise ConfigError(f"seq_len must be positive, got {self.seq_len}")
        if not self.targets:
            raise ConfigError("no target modules; list at least one, e.g. q_proj")
        for module in self.targets:
            try:
                self.shape.linear_dims(module)
            except KeyError as err:
                raise ConfigError(err.args[0]) from None
        if self.dtype_bytes not in (1, 2, 4):
            raise ConfigError(f"dtype_bytes must be 1, 2 or 4, got {self.dtype_bytes}")
        if self.logits_chunk_tokens is not None and self.logits_chunk_tokens <= 0:
            raise ConfigError(f"logits_chunk_tokens must be positive, got {self.logits_chunk_tokens}")
        if self.micro_batch_tokens is not None and self.micro_batch_tokens <= 0:
            raise ConfigError(f"micro_batch_tokens must be positive, got {self.micro_batch_tokens}")
        if self.engine not in ENGINES:
            raise ConfigError(f"unknown engine {self.engine!r}; use one of {', '.join(ENGINES)}")

    @property
    def rows_per_micro_batch(self) -> int | None:
        """Sequences per forward when micro-batching (at least one), else None."""
        if self.micro_batch_tokens is None:
            return None
        return max(1, self.micro_batch_tokens // self.seq_len)


@dataclass(frozen=True)
class Prior:
    """Constants of the analytic prior; the defaults describe the packed engine on CUDA.

    Memory is counted from what autograd keeps alive at the end of the forward (the peak: every
    layer's saved tensors, the optimizer state, one logits chunk), tensor by tensor, per token
    and decoder layer (h = hidden, kv = key/value width, i = MLP intermediate), in the
    activations' dtype:

    * RMSNorm (fused ``F.rms_norm``) saves its input: the layer input and the post-attention
      residual (2h); the q/k/v and gate/up projections (and their LoRA kernels) share the two
      norm outputs (2h); flash attention keeps q (h), k and v (2kv, GQA not repeated) and its
      output (h), which o_proj reuses; the fused SwiGLU keeps gate and up (2i) and down_proj its
      input (i). Total 6h + 2kv + 3i (without fusion, qwen2.5-1.5b K 32 on an H200 measures 15.2 GiB
      more; the 2h + i that eager RMSNorm's fp32 copies and eager SiLU add predict 15.4).
    * each LoRA kernel keeps its rank buffer ``x·Aᵀ``: r_k per token per target;
    * after the last layer: the final norm's input, its output, the trained rows selected from it
      and the loss's precomputed hidden gradient (4h per token);
    * one chunk of logits, overwritten in place by their gradient (2 bytes per logit);
    * adapters: fp32 factor, gradient (flat storage buffers, zeroed in place, never freed), AdamW
      ``exp_avg`` and ``exp_avg_sq`` (16 bytes per parameter), plus the bf16 copy of every
      layer's concatenated factors that the kernels save for the backward (2 more; one layer's worth
      under checkpointing, where the copy is recomputed layer by layer).

    Step time: the larger of host launches (per layer, adapted projection and forward, plus per
    adapter) and device time (matmul FLOPs ÷ measured peak, activation and LoRA bytes ÷
    bandwidth, a fixed time per layer and forward, the optimizer update). The update is device
    time only: the engine does not wait for it at the end of a step, so the next step's
    launches overlap it. Memory, matmul, traffic, LoRA and optimizer constants are fitted to an
    H200 profile of one qwen2.5-1.5b K 32 step with eager rotary embedding and per-layer weight
    gradients: cuBLAS and cuDNN attention 0.217 s for 155.5 TFLOP (efficiency 0.93);
    LoRA kernels 0.081 s, of which their activation bytes take 0.047 s, leaving 8.05 TFLOP at 0.3
    of the peak; AdamW, norms, clip and zeroing ≈ 0.024 s for 1.74 G parameters × 44 bytes (0.74
    of the bandwidth); SwiGLU, RMSNorm, cross-entropy and the other elementwise kernels ≈ 0.049 s
    besides the adapter casts (3.7 passes over the saved activations, plus the logits). The same
    step with the fused rotary embedding and weight-gradient kernels that add into the fp32
    gradient buffer (``benchmarks/results/throughput-h200.json``) profiles cuBLAS at 0.217 s, the
    LoRA kernels at 0.092 s (they also read and write the fp32 gradient), the elementwise
    families at 0.057 s and the optimizer at 0.019 s; the prior predicts 0.271 s for base +
    elementwise (profile 0.275) and 0.088 s for LoRA, so the constants hold for it; its
    per-forward adapter bytes are the bf16 cast (6) and the kernels' fp32 read-modify-write of
    the gradient (8). Its step (0.403 s) exceeds the kernels'
    busy time (0.387 s) by 0.016 s: the gaps between its 2585 kernels, 0.57 ms per layer and
    forward. Its host-bound rows (K 1 0.149 s, K 8 0.173 s, and K 32 cut into three forwards of
    8,192 tokens, 0.493 s) give 26 ms per step, 0.120 s per forward of 28 layers and 3.4 ms per
    adapter; of a layer's 4.3 ms, 0.38 ms per adapted projection (in the same proportion as the
    other profile's host times). The per-step part is a step's own host work (its batches, the
    loss read back, the update), done once however many forwards the step has. Calibration
    corrects them per (model, GPU).
    """

    # memory: saved elements per token and decoder layer
    saved_per_hidden: float = 6.0
    saved_per_kv: float = 2.0
    saved_per_intermediate: float = 3.0
    # of saved_per_hidden, what a tensor-parallel rank keeps whole (norm inputs and outputs); the
    # rest (q and the attention output) is per head, 1/d of it on each rank
    saved_replicated_per_hidden: float = 4.0
    loss_hidden_rows: float = 4.0  # per token after the last layer, × hidden
    logits_bytes_per_vocab: float = 14.0  # all logits kept (PEFT): bf16 + fp32 copy + log-softmax + grad
    chunk_logits_bytes_per_vocab: float = 2.0  # one chunk, gradient written in place (engine/loss.py)
    reserve_gib: float = 0.1  # allocator workspace that does not grow with anything
    adapter_state_bytes: float = 16.0  # fp32 param + grad + AdamW exp_avg + exp_avg_sq
    adapter_compute_copy: bool = True  # low-precision copy of the factors saved per layer
    # time
    matmul_efficiency: float = 0.93  # of the measured peak, on base-model matmuls
    traffic_passes: float = 3.7  # HBM bytes moved by non-matmul kernels per saved activation byte
    chunk_logit_traffic_bytes: float = 6.0  # per logit: fused CE reads twice, writes the gradient once
    lora_efficiency: float = 0.3  # of the peak, on the LoRA FLOPs (beyond their activation traffic)
    lora_input_passes: float = 3.0  # x read by shrink (forward) and dA (backward), dx written
    lora_output_passes: float = 4.0  # base output read, output written, dy read twice (dB, shrink)
    step_param_bytes: float = 44.0  # AdamW 28 (4 reads, 3 writes) + grad-norm clip 12 + zeroing 4
    micro_param_bytes: float = 14.0  # per forward: bf16 cast 6 + the kernels' fp32 gradient read and write 8
    # AdamW (one parameter group per adapter), norms, clip and zeroing reach this share of the
    # bandwidth; the per-forward casts run on the contiguous flat storage buffers at full bandwidth.
    optimizer_bandwidth_efficiency: float = 0.74
    gpu_fixed_per_layer_s: float = 0.57e-3  # per forward: GPU gaps between the layer's kernels
    launch_per_step_s: float = 25.9e-3  # host time once per step, however many forwards it has
    launch_per_layer_s: float = 1.63e-3  # host time per layer and forward, besides the projections
    launch_per_target_s: float = 0.378e-3  # ... plus each adapted projection's base + LoRA node
    launch_per_adapter_s: float = 3.38e-3  # per step: each adapter's batch, schedule and AdamW group
    forward_share: float = 0.35  # the forward's share of host launches and traffic (recomputed)


# Eager transformers + PEFT (one adapter, unfused ops, full fp32 logits): least-squares fitted to
# the seven H200 reference runs of :mod:`plora_hpo.planner.peft_h200` (r 16 on all seven projections, seq 512); they
# reproduce all seven peaks within 1% and step times within 10%.
PEFT_PRIOR = Prior(
    saved_per_hidden=15.7,
    saved_per_kv=0.0,
    saved_per_intermediate=5.5,
    loss_hidden_rows=0.0,
    adapter_compute_copy=False,
    matmul_efficiency=0.6,
    traffic_passes=14.0,
    chunk_logit_traffic_bytes=0.0,
    lora_efficiency=0.3,
    lora_input_passes=0.0,
    lora_output_passes=0.0,
    step_param_bytes=28.0,
    micro_param_bytes=0.0,
    optimizer_bandwidth_efficiency=1.0,
    gpu_fixed_per_layer_s=1.0e-3,
    launch_per_step_s=0.0,
    launch_per_layer_s=0.8e-3,
    launch_per_target_s=0.7e-3,
    launch_per_adapter_s=0.5e-3,
    forward_share=0.0,
)


@dataclass(frozen=True)
class StepTerms:
    """Prior seconds of one packed step, split by what calibration scales separately."""

    launch: float = 0.0  # host time to issue the step's forward/backward kernels
    fixed: float = 0.0  # GPU time that does not grow with tokens
    base: float = 0.0  # frozen base model: forward + input-gradient backward over the tokens
    lora: float = 0.0  # LoRA kernels and the per-forward adapter casts
    comm: float = 0.0  # tensor-parallel all-reduces: hidden states per block, replicated LoRA gradients
    optimizer: float = 0.0  # clip + AdamW + zeroing; overlaps the next step's launches

    def __add__(self, other: StepTerms) -> StepTerms:
        return StepTerms(*(getattr(self, f.name) + getattr(other, f.name) for f in fields(self)))


@dataclass(frozen=True)
class MemoryTerms:
    """Prior bytes on one GPU, split by what calibration scales separately."""

    fixed: float = 0.0  # base weights (this GPU's part), reserve, logits chunk
    activations: float = 0.0  # saved activations of base and LoRA
    adapters: float = 0.0  # adapter params + grads + AdamW states (+ saved low-precision copies)

    def __add__(self, other: MemoryTerms) -> MemoryTerms:
        return MemoryTerms(*(getattr(self, f.name) + getattr(other, f.name) for f in fields(self)))


class CostModel:
    """Peak memory per GPU and step time of a pack of adapters on ``degree`` GPUs.

    ``prior`` defaults to :class:`Prior` for the packed engine and :data:`PEFT_PRIOR` for
    ``Workload(engine="peft")``.
    """

    def __init__(
        self,
        workload: Workload,
        gpu: GpuSpec,
        calibration: Calibration | None = None,
        prior: Prior | None = None,
    ) -> None:
        self.workload = workload
        self.gpu = gpu
        self.calibration = calibration or Calibration()
        self.prior = prior or (PEFT_PRIOR if workload.engine == "peft" else Prior())
        self._weight_bytes: dict[int, float] = {}  # per degree: asked for every pack the planner weighs

    # ---- tensor-parallel split -----------------------------------------------------------
    def _local_dims(self, module: str, degree: int) -> tuple[float, float]:
        """(d_in, d_out) of one projection's part on each of ``degree`` GPUs (whole at degree 1)."""
        d_in, d_out = self.workload.shape.linear_dims(module)
        if degree == 1:
            return d_in, d_out
        return (d_in / degree, d_out) if module in ROW_PARALLEL else (d_in, d_out / degree)

    def weight_bytes(self, degree: int = 1) -> float:
        """Frozen base weights on each GPU: embeddings, norms and LM head whole, projections ÷ degree."""
        if degree not in self._weight_bytes:
            s = self.workload.shape
            linear = s.decoder_linear_params()
            self._weight_bytes[degree] = (s.total_params() - linear + linear / degree) * self.workload.dtype_bytes
        return self._weight_bytes[degree]

    def adapter_params(self, config: AdapterConfig, degree: int = 1) -> float:
        """Parameters of one adapter's factors on each GPU: A of a column-parallel projection and
        B of a row-parallel one whole, the other factor ÷ degree (S-LoRA's split)."""
        w = self.workload
        if degree == 1:
            return w.shape.lora_params(config.rank, w.targets)
        per_layer = sum(sum(self._local_dims(m, degree)) for m in w.targets)
        return config.rank * per_layer * w.shape.layers

    def replicated_adapter_params(self, config: AdapterConfig) -> int:
        """Parameters of one adapter's replicated factors (whole on every GPU of a tensor-parallel
        pack): their gradients are partial sums, all-reduced once per step."""
        w = self.workload
        per_layer = 0
        for module in w.targets:
            d_in, d_out = w.shape.linear_dims(module)
            per_layer += d_out if module in ROW_PARALLEL else d_in
        return config.rank * per_layer * w.shape.layers

    # ---- memory -------------------------------------------------------------------------
    def _logit_bytes_per_token(self) -> float:
        return self.prior.logits_bytes_per_vocab * self.workload.shape.vocab

    def _layer_act_elements_per_token(self, degree: int = 1) -> float:
        """Saved elements per token and decoder layer on each GPU (per-head and MLP parts ÷ degree)."""
        s, p = self.workload.shape, self.prior
        kv = s.kv_heads * s.head_dim
        total = p.saved_per_hidden * s.hidden + p.saved_per_kv * kv + p.saved_per_intermediate * s.intermediate
        if degree == 1:
            return total
        replicated = p.saved_replicated_per_hidden * s.hidden
        return replicated + (total - replicated) / degree

    def _copy_bytes_per_param(self) -> float:
        """Saved low-precision copy of the adapter factors (the kernels' A and B), per parameter."""
        w = self.workload
        if not self.prior.adapter_compute_copy or w.dtype_bytes >= 4:
            return 0.0
        return w.dtype_bytes / w.shape.layers if w.checkpointing else float(w.dtype_bytes)

    def base_memory_terms(self, degree: int, tokens_per_gpu: float | None = None) -> MemoryTerms:
        """Bytes per GPU that the pack needs whatever adapters it holds.

        The logits chunk holds ``min(logits_chunk_tokens, tokens_per_gpu)`` rows; ``None`` (the
        pack's tokens unknown) counts a full chunk. Every GPU of a tensor-parallel pack computes
        all of the pack's logits, so ``tokens_per_gpu`` is the pack's tokens in one forward.
        """
        w = self.workload
        fixed = self.prior.reserve_gib * GIB + self.weight_bytes(degree)
        if w.logits_chunk_tokens is not None:
            rows = w.logits_chunk_tokens if tokens_per_gpu is None else min(w.logits_chunk_tokens, tokens_per_gpu)
            fixed += rows * self.prior.chunk_logits_bytes_per_vocab * w.shape.vocab
        return MemoryTerms(fixed=fixed)

    def adapter_memory_terms(self, config: AdapterConfig, degree: int) -> MemoryTerms:
        """Bytes per GPU that one adapter adds: its rows' activations and its optimizer state.

        Without micro-batching exact; with it, an upper bound (every row's activations), which
        :meth:`memory_terms` scales down to the largest micro-batch. On a tensor-parallel pack
        every GPU keeps activations of all the adapter's rows (the per-head and MLP parts split).
        """
        w, s, p = self.workload, self.workload.shape, self.prior
        tokens = config.batch_size * w.seq_len
        layer_act = tokens * self._layer_act_elements_per_token(degree) * w.dtype_bytes
        lora_act = tokens * config.rank * len(w.targets) * w.dtype_bytes  # x·Aᵀ per target
        if w.checkpointing:  # keep layer inputs; one layer's activations live during recompute
            act = tokens * s.hidden * w.dtype_bytes * s.layers + layer_act + lora_act
        else:
            act = (layer_act + lora_act) * s.layers
        act += tokens * p.loss_hidden_rows * s.hidden * w.dtype_bytes
        if w.logits_chunk_tokens is None:
            act += tokens * self._logit_bytes_per_token()
        states = self.adapter_params(config, degree) * (p.adapter_state_bytes + self._copy_bytes_per_param())
        return MemoryTerms(activations=act, adapters=states)

    def memory_bytes(self, terms: MemoryTerms) -> float:
        """Calibrated bytes of prior memory terms."""
        c = self.calibration
        return (
            c.memory_fixed * terms.fixed + c.memory_activations * terms.activations + c.memory_adapters * terms.adapters
        )

    def micro_batch_tokens(self, configs: Sequence[AdapterConfig], degree: int = 1) -> float:
        """Tokens in the pack's largest forward (all of them without micro-batching), on each GPU:
        every GPU of a tensor-parallel pack runs all of them (``degree`` changes nothing)."""
        tokens = sum(self.tokens_per_step(c) for c in configs)
        rows = self.workload.rows_per_micro_batch
        return tokens if rows is None else min(tokens, rows * self.workload.seq_len)

    def micro_batches(self, configs: Sequence[AdapterConfig], degree: int = 1) -> int:
        """Forwards per step on each GPU (1 without micro-batching; the same at every degree)."""
        rows = self.workload.rows_per_micro_batch
        if rows is None:
            return 1
        return max(1, math.ceil(sum(c.batch_size for c in configs) / rows))

    def memory_terms(self, configs: Sequence[AdapterConfig], degree: int = 1) -> MemoryTerms:
        return self._pack_memory_terms(configs, [self.adapter_memory_terms(c, degree) for c in configs], degree)

    def _pack_memory_terms(
        self, configs: Sequence[AdapterConfig], adapters: Sequence[MemoryTerms], degree: int
    ) -> MemoryTerms:
        """:meth:`memory_terms` from the members' own terms (``adapters``, one per config)."""
        tokens = sum(self.tokens_per_step(c) for c in configs)
        live = self.micro_batch_tokens(configs, degree)
        base = self.base_memory_terms(degree, live)
        total = MemoryTerms(
            fixed=base.fixed + sum(t.fixed for t in adapters),
            activations=base.activations + sum(t.activations for t in adapters),
            adapters=base.adapters + sum(t.adapters for t in adapters),
        )
        if live < tokens:  # micro-batched: only the forward in flight keeps activations
            total = replace(total, activations=total.activations * live / tokens)
        return total

    def peak_memory(self, configs: Sequence[AdapterConfig], degree: int = 1) -> float:
        """Predicted peak bytes on each of the pack's ``degree`` GPUs."""
        return self.memory_bytes(self.memory_terms(configs, degree))

    # ---- time ---------------------------------------------------------------------------
    def _base_flops_per_token(self, degree: int = 1) -> float:
        """Frozen base: forward 2·P + input-gradient backward 2·P, LM head likewise, attention.

        Tensor parallelism divides the projections' and attention's FLOPs by the degree; every GPU
        runs the whole LM head."""
        w, s = self.workload, self.workload.shape
        linear = s.decoder_linear_params() / degree
        attention = 2 * w.seq_len * s.hidden * s.layers / degree  # causal QKᵀ and PV forward
        flops = 4 * linear + 4 * s.vocab * s.hidden + 3.5 * attention  # flash backward ≈ 2.5 forwards
        if w.checkpointing:
            flops += 2 * linear + attention
        return flops

    def _traffic_bytes_per_token(self, degree: int = 1) -> float:
        w, s, p = self.workload, self.workload.shape, self.prior
        saved = s.layers * self._layer_act_elements_per_token(degree) * w.dtype_bytes
        if w.checkpointing:
            saved *= 1 + p.forward_share
        if w.logits_chunk_tokens is None:
            return p.traffic_passes * (saved + self._logit_bytes_per_token())
        return p.traffic_passes * saved + p.chunk_logit_traffic_bytes * s.vocab

    def _lora_bytes_per_token(self, degree: int = 1) -> float:
        """LoRA kernels' activation bytes: inputs and outputs of the projection part each GPU holds."""
        w, s, p = self.workload, self.workload.shape, self.prior
        dims = [self._local_dims(m, degree) for m in w.targets]
        per_layer = sum(p.lora_input_passes * d_in + p.lora_output_passes * d_out for d_in, d_out in dims)
        extra = 1 + p.forward_share if w.checkpointing else 1.0
        return per_layer * s.layers * w.dtype_bytes * extra

    def _ring_seconds_per_byte(self, degree: int) -> float:
        """Seconds per byte of a ring all-reduce over ``degree`` GPUs: each sends 2(d-1)/d of it."""
        return 2 * (degree - 1) / degree / (self.gpu.link_gbs * 1e9)

    def comm_bytes(self, config: AdapterConfig, degree: int) -> float:
        """Bytes that one adapter adds to a tensor-parallel step's all-reduces (0 at degree 1).

        Per token and layer, the hidden states of the attention and MLP blocks' outputs in the
        forward and of their inputs' gradients in the backward (but the first block's: its input,
        the frozen embeddings, needs no gradient); under checkpointing the attention block's output
        again in the recomputed forward (which stops after the last tensor the backward needs,
        before the MLP block's all-reduce). Per step, the replicated factors' fp32 gradients.
        """
        if degree == 1:
            return 0.0
        w, s = self.workload, self.workload.shape
        blocks = (5 if w.checkpointing else 4) * s.layers - 1
        hidden_states = self.tokens_per_step(config) * blocks * s.hidden * w.dtype_bytes
        return hidden_states + 4 * self.replicated_adapter_params(config)

    def overhead_terms(self, degree: int, micro_batches: int = 1) -> StepTerms:
        """Per-step seconds of a pack with no adapters: launches and fixed kernels (the same on
        every GPU of a tensor-parallel pack; its communication grows with the adapters' tokens)."""
        w, s, p = self.workload, self.workload.shape, self.prior
        launch = s.layers * (p.launch_per_layer_s + p.launch_per_target_s * len(w.targets))
        fixed = s.layers * p.gpu_fixed_per_layer_s
        if w.checkpointing:  # the recomputed forward issues its kernels again
            launch *= 1 + p.forward_share
            fixed *= 1 + p.forward_share
        return StepTerms(launch=p.launch_per_step_s + micro_batches * launch, fixed=micro_batches * fixed)

    def adapter_terms(self, config: AdapterConfig, degree: int, micro_batches: int = 1) -> StepTerms:
        """Per-step seconds that one adapter adds: its rows through the base, its LoRA work, its
        optimizer update (``micro_batches``: forwards per step, which repeat the adapter casts)
        and, on ``degree`` > 1 GPUs, its share of the all-reduces."""
        w, p = self.workload, self.prior
        rate = self.gpu.matmul_tflops * 1e12
        bandwidth = self.gpu.bandwidth_tbs * 1e12
        tokens = config.batch_size * w.seq_len
        base = tokens * (
            self._base_flops_per_token(degree) / (rate * p.matmul_efficiency)
            + self._traffic_bytes_per_token(degree) / bandwidth
        )
        params = self.adapter_params(config, degree)
        lora_flops = (8 if w.checkpointing else 6) * tokens * params
        lora = (
            lora_flops / (rate * p.lora_efficiency)
            + tokens * self._lora_bytes_per_token(degree) / bandwidth
            + micro_batches * params * p.micro_param_bytes / bandwidth
        )
        optimizer = params * p.step_param_bytes / (bandwidth * p.optimizer_bandwidth_efficiency)
        comm = self.comm_bytes(config, degree) * self._ring_seconds_per_byte(degree)
        return StepTerms(launch=p.launch_per_adapter_s, base=base, lora=lora, comm=comm, optimizer=optimizer)

    def launch_seconds(self, terms: StepTerms) -> float:
        """Calibrated host seconds of a step."""
        c = self.calibration
        return c.launch * terms.launch

    def device_seconds(self, terms: StepTerms) -> float:
        """Calibrated GPU seconds of a step (communication included: the next kernel waits for it)."""
        c = self.calibration
        return (
            c.fixed * terms.fixed
            + c.base * terms.base
            + c.lora * terms.lora
            + c.optimizer * terms.optimizer
            + c.comm * terms.comm
        )

    def seconds(self, terms: StepTerms) -> float:
        """Calibrated seconds of a step: host and GPU overlap when launches are asynchronous (the
        optimizer update too: the next step's launches run while the GPU applies it)."""
        host, device = self.launch_seconds(terms), self.device_seconds(terms)
        return max(host, device) if self.gpu.async_launch else host + device

    def step_terms(self, configs: Sequence[AdapterConfig], degree: int = 1) -> StepTerms:
        n = self.micro_batches(configs, degree)
        total = self.overhead_terms(degree, n)
        for config in configs:
            total += self.adapter_terms(config, degree, n)
        return total

    def step_seconds(self, configs: Sequence[AdapterConfig], degree: int = 1) -> float:
        """Predicted seconds of one step with all of ``configs`` in the pack."""
        return self.seconds(self.step_terms(configs, degree))

    def pack_seconds(self, configs: Sequence[AdapterConfig], steps: Sequence[int], degree: int = 1) -> float:
        """Seconds until the last adapter finishes; each adapter leaves the pack after its steps."""
        order = sorted(range(len(configs)), key=lambda k: steps[k])
        total, done = 0.0, 0
        for pos, k in enumerate(order):
            alive = [configs[j] for j in order[pos:]]
            total += (steps[k] - done) * self.step_seconds(alive, degree)
            done = steps[k]
        return total

    def rotating_pack_seconds(
        self,
        configs: Sequence[AdapterConfig],
        steps: Sequence[int],
        *,
        memory_limit: float,
        max_members: int | None = None,
        degree: int = 1,
        turns: int = ROTATION_TURNS,
    ) -> float:
        """Seconds until the last member finishes when the members take turns in a pack kept full
        (a sweep's ``pack.rotate``): those with the most steps left train, as many as fit in
        ``memory_limit`` per GPU (and ``max_members``), while the others wait.

        Played in turns of ``1 / turns`` of the longest member's steps (shorter when a member is
        done first): each turn the members furthest behind are taken in that order, skipping any
        that would not fit beside those taken, and every step of the turn costs
        :meth:`step_seconds` of them. Without turns (all fit at once) it is :meth:`pack_seconds`.
        """
        own = [self.adapter_memory_terms(c, degree) for c in configs]

        def fits(members: list[int]) -> bool:
            terms = self._pack_memory_terms([configs[i] for i in members], [own[i] for i in members], degree)
            return self.memory_bytes(terms) <= memory_limit

        cap = max_members or len(configs)
        if len(configs) <= cap and fits(list(range(len(configs)))):
            return self.pack_seconds(configs, steps, degree)
        left = [int(n) for n in steps]
        turn = max(1, math.ceil(max(left) / turns))
        total = 0.0
        while behind := sorted((i for i, n in enumerate(left) if n > 0), key=lambda i: -left[i]):
            taken: list[int] = []
            for i in behind:
                if len(taken) == cap:
                    break
                if not taken or fits([*taken, i]):
                    taken.append(i)
            run = min(turn, *(left[i] for i in taken))
            total += run * self.step_seconds([configs[i] for i in taken], degree)
            for i in taken:
                left[i] -= run
        return total

    def tokens_per_step(self, config: AdapterConfig) -> int:
        return config.batch_size * self.workload.seq_len
