"""Analytic cost model of a pack: peak memory per GPU and seconds per packed step.

Why: the planner must know, before anything runs, whether a set of adapters fits on ``d`` GPUs
and how fast the pack trains. The model is analytic (FLOPs ÷ matmul rate, bytes ÷ bandwidth,
bytes of saved activations) with constants fitted once to the H200 reference runs of
DESIGN.md §6, and scaled per (model, GPU) by a :class:`~plora_hpo.planner.calibration.Calibration`
fitted from the first iterations of real packs.

Every quantity splits into a part shared by the pack (``overhead_terms``, ``base_memory_terms``)
plus one part per adapter (``adapter_terms``, ``adapter_memory_terms``). That additivity is what
lets the ILP stay linear in the selection.

Multi-GPU packs (degree ``d > 1``) are modelled as fully sharded data parallel: weights, adapter
states and the pack's rows are split over the ``d`` GPUs, and every step all-gathers the base
weights (forward and backward) and all-reduces the LoRA gradients over the GPU links.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, fields

from plora_hpo.adapter import AdapterConfig
from plora_hpo.errors import ConfigError, PloraError
from plora_hpo.planner.calibration import Calibration
from plora_hpo.shapes import TARGET_MODULES, ModelShape

GIB = 2**30


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


@dataclass(frozen=True)
class Workload:
    """What every pack of a sweep shares: base model shape, sequence length, targets, dtype.

    Attributes:
        shape: decoder dimensions of the frozen base model.
        seq_len: tokens per training sequence (sequences are padded/truncated to it).
        targets: projections that carry adapters.
        dtype_bytes: bytes per element of base weights and activations (2 for bf16).
        checkpointing: activation checkpointing per decoder layer (recompute in backward).
        logits_chunk_tokens: the loss is computed over this many tokens at a time, so only one
            chunk of full-vocabulary logits is alive (the engine's default chunk is 4096);
            ``None`` means all logits at once (PEFT).
    """

    shape: ModelShape
    seq_len: int
    targets: tuple[str, ...] = TARGET_MODULES
    dtype_bytes: int = 2
    checkpointing: bool = False
    logits_chunk_tokens: int | None = 4096

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


@dataclass(frozen=True)
class Prior:
    """Constants of the analytic prior.

    The activation and time constants were least-squares fitted to the seven H200 reference runs
    of DESIGN.md §6 (eager PEFT, r 16 on all seven projections, seq 512); they reproduce all seven
    peaks within 1% and step times within 10%. The launch split between layers and targets and
    the LoRA/optimizer constants are assumptions that calibration corrects.
    """

    act_per_hidden: float = 15.7  # saved activation elements per token per layer, per hidden unit
    act_per_intermediate: float = 5.5  # ... per MLP intermediate unit
    logits_bytes_per_vocab: float = 14.0  # all logits kept (PEFT): bf16 + fp32 copy + log-softmax + grad
    chunk_logits_bytes_per_vocab: float = 6.0  # one chunk (engine/loss.py): bf16 logits + fp32 copy
    reserve_gib: float = 0.1  # allocator workspace that does not grow with anything
    adapter_state_bytes: float = 16.0  # fp32 param + grad + AdamW exp_avg + exp_avg_sq
    matmul_efficiency: float = 0.6  # of the measured peak, on base-model matmuls
    traffic_passes: float = 14.0  # times each saved activation byte crosses HBM per step
    lora_efficiency: float = 0.3  # of the peak, on skinny LoRA matmuls
    optimizer_bytes_per_param: float = 28.0  # AdamW reads 4 fp32 tensors and writes 3
    gpu_fixed_per_layer_s: float = 1.0e-3  # per-step GPU time independent of tokens
    launch_per_layer_s: float = 0.8e-3  # host time to issue one layer's base kernels
    launch_per_target_s: float = 0.7e-3  # ... plus each adapted projection's LoRA kernels
    launch_per_adapter_s: float = 0.5e-3  # ... plus each adapter's loss and optimizer launches


@dataclass(frozen=True)
class StepTerms:
    """Prior seconds of one packed step, split by what calibration scales separately."""

    launch: float = 0.0  # host time to issue the step's kernels
    fixed: float = 0.0  # GPU time that does not grow with tokens
    base: float = 0.0  # frozen base model: forward + input-gradient backward over the tokens
    lora: float = 0.0  # LoRA matmuls and the AdamW update
    comm: float = 0.0  # weight all-gather and LoRA gradient all-reduce (degree > 1)

    def __add__(self, other: StepTerms) -> StepTerms:
        return StepTerms(*(getattr(self, f.name) + getattr(other, f.name) for f in fields(self)))


@dataclass(frozen=True)
class MemoryTerms:
    """Prior bytes on one GPU, split by what calibration scales separately."""

    fixed: float = 0.0  # base weights, reserve, logits chunk
    activations: float = 0.0  # saved activations of base and LoRA
    adapters: float = 0.0  # adapter params + grads + AdamW states

    def __add__(self, other: MemoryTerms) -> MemoryTerms:
        return MemoryTerms(*(getattr(self, f.name) + getattr(other, f.name) for f in fields(self)))


class CostModel:
    """Peak memory per GPU and step time of a pack of adapters on ``degree`` GPUs."""

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
        self.prior = prior or Prior()

    # ---- memory -------------------------------------------------------------------------
    def _weight_bytes(self) -> float:
        return self.workload.shape.total_params() * self.workload.dtype_bytes

    def _logit_bytes_per_token(self) -> float:
        return self.prior.logits_bytes_per_vocab * self.workload.shape.vocab

    def _layer_act_elements_per_token(self) -> float:
        s = self.workload.shape
        return self.prior.act_per_hidden * s.hidden + self.prior.act_per_intermediate * s.intermediate

    def base_memory_terms(self, degree: int, tokens_per_gpu: float | None = None) -> MemoryTerms:
        """Bytes per GPU that the pack needs whatever adapters it holds.

        The logits chunk holds ``min(logits_chunk_tokens, tokens_per_gpu)`` rows; ``None`` (the
        pack's tokens unknown) counts a full chunk.
        """
        w, s = self.workload, self.workload.shape
        fixed = self.prior.reserve_gib * GIB + self._weight_bytes() / degree
        if degree > 1:  # one layer gathered in use plus one prefetched
            fixed += 2 * s.decoder_linear_params() / s.layers * w.dtype_bytes
        if w.logits_chunk_tokens is not None:
            rows = w.logits_chunk_tokens if tokens_per_gpu is None else min(w.logits_chunk_tokens, tokens_per_gpu)
            fixed += rows * self.prior.chunk_logits_bytes_per_vocab * w.shape.vocab
        return MemoryTerms(fixed=fixed)

    def adapter_memory_terms(self, config: AdapterConfig, degree: int) -> MemoryTerms:
        """Bytes per GPU that one adapter adds: its rows' activations and its optimizer state."""
        w, s = self.workload, self.workload.shape
        tokens = config.batch_size * w.seq_len
        layer_act = tokens * self._layer_act_elements_per_token() * w.dtype_bytes
        lora_act = tokens * config.rank * len(w.targets) * w.dtype_bytes  # x·Aᵀ per target
        if w.checkpointing:  # keep layer inputs; one layer's activations live during recompute
            act = tokens * s.hidden * w.dtype_bytes * s.layers + layer_act + lora_act
        else:
            act = (layer_act + lora_act) * s.layers
        if w.logits_chunk_tokens is None:
            act += tokens * self._logit_bytes_per_token()
        states = s.lora_params(config.rank, w.targets) * self.prior.adapter_state_bytes
        return MemoryTerms(activations=act / degree, adapters=states / degree)

    def memory_bytes(self, terms: MemoryTerms) -> float:
        """Calibrated bytes of prior memory terms."""
        c = self.calibration
        return (
            c.memory_fixed * terms.fixed + c.memory_activations * terms.activations + c.memory_adapters * terms.adapters
        )

    def memory_terms(self, configs: Sequence[AdapterConfig], degree: int = 1) -> MemoryTerms:
        tokens = sum(self.tokens_per_step(c) for c in configs)
        total = self.base_memory_terms(degree, tokens / degree)
        for config in configs:
            total += self.adapter_memory_terms(config, degree)
        return total

    def peak_memory(self, configs: Sequence[AdapterConfig], degree: int = 1) -> float:
        """Predicted peak bytes on each of the pack's ``degree`` GPUs."""
        return self.memory_bytes(self.memory_terms(configs, degree))

    # ---- time ---------------------------------------------------------------------------
    def _base_flops_per_token(self) -> float:
        """Frozen base: forward 2·P + input-gradient backward 2·P, LM head likewise, attention."""
        w, s = self.workload, self.workload.shape
        linear = s.decoder_linear_params()
        attention = 2 * w.seq_len * s.hidden * s.layers  # causal QKᵀ and PV forward
        flops = 4 * linear + 4 * s.vocab * s.hidden + 3.5 * attention  # flash backward ≈ 2.5 forwards
        if w.checkpointing:
            flops += 2 * linear + attention
        return flops

    def _traffic_bytes_per_token(self) -> float:
        w, s = self.workload, self.workload.shape
        saved = s.layers * self._layer_act_elements_per_token() * w.dtype_bytes + self._logit_bytes_per_token()
        return self.prior.traffic_passes * saved

    def _comm_fraction(self, degree: int) -> float:
        return (degree - 1) / degree / (self.gpu.link_gbs * 1e9)

    def overhead_terms(self, degree: int) -> StepTerms:
        """Per-step seconds of a pack with no adapters: launches, fixed kernels, weight gathers."""
        s, p = self.workload.shape, self.prior
        launch = s.layers * (p.launch_per_layer_s + p.launch_per_target_s * len(self.workload.targets))
        comm = 2 * self._weight_bytes() * self._comm_fraction(degree)
        return StepTerms(launch=launch, fixed=s.layers * p.gpu_fixed_per_layer_s, comm=comm)

    def adapter_terms(self, config: AdapterConfig, degree: int) -> StepTerms:
        """Per-step seconds that one adapter adds: its rows through the base, its LoRA work."""
        w, p = self.workload, self.prior
        rate = self.gpu.matmul_tflops * 1e12
        bandwidth = self.gpu.bandwidth_tbs * 1e12
        tokens = config.batch_size * w.seq_len
        base = tokens * (
            self._base_flops_per_token() / (rate * p.matmul_efficiency) + self._traffic_bytes_per_token() / bandwidth
        )
        params = w.shape.lora_params(config.rank, w.targets)
        lora = 6 * tokens * params / (rate * p.lora_efficiency) + params * p.optimizer_bytes_per_param / bandwidth
        comm = 2 * 4 * params * self._comm_fraction(degree)  # fp32 gradient all-reduce
        return StepTerms(launch=p.launch_per_adapter_s, base=base / degree, lora=lora / degree, comm=comm)

    def launch_seconds(self, terms: StepTerms) -> float:
        """Calibrated host seconds of a step."""
        return self.calibration.launch * terms.launch

    def device_seconds(self, terms: StepTerms) -> float:
        """Calibrated GPU seconds of a step."""
        c = self.calibration
        return c.fixed * terms.fixed + c.base * terms.base + c.lora * terms.lora + terms.comm

    def seconds(self, terms: StepTerms) -> float:
        """Calibrated seconds of a step: host and GPU overlap when launches are asynchronous."""
        host, device = self.launch_seconds(terms), self.device_seconds(terms)
        return max(host, device) if self.gpu.async_launch else host + device

    def step_terms(self, configs: Sequence[AdapterConfig], degree: int = 1) -> StepTerms:
        total = self.overhead_terms(degree)
        for config in configs:
            total += self.adapter_terms(config, degree)
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

    def tokens_per_step(self, config: AdapterConfig) -> int:
        return config.batch_size * self.workload.seq_len
