"""A frozen linear layer and its packed LoRA adapters as one autograd node (Triton kernels).

``y = x·Wᵀ (+ bias) + delta`` with ``delta`` the packed LoRA delta of
:func:`~plora_hpo.kernels.torch_lora.packed_lora_reference`. Written as the base layer followed by
:func:`~plora_hpo.kernels.triton_lora.packed_lora_add_triton`, autograd would keep two
gradients of x (the base layer's ``dy·W`` and the adapters') and add them in a third full-size
pass; here the backward writes ``dx = dy·W`` with one matmul and the adapters' kernel adds
their ``g·A_k`` into that same buffer on their rows. The forward likewise adds the delta into
the base matmul's fresh output instead of allocating another. W and bias are frozen: they get
no gradient (passing ones that require it is an error).

Doors, as for :mod:`plora_hpo.kernels.triton_lora`: an ``autograd.Function`` in eager mode and
the custom ops ``plora_hpo::adapted_linear`` / ``plora_hpo::adapted_linear_backward`` under
``torch.compile`` (or with ``PLORA_KERNELS_OP=1``).
"""

from __future__ import annotations

import torch

from plora_hpo.kernels import _tuning
from plora_hpo.kernels._grads_into import grads_into as grads_into_buffers
from plora_hpo.kernels.layout import SegmentLayout
from plora_hpo.kernels.triton_lora import check_shapes, h_like, layout_of, lora_backward, lora_forward, use_op


def _base(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.mm(x, weight.t()) if bias is None else torch.addmm(bias, x, weight.t())


def _forward(x, weight, bias, a_cat, b_cat, layout, tuning) -> tuple[torch.Tensor, torch.Tensor]:
    """(y, rank buffer h): the delta is added into the base matmul's own output."""
    return lora_forward(x, a_cat, b_cat, _base(x, weight, bias), layout, tuning, in_place=True)


def _backward(dy, x, weight, a_cat, b_cat, h, layout, tuning, need_x, need_a, need_b, grads_into=None):
    """dx = dy·W with the adapters' part added in place, dA, dB (None where not needed, or
    where they were added into ``grads_into``)."""
    dx_base = torch.mm(dy, weight) if need_x else None
    return lora_backward(
        dy, x, a_cat, b_cat, h, layout, tuning, need_x, need_a, need_b, dx_into=dx_base, grads_into=grads_into
    )


class _AdaptedLinear(torch.autograd.Function):
    """Saves x, W, A, B and the rank buffer h; nothing else of size tokens × hidden."""

    @staticmethod
    def forward(ctx, x, weight, bias, a_cat, b_cat, layout, grads_into):  # type: ignore[override]
        tuning = _tuning.current()
        y, h = _forward(x, weight, bias, a_cat, b_cat, layout, tuning)
        ctx.save_for_backward(x, weight, a_cat, b_cat, h)
        ctx.layout, ctx.tuning, ctx.grads_into = layout, tuning, grads_into
        return y

    @staticmethod
    def backward(ctx, dy: torch.Tensor):  # type: ignore[override]
        x, weight, a_cat, b_cat, h = ctx.saved_tensors
        need_x, _, _, need_a, need_b = ctx.needs_input_grad[:5]
        dx, da, db = _backward(
            dy, x, weight, a_cat, b_cat, h, ctx.layout, ctx.tuning, need_x, need_a, need_b, ctx.grads_into
        )
        return dx, None, None, da, db, None, None


# ---- the custom ops (what torch.compile sees) ----


@torch.library.custom_op("plora_hpo::adapted_linear", mutates_args=())
def _op_forward(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    a_cat: torch.Tensor,
    b_cat: torch.Tensor,
    token_offsets: list[int],
    rank_offsets: list[int],
    scalings: list[float],
) -> tuple[torch.Tensor, torch.Tensor]:
    """(y, rank buffer h); see :func:`_forward`."""
    layout = layout_of(token_offsets, rank_offsets, scalings)
    return _forward(x, weight, bias, a_cat, b_cat, layout, _tuning.current())


@_op_forward.register_fake
def _op_forward_fake(x, weight, bias, a_cat, b_cat, token_offsets, rank_offsets, scalings):
    return x.new_empty((x.shape[0], weight.shape[0])), h_like(x, token_offsets, rank_offsets)


@torch.library.custom_op("plora_hpo::adapted_linear_backward", mutates_args=())
def _op_backward(
    dy: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor,
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
    grads = _backward(dy, x, weight, a_cat, b_cat, h, layout, _tuning.current(), need_x, need_a, need_b)
    return tuple(x.new_empty(0) if g is None else g for g in grads)  # type: ignore[return-value]


@_op_backward.register_fake
def _op_backward_fake(dy, x, weight, a_cat, b_cat, h, token_offsets, rank_offsets, scalings, need_x, need_a, need_b):
    return tuple(
        torch.empty_like(t) if need else x.new_empty(0) for t, need in ((x, need_x), (a_cat, need_a), (b_cat, need_b))
    )


def _op_setup_context(ctx, inputs, output) -> None:
    x, weight, _bias, a_cat, b_cat, token_offsets, rank_offsets, scalings = inputs
    ctx.save_for_backward(x, weight, a_cat, b_cat, output[1])
    ctx.offsets = (token_offsets, rank_offsets, scalings)
    ctx.mark_non_differentiable(output[1])


def _op_autograd_backward(ctx, dy: torch.Tensor, _dh: torch.Tensor | None):
    x, weight, a_cat, b_cat, h = ctx.saved_tensors
    need_x, _, _, need_a, need_b = ctx.needs_input_grad[:5]
    dx, da, db = _op_backward(dy, x, weight, a_cat, b_cat, h, *ctx.offsets, need_x, need_a, need_b)
    return (dx if need_x else None, None, None, da if need_a else None, db if need_b else None, None, None, None)


_op_forward.register_autograd(_op_autograd_backward, setup_context=_op_setup_context)


def adapted_linear_triton(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    a_cat: torch.Tensor,
    b_cat: torch.Tensor,
    layout: SegmentLayout,
    grads_into: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """``x·Wᵀ (+ bias) + delta`` for 2-D x ``(N, d_in)``, in x's dtype; gradients to x, A, B,
    or for A and B added into ``grads_into`` (see :func:`plora_hpo.kernels.dispatch.adapted_linear`)."""
    check_shapes(x, a_cat, b_cat, layout)
    if weight.shape != (b_cat.shape[0], x.shape[1]) or (bias is not None and bias.shape != (weight.shape[0],)):
        bias_shape = None if bias is None else tuple(bias.shape)
        raise ValueError(
            f"weight {tuple(weight.shape)} / bias {bias_shape} do not fit x {tuple(x.shape)} and b_cat "
            f"{tuple(b_cat.shape)}: want ({b_cat.shape[0]}, {x.shape[1]}) / ({b_cat.shape[0]},)"
        )
    if grads_into is not None:
        for into, like in zip(grads_into, (a_cat, b_cat)):
            if into.shape != like.shape or into.dtype != torch.float32:
                raise ValueError(f"gradient buffer {tuple(into.shape)} {into.dtype}: want {tuple(like.shape)} float32")
    if use_op():
        if grads_into is not None:
            a_cat, b_cat = grads_into_buffers(a_cat, b_cat, grads_into)
        offsets = (list(layout.token_offsets), list(layout.rank_offsets), list(layout.scalings))
        return torch.ops.plora_hpo.adapted_linear(x, weight, bias, a_cat, b_cat, *offsets)[0]
    return _AdaptedLinear.apply(x, weight, bias, a_cat, b_cat, layout, grads_into)
