"""Choose the packed-LoRA implementation for a tensor's device."""

from __future__ import annotations

import os

import torch

from plora_hpo.kernels.layout import SegmentLayout
from plora_hpo.kernels.reference import packed_lora_reference


def _triton_wanted(x: torch.Tensor) -> bool:
    choice = os.environ.get("PLORA_KERNELS", "auto")
    if choice == "reference":
        return False
    if choice == "triton":
        return True
    return x.is_cuda


def packed_lora(x: torch.Tensor, a_cat: torch.Tensor, b_cat: torch.Tensor, layout: SegmentLayout) -> torch.Tensor:
    """Packed LoRA delta (see :func:`packed_lora_reference`): Triton on CUDA, PyTorch elsewhere.

    ``PLORA_KERNELS=reference|triton|auto`` overrides the choice (``triton`` on CPU needs
    ``TRITON_INTERPRET=1``).
    """
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
            return base_out + packed_lora_reference(x, a_cat, b_cat, layout)

        return packed_lora_add_triton(base_out, x, a_cat, b_cat, layout)
    return base_out + packed_lora(x, a_cat, b_cat, layout)
