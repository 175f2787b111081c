"""Autograd entry points of the Triton packed-LoRA kernels.

The engine calls :func:`packed_lora_add_triton` (through ``dispatch.packed_lora_add``) on every
adapted linear layer: one shrink and one expand launch per rank bucket in the forward, two
shrink-like, two outer-product and one expand launch per bucket in the backward. Semantics
match :func:`plora_hpo.kernels.reference.packed_lora_reference`; the dot products run in the
activations' dtype (bf16 on the GPU) with fp32 accumulation, whatever the weights' dtype, and
every gradient comes back in its input's dtype.
"""

from __future__ import annotations

import torch

from plora_hpo.kernels import _tuning
from plora_hpo.kernels._interpret import patch_interpreter
from plora_hpo.kernels._launch import empty, expand, shrink, weight_grad
from plora_hpo.kernels._plan import plan_for
from plora_hpo.kernels.layout import SegmentLayout

patch_interpreter()


class _PackedLoRA(torch.autograd.Function):
    """``out = base + delta`` (or ``delta``) with ``delta[t] = s_k B_k A_k x[t]`` on adapter rows.

    Saves x, A, B and the rank buffer ``h = s·x·Aᵀ`` (Σ_k n_k·r_k values in x's dtype),
    nothing of size tokens × hidden beyond x, which the base layer saves anyway.
    """

    @staticmethod
    def forward(
        ctx: torch.autograd.function.FunctionCtx,
        x: torch.Tensor,
        a_cat: torch.Tensor,
        b_cat: torch.Tensor,
        base: torch.Tensor | None,
        layout: SegmentLayout,
    ) -> torch.Tensor:
        tuning = _tuning.current()
        plan = plan_for(layout, tuning.block_m, x.device)
        h = shrink(x, a_cat, a_cat.stride(1), a_cat.stride(0), plan, tuning)
        dtype = x.dtype if base is None else base.dtype
        out = empty((x.shape[0], b_cat.shape[0]), dtype, x.device, tuning)
        expand(h, b_cat, b_cat.stride(1), b_cat.stride(0), out, base, plan, tuning)
        ctx.save_for_backward(x, a_cat, b_cat, h)
        ctx.layout, ctx.tuning, ctx.has_base = layout, tuning, base is not None
        return out

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, dy: torch.Tensor):  # type: ignore[override]
        x, a_cat, b_cat, h = ctx.saved_tensors
        tuning = ctx.tuning
        plan = plan_for(ctx.layout, tuning.block_m, x.device)
        need_x, need_a, need_b = ctx.needs_input_grad[:3]
        dx = da = db = None
        if need_b:
            db = weight_grad(dy, h, b_cat, 1, plan, tuning)  # case 1: dB_k = dyᵀ · h_k
        if need_x or need_a:
            g = shrink(dy, b_cat, b_cat.stride(0), b_cat.stride(1), plan, tuning)  # case 2: s·dy·B_k
            if need_a:
                da = weight_grad(x, g, a_cat, 0, plan, tuning)  # case 3: dA_k = gᵀ · x
            if need_x:  # case 4: dx = g · A_k
                dx = empty(tuple(x.shape), x.dtype, x.device, tuning)
                expand(g, a_cat, a_cat.stride(0), a_cat.stride(1), dx, None, plan, tuning)
        dbase = dy if ctx.has_base and ctx.needs_input_grad[3] else None
        return dx, da, db, dbase, None


def _check(x: torch.Tensor, a_cat: torch.Tensor, b_cat: torch.Tensor, layout: SegmentLayout) -> None:
    if x.dim() != 2 or a_cat.dim() != 2 or b_cat.dim() != 2:
        raise ValueError(f"packed LoRA wants 2-D x, a_cat, b_cat; got {x.shape}, {a_cat.shape}, {b_cat.shape}")
    if a_cat.shape != (layout.total_rank, x.shape[1]) or b_cat.shape[1] != layout.total_rank:
        raise ValueError(
            f"shapes x {tuple(x.shape)}, a_cat {tuple(a_cat.shape)}, b_cat {tuple(b_cat.shape)} "
            f"do not fit total rank {layout.total_rank}"
        )
    if layout.token_offsets[-1] > x.shape[0]:
        raise ValueError(f"layout covers {layout.token_offsets[-1]} rows but x has {x.shape[0]}")


def packed_lora_triton(
    x: torch.Tensor, a_cat: torch.Tensor, b_cat: torch.Tensor, layout: SegmentLayout
) -> torch.Tensor:
    """Packed LoRA delta ``(N, d_out)`` in x's dtype; see :func:`packed_lora_reference`."""
    _check(x, a_cat, b_cat, layout)
    return _PackedLoRA.apply(x, a_cat, b_cat, None, layout)


def packed_lora_add_triton(
    base_out: torch.Tensor,
    x: torch.Tensor,
    a_cat: torch.Tensor,
    b_cat: torch.Tensor,
    layout: SegmentLayout,
) -> torch.Tensor:
    """``base_out + delta`` in one pass over the output (the add is fused into the expand).

    Returns a new tensor in ``base_out``'s dtype; ``base_out``'s gradient is the output's.
    """
    _check(x, a_cat, b_cat, layout)
    if base_out.shape != (x.shape[0], b_cat.shape[0]):
        raise ValueError(f"base_out {tuple(base_out.shape)} != ({x.shape[0]}, {b_cat.shape[0]})")
    return _PackedLoRA.apply(x, a_cat, b_cat, base_out, layout)
