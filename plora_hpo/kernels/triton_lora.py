"""Autograd entry points of the Triton packed-LoRA kernels.

The engine calls :func:`packed_lora_add_triton` (through ``dispatch.packed_lora_add``) or
:mod:`~plora_hpo.kernels._adapted_linear` (base layer included) on every adapted linear layer: a
shrink and an expand launch in the forward; in the backward an outer launch for dB, a shrink for
``g = s·dy·B`` and one outer launch that writes dA and dx together, or adds dx into a given
buffer (``lora_backward(dx_into=...)``); per rank tile when the rank-branching kernels cannot
be built. Semantics match
:func:`plora_hpo.kernels.torch_lora.packed_lora_reference`; the dot products run in the
activations' dtype (bf16 on the GPU) with fp32 accumulation, whatever the weights' dtype, and
every gradient comes back in its input's dtype.

Two doors to the same implementation:

* the torch custom ops ``plora_hpo::packed_lora`` and ``plora_hpo::packed_lora_backward``
  (``torch.library.custom_op`` with ``register_autograd`` and fake kernels), which
  ``torch.compile`` sees as single nodes of its graph, forward and backward;
* in eager mode, a plain ``torch.autograd.Function`` over the same two functions. The custom
  op's Python dispatch and autograd wrapper add host time to every call (``kernels-h200.json``:
  ``ours_op_ms`` against ``ours_ms``, e.g. 1.15 against 0.45 ms for 7b.q_o mixed at K=32), and a
  packed step calls this on every adapted projection of every layer, where host time is what
  small packs are bound by.

:func:`packed_lora_triton` and :func:`packed_lora_add_triton` take the op under
``torch.compile`` (or with ``PLORA_KERNELS_OP=1``) and the Function otherwise.
"""

from __future__ import annotations

import os
from collections import OrderedDict

import torch

from plora_hpo.kernels import _tuning
from plora_hpo.kernels._interpret import patch_interpreter
from plora_hpo.kernels._launch import empty, expand, shrink, weight_grad
from plora_hpo.kernels._plan import plan_for
from plora_hpo.kernels.layout import SegmentLayout

patch_interpreter()


