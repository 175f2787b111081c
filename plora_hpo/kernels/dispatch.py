"""Choose the packed-LoRA implementation for a tensor's device.

Three entry points, each Triton on CUDA and the pure-PyTorch reference elsewhere (CPU, or when
Triton is missing); ``PLORA_KERNELS=reference|triton|auto`` overrides the choice (``triton`` on
CPU needs ``TRITON_INTERPRET=1``):

* :func:`packed_lora`: the delta alone.
* :func:`packed_lora_add`: ``base_out + delta`` for a base output computed elsewhere.
* :func:`adapted_linear`: the frozen base layer and its adapters together, ``x·Wᵀ (+ bias) +
  delta``. Preferred for an adapted ``nn.Linear``: its backward produces ``dx = dy·W + the
  adapters' dx`` in one buffer (the kernel adds into the base matmul's output) instead of two
  gradients of x that autograd must then add, and its forward adds the delta into the base
  output in place.
"""

from __future__ import annotations

import os

import torch

from plora_hpo.kernels._grads_into import grads_into as grads_into_buffers
from plora_hpo.kernels.layout import SegmentLayout
from plora_hpo.kernels.torch_lora import adapted_linear_reference, add_packed_lora_, packed_lora_reference


def _triton_wanted(x: torch.Tensor) -> bool:
    choice = os.environ.get("PLORA_KERNELS", "auto")
    if choice == "reference":
        return False
    if choice == "triton":
        return True
    return x.is_cuda


def packed_lora(x: torch.Tensor, a_cat: torch.Tensor, b_cat: torch.Tensor, layout: SegmentLayout) -> torch.Tensor:
    """Packed LoRA delta (see :func:`packed_lora_reference`)."""
    if _triton_wanted(x):
        try:
            from plora_hpo.kernels.triton_lora import packed_lora_triton
        except ImportError:  # Triton kernels not built yet or triton missing
            return packed_lora_reference(x, a_cat, b_cat, layout)

        return packed_lora_triton(x, a_cat, b_cat, layout)
    return packed_lora_reference(x, a_cat, b_cat, layout)


def packed_lora_add(
    base_out: torch.Tensor,
    x: torch.Tensor,
    a_cat: torch.Tensor,
    b_cat: torch.Tensor,
    layout: SegmentLayout,
) -> torch.Tensor:
    """``base_out + packed_lora(x, ...)``; the Triton path fuses the add into its expand kernel."""
    if _triton_wanted(x):
        try:
            from plora_hpo.kernels.triton_lora import packed_lora_add_triton
        except ImportError:  # Triton kernels not built yet or triton missing
            return add_packed_lora_(base_out.clone(), x, a_cat, b_cat, layout)

        return packed_lora_add_triton(base_out, x, a_cat, b_cat, layout)
    return add_packed_lora_(base_out.clone(), x, a_cat, b_cat, layout)


def adapted_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    a_cat: torch.Tensor,
    b_cat: torch.Tensor,
    layout: SegmentLayout,
    grads_into: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """``x·Wᵀ (+ bias) + delta``: a frozen linear layer plus K packed LoRA adapters.

    Args:
        x: ``(..., d_in)`` activations; the layout indexes its flattened rows.
        weight: ``(d_out, d_in)`` frozen base weight (must not require grad), x's dtype.
        bias: ``(d_out,)`` frozen bias or None.
        a_cat, b_cat, layout: as for :func:`packed_lora_reference`.
        grads_into: fp32 tensors shaped like ``a_cat`` and ``b_cat`` (any strides) that dA and
            dB are added into, instead of reaching ``a_cat``/``b_cat`` as gradients.

    Returns ``(..., d_out)`` in x's dtype. Gradients flow to x, ``a_cat`` and ``b_cat`` only; on
    the Triton path dx is ``dy·W`` with the adapters' part added in place (no extra add), and
    ``grads_into`` is written by the weight-gradient kernel itself.
    """
    if weight.requires_grad or (bias is not None and bias.requires_grad):
        raise ValueError("adapted_linear keeps the base layer frozen: weight and bias must not require grad")
    x2 = x.reshape(-1, x.shape[-1])
    y = None
    if _triton_wanted(x):
        try:
            from plora_hpo.kernels._adapted_linear import adapted_linear_triton
        except ImportError:  # Triton kernels not built yet or triton missing
            pass
        else:
            y = adapted_linear_triton(x2, weight, bias, a_cat, b_cat, layout, grads_into)
    if y is None:
        if grads_into is not None:
            a_cat, b_cat = grads_into_buffers(a_cat, b_cat, grads_into)
        y = adapted_linear_reference(x2, weight, bias, a_cat, b_cat, layout)
    return y.view(*x.shape[:-1], weight.shape[0])
