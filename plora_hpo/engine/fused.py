"""Faster pieces of the frozen base model, swapped in per module instance (reversibly).

Eager Hugging Face decoders spend a large share of a training step outside the matrix products:
RMSNorm upcasts to fp32 and runs ~7 kernels forward and more backward, and the SwiGLU MLP runs
``silu`` and ``*`` separately and saves three intermediate tensors. On the GPU this module
replaces

* each ``*RMSNorm`` forward by ``torch.nn.functional.rms_norm`` (one fused kernel each way on
  CUDA in recent PyTorch; it saves only the input and the per-row rstd);
* each SwiGLU MLP's ``act(gate) * up`` by one Triton kernel forward and one backward that saves
  only ``gate`` and ``up``;
* each attention module's rotary embedding of q and k by one Triton kernel each way
  (:mod:`plora_hpo.engine.rotary`);

and lets attention run over sequences concatenated back to back in one row (the trainer's
micro-batches): the variable-length flash kernel on the GPU, batched SDPA per run of equal-length
sequences elsewhere (:func:`varlen_attention`).

All replacements compute the same function as the originals up to rounding (one bf16 rounding
instead of two); :func:`unfuse_elementwise` restores the originals.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from plora_hpo.engine.rotary import fuse_rotary

try:  # Triton is optional (CPU installs); the fused MLP falls back to eager without it
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised on machines without triton
    triton = None

_SILU_BLOCK = 2048


# --- SwiGLU ------------------------------------------------------------------------------------
if triton is not None:

    @triton.jit
    def _silu_mul_fwd_kernel(g_ptr, u_ptr, o_ptr, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(u_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        out = g * tl.sigmoid(g) * u
        tl.store(o_ptr + offs, out.to(o_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _silu_mul_bwd_kernel(g_ptr, u_ptr, do_ptr, dg_ptr, du_ptr, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(u_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        do = tl.load(do_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        sig = tl.sigmoid(g)
        silu = g * sig
        tl.store(du_ptr + offs, (do * silu).to(du_ptr.dtype.element_ty), mask=mask)
        dg = do * u * sig * (1.0 + g * (1.0 - sig))
        tl.store(dg_ptr + offs, dg.to(dg_ptr.dtype.element_ty), mask=mask)


class _SiluMul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        gate, up = gate.contiguous(), up.contiguous()
        out = torch.empty_like(gate)
        n = gate.numel()
        _silu_mul_fwd_kernel[(triton.cdiv(n, _SILU_BLOCK),)](gate, up, out, n, BLOCK=_SILU_BLOCK, num_warps=8)
        ctx.save_for_backward(gate, up)
        return out

    @staticmethod
    def backward(ctx, d_out: torch.Tensor):  # type: ignore[override]
        gate, up = ctx.saved_tensors
        d_out = d_out.contiguous()
        d_gate, d_up = torch.empty_like(gate), torch.empty_like(up)
        n = gate.numel()
        _silu_mul_bwd_kernel[(triton.cdiv(n, _SILU_BLOCK),)](
            gate, up, d_out, d_gate, d_up, n, BLOCK=_SILU_BLOCK, num_warps=8
        )
        return d_gate, d_up


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up``: one Triton kernel each way on CUDA, eager PyTorch elsewhere."""
    if triton is not None and gate.is_cuda and gate.shape == up.shape and gate.dtype == up.dtype:
        return _SiluMul.apply(gate, up)
    return F.silu(gate) * up


