"""Rotary position embedding of queries and keys in one Triton kernel each way.

Hugging Face's ``apply_rotary_pos_emb`` runs about ten bf16 kernels forward per layer (a
``cat`` for each ``rotate_half``, negations, four products, two sums) and more backward, each
a full pass over q or k. The kernel here reads q, k, cos and sin once and writes both outputs,
in fp32 arithmetic with one rounding at the end.

It is swapped in per attention module, reversibly (:func:`fuse_rotary`): the module's forward
runs with a context flag set, and the modeling module's ``apply_rotary_pos_emb`` is replaced,
once, by a dispatcher that takes the kernel only while that flag is set, on CUDA, for inputs of
the standard layout, and only after the kernel reproduced that modeling module's own function
on a probe input. Everything else calls the original unchanged.
"""

from __future__ import annotations

import inspect
import os
import sys
from collections.abc import Callable
from contextvars import ContextVar

import torch
from torch import nn

from plora_hpo.kernels._interpret import patch_interpreter

try:  # Triton is optional (CPU installs): without it nothing is swapped
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised on machines without triton
    triton = None

patch_interpreter()

_NAME = "apply_rotary_pos_emb"
_active: ContextVar[bool] = ContextVar("plora_fused_rotary", default=False)
_probed: dict[Callable, bool] = {}  # original function -> the kernel reproduced it

if triton is not None:

    @triton.jit
    def _rotate_heads(
        x_ptr, o_ptr, b, s, n_heads, sx_b, sx_h, sx_s, sx_d, so_b, so_h, so_s, so_d, c1, c2, s1, s2,
        HALF: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_H: tl.constexpr,
    ):  # fmt: skip
        d = tl.arange(0, BLOCK_D)
        for h0 in range(0, n_heads, BLOCK_H):
            h = h0 + tl.arange(0, BLOCK_H)
            mask = (h[:, None] < n_heads) & (d[None, :] < HALF)
            x = x_ptr + b.to(tl.int64) * sx_b + s.to(tl.int64) * sx_s + h[:, None] * sx_h + d[None, :] * sx_d
            o = o_ptr + b.to(tl.int64) * so_b + s.to(tl.int64) * so_s + h[:, None] * so_h + d[None, :] * so_d
            x1 = tl.load(x, mask=mask, other=0.0).to(tl.float32)
            x2 = tl.load(x + HALF * sx_d, mask=mask, other=0.0).to(tl.float32)
            tl.store(o, (x1 * c1 - x2 * s1).to(o_ptr.dtype.element_ty), mask=mask)
            tl.store(o + HALF * so_d, (x2 * c2 + x1 * s2).to(o_ptr.dtype.element_ty), mask=mask)

    @triton.jit(do_not_specialize=["seq_len"])  # it follows the batch: one compiled variant for every length
    def _rotary_kernel(
        q_ptr, k_ptr, cos_ptr, sin_ptr, qo_ptr, ko_ptr, seq_len, n_q, n_k,
        sq_b, sq_h, sq_s, sq_d, sk_b, sk_h, sk_s, sk_d,
        sqo_b, sqo_h, sqo_s, sqo_d, sko_b, sko_h, sko_s, sko_d, sc_b, sc_s, sc_d,
        HALF: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_H: tl.constexpr, BACKWARD: tl.constexpr,
    ):  # fmt: skip
        """One (batch, position) per program: ``o = x·cos + rotate_half(x)·sin`` on every head of
        q and k; backward applies the transpose (sin halves swapped and negated)."""
        pid = tl.program_id(0)
        b = pid // seq_len
        s = pid % seq_len
        d = tl.arange(0, BLOCK_D)
        d_ok = d < HALF
        c = cos_ptr + b.to(tl.int64) * sc_b + s.to(tl.int64) * sc_s + d * sc_d
        n = sin_ptr + b.to(tl.int64) * sc_b + s.to(tl.int64) * sc_s + d * sc_d
        c1 = tl.load(c, mask=d_ok, other=0.0).to(tl.float32)[None, :]
        c2 = tl.load(c + HALF * sc_d, mask=d_ok, other=0.0).to(tl.float32)[None, :]
        s1 = tl.load(n, mask=d_ok, other=0.0).to(tl.float32)[None, :]
        s2 = tl.load(n + HALF * sc_d, mask=d_ok, other=0.0).to(tl.float32)[None, :]
        if BACKWARD:
            s1, s2 = -s2, -s1
        _rotate_heads(q_ptr, qo_ptr, b, s, n_q, sq_b, sq_h, sq_s, sq_d, sqo_b, sqo_h, sqo_s, sqo_d,
                      c1, c2, s1, s2, HALF, BLOCK_D, BLOCK_H)  # fmt: skip
        _rotate_heads(k_ptr, ko_ptr, b, s, n_k, sk_b, sk_h, sk_s, sk_d, sko_b, sko_h, sko_s, sko_d,
                      c1, c2, s1, s2, HALF, BLOCK_D, BLOCK_H)  # fmt: skip


