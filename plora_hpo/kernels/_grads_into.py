"""Route the adapters' weight gradients into buffers the caller owns, on any path.

The trainer keeps one fp32 gradient buffer for all adapters of a pack; the compute copies the
layers read (bf16 on the GPU) are autograd leaves whose own gradients it does not want. The
Triton backward adds dA/dB straight into views of that buffer; the reference and custom-op
paths get the same effect from :func:`grads_into`, an identity whose backward adds the
gradients into the buffers and passes none on to the leaves.
"""

from __future__ import annotations

import torch


class _GradsInto(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a, b, a_into, b_into):  # type: ignore[override]
        ctx.into = (a_into, b_into)
        return a.view_as(a), b.view_as(b)

    @staticmethod
    def backward(ctx, da, db):  # type: ignore[override]
        for buffer, grad in zip(ctx.into, (da, db)):
            if grad is not None:
                buffer.add_(grad)
        return None, None, None, None


def grads_into(
    a_cat: torch.Tensor, b_cat: torch.Tensor, buffers: tuple[torch.Tensor, torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(a_cat, b_cat)`` whose gradients are added into ``buffers`` (shaped alike) instead."""
    return _GradsInto.apply(a_cat, b_cat, *buffers)