def lora_forward(
    x: torch.Tensor,
    a_cat: torch.Tensor,
    b_cat: torch.Tensor,
    base: torch.Tensor | None,
    layout: SegmentLayout,
    tuning: _tuning.Tuning,
    in_place: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(``base + delta`` or ``delta``, rank buffer ``h = s·x·Aᵀ``) for the backward.

    ``in_place`` adds the delta into ``base`` itself and returns it (a buffer the caller owns,
    e.g. the base layer's fresh output), saving a full-size allocation and the copy of the rows
    without adapters.
    """
    plan = plan_for(layout, tuning.block_m, x.device)
    h = shrink(x, a_cat, a_cat.stride(1), a_cat.stride(0), plan, tuning)
    if in_place and base is not None:
        out = base
    else:
        dtype = x.dtype if base is None else base.dtype
        out = empty((x.shape[0], b_cat.shape[0]), dtype, x.device, tuning)
    expand(h, b_cat, b_cat.stride(1), b_cat.stride(0), out, base, plan, tuning)
    return out, h


def lora_backward(
    dy: torch.Tensor,
    x: torch.Tensor,
    a_cat: torch.Tensor,
    b_cat: torch.Tensor,
    h: torch.Tensor,
    layout: SegmentLayout,
    tuning: _tuning.Tuning,
    need_x: bool,
    need_a: bool,
    need_b: bool,
    dx_into: torch.Tensor | None = None,
    grads_into: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """dx, dA, dB (None where not needed), the four backward cases (dB, d(xAᵀ), dA, dx).

    With ``dx_into`` (shaped like x, e.g. the base layer's ``dy·W``) the adapters' dx is added
    into it on adapter rows, other rows untouched, and it is returned as dx: no separate dx
    buffer and no elementwise add of two full-size gradients. With ``grads_into`` (fp32 tensors
    shaped like A_cat and B_cat, e.g. views of the trainer's gradient buffer) dA and dB are added
    into those instead and come back as None.
    """
    plan = plan_for(layout, tuning.block_m, x.device)
    dx = da = db = None
    a_into, b_into = grads_into if grads_into is not None else (None, None)
    if need_b:
        db = weight_grad(dy, h, b_cat, 1, plan, tuning, into=b_into)  # case 1: dB_k = dyᵀ · h_k
    if need_x or need_a:
        g = shrink(dy, b_cat, b_cat.stride(0), b_cat.stride(1), plan, tuning)  # case 2: s·dy·B_k
        accumulate = dx_into is not None
        if need_x:
            dx = dx_into if accumulate else empty(tuple(x.shape), x.dtype, x.device, tuning)
        if need_a and need_x and tuning.fuse_dx:  # cases 3 and 4 in one pass over x and g
            da = weight_grad(x, g, a_cat, 0, plan, tuning, dx=(a_cat, dx), accumulate=accumulate, into=a_into)
        else:
            if need_a:
                da = weight_grad(x, g, a_cat, 0, plan, tuning, into=a_into)  # case 3: dA_k = gᵀ · x
            if need_x:  # case 4: dx (+)= g · A_k
                expand(g, a_cat, a_cat.stride(0), a_cat.stride(1), dx, dx if accumulate else None, plan, tuning)
    if grads_into is not None:
        da = db = None
    return dx, da, db


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
        out, h = lora_forward(x, a_cat, b_cat, base, layout, tuning)
        ctx.save_for_backward(x, a_cat, b_cat, h)
        ctx.layout, ctx.tuning, ctx.has_base = layout, tuning, base is not None
        return out

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, dy: torch.Tensor):  # type: ignore[override]
        x, a_cat, b_cat, h = ctx.saved_tensors
        need_x, need_a, need_b, need_base = ctx.needs_input_grad[:4]
        dx, da, db = lora_backward(dy, x, a_cat, b_cat, h, ctx.layout, ctx.tuning, need_x, need_a, need_b)
        return dx, da, db, (dy if ctx.has_base and need_base else None), None


# ---- the custom ops (what torch.compile sees) ----

_LAYOUTS: OrderedDict[tuple, SegmentLayout] = OrderedDict()
_LAYOUTS_KEPT = 256


def layout_of(token_offsets: list[int], rank_offsets: list[int], scalings: list[float]) -> SegmentLayout:
    """The layout of the op's plain arguments, one object per distinct layout (so its kernel plan
    is built once and reused, as in eager mode)."""
    key = (tuple(token_offsets), tuple(rank_offsets), tuple(scalings))
    layout = _LAYOUTS.get(key)
    if layout is None:
        layout = _LAYOUTS[key] = SegmentLayout(*key)
        if len(_LAYOUTS) > _LAYOUTS_KEPT:
            _LAYOUTS.popitem(last=False)
    return layout


@torch.library.custom_op("plora_hpo::packed_lora", mutates_args=())
def _op_forward(
    x: torch.Tensor,
    a_cat: torch.Tensor,
    b_cat: torch.Tensor,
    base: torch.Tensor | None,
    token_offsets: list[int],
    rank_offsets: list[int],
    scalings: list[float],
) -> tuple[torch.Tensor, torch.Tensor]:
    """(``base + delta`` or ``delta``, rank buffer ``h``); see :func:`lora_forward`."""
    layout = layout_of(token_offsets, rank_offsets, scalings)
    return lora_forward(x, a_cat, b_cat, base, layout, _tuning.current())


def h_like(x: torch.Tensor, token_offsets: list[int], rank_offsets: list[int]) -> torch.Tensor:
    """An empty tensor shaped like the rank buffer ``h`` (the fake kernels' second output)."""
    h_numel = sum(
        (t1 - t0) * (r1 - r0)
        for t0, t1, r0, r1 in zip(token_offsets, token_offsets[1:], rank_offsets, rank_offsets[1:])
    )
    return x.new_empty((max(h_numel, 1),))


@_op_forward.register_fake
def _op_forward_fake(x, a_cat, b_cat, base, token_offsets, rank_offsets, scalings):
    dtype = x.dtype if base is None else base.dtype
    return x.new_empty((x.shape[0], b_cat.shape[0]), dtype=dtype), h_like(x, token_offsets, rank_offsets)


@torch.library.custom_op("plora_hpo::packed_lora_backward", mutates_args=())
def _op_backward(
    dy: torch.Tensor,
    x: torch.Tensor,
    a_cat: torch.Tensor,
    b_cat: torch.Tensor,
    h: torch.Tensor,
    token_offsets: list[int],
    rank_offsets: list[int],
    scalings: list[float],
    need_x: bool,
    need_a: bool,
    need_b: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dx, dA, dB; an empty tensor stands for a gradient not asked for."""
    layout = layout_of(token_offsets, rank_offsets, scalings)
    grads = lora_backward(dy, x, a_cat, b_cat, h, layout, _tuning.current(), need_x, need_a, need_b)
    return tuple(x.new_empty(0) if g is None else g for g in grads)  # type: ignore[return-value]


@_op_backward.register_fake
def _op_backward_fake(dy, x, a_cat, b_cat, h, token_offsets, rank_offsets, scalings, need_x, need_a, need_b):
    return tuple(
        torch.empty_like(t) if need else x.new_empty(0) for t, need in ((x, need_x), (a_cat, need_a), (b_cat, need_b))
    )


def _op_setup_context(ctx, inputs, output) -> None:
    x, a_cat, b_cat, base, token_offsets, rank_offsets, scalings = inputs
    ctx.save_for_backward(x, a_cat, b_cat, output[1])
    ctx.offsets = (token_offsets, rank_offsets, scalings)
    ctx.has_base = base is not None
    ctx.mark_non_differentiable(output[1])


def _op_autograd_backward(ctx, dy: torch.Tensor, _dh: torch.Tensor | None):
    x, a_cat, b_cat, h = ctx.saved_tensors
    need_x, need_a, need_b = ctx.needs_input_grad[:3]
    need_base = ctx.has_base and ctx.needs_input_grad[3]
    dx, da, db = _op_backward(dy, x, a_cat, b_cat, h, *ctx.offsets, need_x, need_a, need_b)
    return (
        dx if need_x else None,
        da if need_a else None,
        db if need_b else None,
        dy if need_base else None,
        None,
        None,
        None,
    )


_op_forward.register_autograd(_op_autograd_backward, setup_context=_op_setup_context)


def packed_lora_op(
    x: torch.Tensor,
    a_cat: torch.Tensor,
    b_cat: torch.Tensor,
    base: torch.Tensor | None,
    layout: SegmentLayout,
) -> torch.Tensor:
    """``base + delta`` (or ``delta``) through the custom op, whatever the mode."""
    return torch.ops.plora_hpo.packed_lora(
        x, a_cat, b_cat, base, list(layout.token_offsets), list(layout.rank_offsets), list(layout.scalings)
    )[0]


def use_op() -> bool:
    """Take the custom op (under ``torch.compile``, or ``PLORA_KERNELS_OP=1``), not the Function."""
    return torch.compiler.is_compiling() or os.environ.get("PLORA_KERNELS_OP") == "1"


def _apply(
    x: torch.Tensor, a_cat: torch.Tensor, b_cat: torch.Tensor, base: torch.Tensor | None, layout: SegmentLayout
) -> torch.Tensor:
    if use_op():
        return packed_lora_op(x, a_cat, b_cat, base, layout)
    return _PackedLoRA.apply(x, a_cat, b_cat, base, layout)


def check_shapes(x: torch.Tensor, a_cat: torch.Tensor, b_cat: torch.Tensor, layout: SegmentLayout) -> None:
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
    check_shapes(x, a_cat, b_cat, layout)
    return _apply(x, a_cat, b_cat, None, layout)


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
    check_shapes(x, a_cat, b_cat, layout)
    if base_out.shape != (x.shape[0], b_cat.shape[0]):
        raise ValueError(f"base_out {tuple(base_out.shape)} != ({x.shape[0]}, {b_cat.shape[0]})")
    return _apply(x, a_cat, b_cat, base_out, layout)