def _launch(q, k, cos, sin, q_out, k_out, backward: bool) -> None:
    if sin.stride() != cos.stride():
        cos, sin = cos.contiguous(), sin.contiguous()
    batch, n_q, seq_len, dim = q.shape
    n_k = k.shape[1]
    cos_strides = (0 if cos.shape[0] == 1 else cos.stride(0), cos.stride(1), cos.stride(2))
    _rotary_kernel[(batch * seq_len,)](
        q, k, cos, sin, q_out, k_out, seq_len, n_q, n_k,
        *q.stride(), *k.stride(), *q_out.stride(), *k_out.stride(), *cos_strides,
        HALF=dim // 2, BLOCK_D=triton.next_power_of_2(dim // 2),
        BLOCK_H=min(16, triton.next_power_of_2(max(n_q, n_k))), BACKWARD=backward, num_warps=4,
    )  # fmt: skip


class _Rotary(torch.autograd.Function):
    """(q, k) ``(B, H, S, D)`` any strides, cos/sin ``(B or 1, S, D)``: outputs laid out like q and k."""

    @staticmethod
    def forward(ctx, q, k, cos, sin):  # type: ignore[override]
        q_out, k_out = torch.empty_like(q), torch.empty_like(k)
        _launch(q, k, cos, sin, q_out, k_out, backward=False)
        ctx.save_for_backward(cos, sin)
        return q_out, k_out

    @staticmethod
    def backward(ctx, dq, dk):  # type: ignore[override]
        cos, sin = ctx.saved_tensors
        dq_in, dk_in = torch.empty_like(dq), torch.empty_like(dk)
        _launch(dq, dk, cos, sin, dq_in, dk_in, backward=True)
        return dq_in, dk_in, None, None


def rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q·cos + rotate_half(q)·sin, k·cos + rotate_half(k)·sin)`` with cos/sin broadcast over heads."""
    return _Rotary.apply(q, k, cos, sin)


def on_device(q: torch.Tensor) -> bool:
    """Where the kernel runs: CUDA (the CPU path stays Hugging Face's own, bit for bit), unless
    ``PLORA_FUSED_ROTARY=0`` (what the throughput benchmark's ablation row sets)."""
    return q.is_cuda and os.environ.get("PLORA_FUSED_ROTARY", "1") != "0"


def _standard(q, k, cos, sin) -> bool:
    """The layout the kernel handles: 4-D q and k of one batch, length and even head size, and
    3-D cos/sin without gradients (computed from positions, as every rotary embedding does)."""
    return (
        q.dim() == 4
        and k.dim() == 4
        and cos.dim() == 3
        and cos.shape == sin.shape
        and q.shape[0] == k.shape[0]
        and cos.shape[0] in (1, q.shape[0])
        and q.shape[2] == k.shape[2] == cos.shape[1]
        and q.shape[3] == k.shape[3] == cos.shape[2]
        and q.shape[3] % 2 == 0
        and q.dtype == k.dtype
        and not (cos.requires_grad or sin.requires_grad)
    )


def _reproduces(original: Callable, device: torch.device) -> bool:
    """Whether the kernel computes ``original`` (fp32, random angles, strided q as attention has it)."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 3, 5, 16, generator=g).transpose(1, 2).to(device)  # (B, H, S, D), strided
    k = torch.randn(2, 3, 2, 16, generator=g).transpose(1, 2).to(device)
    cos, sin = (torch.randn(2, 3, 16, generator=g).to(device) for _ in range(2))
    with torch.no_grad():
        try:
            want = original(q, k, cos, sin)
        except Exception:  # not the (q, k, cos, sin) function the kernel stands for
            return False
        got = rotary(q, k, cos, sin)
    return all(torch.allclose(a, b, atol=1e-5, rtol=1e-5) for a, b in zip(got, want))


def _dispatcher(original: Callable) -> Callable:
    def apply_rotary_pos_emb(q, k, cos, sin, *args, **kwargs):
        if not (_active.get() and not args and kwargs.get("unsqueeze_dim", 1) == 1 and on_device(q)):
            return original(q, k, cos, sin, *args, **kwargs)
        if not _standard(q, k, cos, sin):
            return original(q, k, cos, sin, *args, **kwargs)
        ok = _probed.get(original)
        if ok is None:
            ok = _probed[original] = _reproduces(original, q.device)
        return rotary(q, k, cos, sin) if ok else original(q, k, cos, sin, *args, **kwargs)

    apply_rotary_pos_emb._plora_original = original  # type: ignore[attr-defined]
    return apply_rotary_pos_emb


def _attention_forward(module: nn.Module, *args, **kwargs):
    token = _active.set(True)
    try:
        return type(module).forward(module, *args, **kwargs)
    finally:
        _active.reset(token)


def fuse_rotary(module: nn.Module) -> bool:
    """Let this attention module's rotary embedding take the kernel (module doc); False when its
    forward does not call its modeling module's ``apply_rotary_pos_emb`` or Triton is missing."""
    code = getattr(inspect.unwrap(type(module).forward), "__code__", None)  # under decorators
    if triton is None or code is None or _NAME not in code.co_names:
        return False
    modeling = sys.modules.get(type(module).__module__)
    current = getattr(modeling, _NAME, None)
    if not callable(current):
        return False
    if not hasattr(current, "_plora_original"):
        setattr(modeling, _NAME, _dispatcher(current))
    module.forward = _attention_forward.__get__(module)
    return True