# --- module patches ------------------------------------------------------------------------------
def _rms_norm_forward(module: nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    weight = module.weight
    if weight.dtype != hidden_states.dtype:
        return type(module).forward(module, hidden_states)
    return F.rms_norm(hidden_states, weight.shape, weight, module.variance_epsilon)


def _swiglu_forward(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return module.down_proj(silu_mul(module.gate_proj(x), module.up_proj(x)))


def _is_rms_norm(module: nn.Module) -> bool:
    return (
        type(module).__name__.endswith("RMSNorm")
        and isinstance(getattr(module, "weight", None), torch.Tensor)
        and isinstance(getattr(module, "variance_epsilon", None), float)
    )


def _is_swiglu(module: nn.Module) -> bool:
    act = getattr(module, "act_fn", None)
    return (
        all(hasattr(module, name) for name in ("gate_proj", "up_proj", "down_proj"))
        and (isinstance(act, nn.SiLU) or type(act).__name__ == "SiLUActivation")
        and type(module).forward.__qualname__.endswith("MLP.forward")
    )


def fuse_elementwise(model: nn.Module) -> int:
    """Swap in the fused RMSNorm, SwiGLU and rotary-embedding forwards; returns how many modules
    were patched."""
    patched = 0
    for module in model.modules():
        if "forward" in module.__dict__:
            continue  # already patched (or patched by someone else): leave it
        if _is_rms_norm(module):
            module.forward = _rms_norm_forward.__get__(module)
            module._plora_fused = True
            patched += 1
        elif _is_swiglu(module):
            module.forward = _swiglu_forward.__get__(module)
            module._plora_fused = True
            patched += 1
        elif fuse_rotary(module):
            module._plora_fused = True
            patched += 1
    return patched


def unfuse_elementwise(model: nn.Module) -> None:
    """Restore the original forwards replaced by :func:`fuse_elementwise`."""
    for module in model.modules():
        if module.__dict__.get("_plora_fused"):
            del module.forward
            del module._plora_fused


# --- attention over a row of concatenated sequences ------------------------------------------------
CU_SEQLENS_KWARG = "plora_cu_seqlens"
MAX_SEQLEN_KWARG = "plora_max_seqlen"
SEQ_RUNS_KWARG = "plora_seq_runs"


def _varlen_reference(q, k, v, runs, scale):  # (T, H, D) each; causal SDPA per run of equal-length sequences
    outs = []
    start = 0
    for count, length in runs:
        stop = start + count * length
        qs, ks, vs = (t[start:stop].view(count, length, *t.shape[1:]).transpose(1, 2) for t in (q, k, v))
        out = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale, enable_gqa=True)
        outs.append(out.transpose(1, 2).reshape(stop - start, *q.shape[1:]))
        start = stop
    return torch.cat(outs)


def _flash_varlen(q: torch.Tensor) -> bool:
    """Whether the CUDA flash kernel's variable-length mode takes these inputs (fp16/bf16, sm80+)."""
    return (
        q.is_cuda
        and q.dtype in (torch.float16, torch.bfloat16)
        and torch.cuda.get_device_capability(q.device)[0] >= 8
        and q.shape[-1] <= 256
    )


def varlen_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    scale: float,
    runs: Sequence[tuple[int, int]] | None = None,
) -> torch.Tensor:
    """Causal attention within each sequence of a row of concatenated sequences: ``(T, H, D)`` in and out.

    CUDA (fp16/bf16): the flash kernel's variable-length mode (GQA native, differentiable through
    aten's registered backward). Elsewhere: one SDPA call per run of ``runs`` (``(count, length)``:
    ``count`` consecutive sequences of ``length`` tokens, attended as a batch), or per sequence
    of ``cu_seqlens`` without them.

    A sequence's result depends on its own run alone, so the trainer, which gives every adapter
    runs of its own, computes an adapter's attention the same whoever shares the row.
    """
    if _flash_varlen(q):
        q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
        out = torch.ops.aten._flash_attention_forward(
            q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, 0.0, True, False, scale=scale
        )[0]
        return out
    if runs is None:
        runs = [(1, b - a) for a, b in itertools.pairwise(cu_seqlens.tolist())]
    return _varlen_reference(q, k, v, runs, scale)


def _attention_with_varlen(original):
    def attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
        cu_seqlens = kwargs.pop(CU_SEQLENS_KWARG, None)
        max_seqlen = kwargs.pop(MAX_SEQLEN_KWARG, None)
        runs = kwargs.pop(SEQ_RUNS_KWARG, None)
        if cu_seqlens is None:
            return original(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
        if query.shape[0] != 1:
            raise ValueError(f"attention over concatenated sequences wants one row, got batch {query.shape[0]}")
        window = kwargs.get("sliding_window")
        if window is not None and int(max_seqlen) > window:  # attention here is plain causal, no window
            raise ValueError(f"a sequence of {int(max_seqlen)} tokens exceeds the model's sliding window of {window}")
        scale = scaling if scaling is not None else query.shape[-1] ** -0.5
        q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # (T, H, D)
        out = varlen_attention(q, k, v, cu_seqlens, int(max_seqlen), scale, runs)
        return out.unsqueeze(0), None

    attention._plora_varlen = True  # type: ignore[attr-defined]
    return attention


def install_varlen_attention() -> None:
    """Let the ``sdpa`` attention of Hugging Face models accept rows of concatenated sequences.

    Idempotent. The wrapped function behaves exactly like the original unless a forward passes
    ``plora_cu_seqlens`` / ``plora_max_seqlen`` (and optionally ``plora_seq_runs``) keyword
    arguments (the trainer's micro-batches), so every other caller is unaffected.
    """
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    current = ALL_ATTENTION_FUNCTIONS["sdpa"]
    if getattr(current, "_plora_varlen", False):
        return
    ALL_ATTENTION_FUNCTIONS["sdpa"] = _attention_with_varlen(current)
