"""Pure-PyTorch packed LoRA: the CPU path and the oracle the Triton kernels are tested against."""

from __future__ import annotations

import torch

from plora_hpo.kernels.layout import SegmentLayout


def packed_lora_reference(
    x: torch.Tensor, a_cat: torch.Tensor, b_cat: torch.Tensor, layout: SegmentLayout
) -> torch.Tensor:
    """Return ``delta`` with ``delta[t] = s_k * B_k A_k x[t]`` for tokens t of adapter k, else 0.

    Args:
        x: ``(N, d_in)`` flattened tokens of the packed batch.
        a_cat: ``(sum_r, d_in)`` the adapters' A matrices stacked along rank.
        b_cat: ``(d_out, sum_r)`` the adapters' B matrices stacked along rank.
        layout: token segments, rank columns and scalings of the K adapters.

    Computed in ``a_cat``'s dtype (adapters keep fp32 master weights, as PEFT does) and
    returned in ``x``'s dtype. Autograd flows to ``x``, ``a_cat`` and ``b_cat``.
    """
    n, d_out = x.shape[0], b_cat.shape[0]
    compute_dtype = a_cat.dtype
    starts, ends = layout.token_offsets[0], layout.token_offsets[-1]
    # split (not slicing) so that backward concatenates gradients instead of summing K
    # zero-padded copies of x's gradient
    x_parts = x.split([starts, *layout.segment_lengths(), n - ends])
    a_parts = a_cat.split(layout.ranks())
    b_parts = b_cat.split(layout.ranks(), dim=1)
    pieces = [x_parts[0].new_zeros(starts, d_out, dtype=compute_dtype)]
    for k in range(layout.num_adapters):
        xs = x_parts[k + 1].to(compute_dtype)
        pieces.append((xs @ a_parts[k].t()) @ b_parts[k].t() * layout.scalings[k])
    pieces.append(x_parts[-1].new_zeros(n - ends, d_out, dtype=compute_dtype))
    return torch.cat(pieces).to(x.dtype)


def add_packed_lora_(
    out: torch.Tensor, x: torch.Tensor, a_cat: torch.Tensor, b_cat: torch.Tensor, layout: SegmentLayout
) -> torch.Tensor:
    """Add ``s_k * B_k A_k x[t]`` to ``out[t]`` in place for tokens t of adapter k; returns ``out``.

    The CPU path's form of :func:`packed_lora_reference`: the scaling multiplies the rank-wide
    intermediate, and each segment's expand accumulates straight into its rows of ``out`` (one
    GEMM with beta 1), so no full-width delta is written, scaled, concatenated and added.
    ``out`` must be a tensor autograd may modify in place (a fresh result, not a leaf).
    """
    compute_dtype = a_cat.dtype
    n, starts, ends = x.shape[0], layout.token_offsets[0], layout.token_offsets[-1]
    x_parts = x.split([starts, *layout.segment_lengths(), n - ends])  # see packed_lora_reference
    a_parts = a_cat.split(layout.ranks())
    b_parts = b_cat.split(layout.ranks(), dim=1)
    for k, length in enumerate(layout.segment_lengths()):
        if length == 0:
            continue
        h = (x_parts[k + 1].to(compute_dtype) @ a_parts[k].t()) * layout.scalings[k]
        rows = out.narrow(0, layout.token_offsets[k], length)
        if out.dtype == compute_dtype:
            rows.addmm_(h, b_parts[k].t())
        else:
            rows.add_((h @ b_parts[k].t()).to(out.dtype))
    return out


def adapted_linear_reference(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    a_cat: torch.Tensor,
    b_cat: torch.Tensor,
    layout: SegmentLayout,
) -> torch.Tensor:
    """``x·Wᵀ (+ bias) + packed_lora_reference(x, a_cat, b_cat, layout)`` for 2-D x, in x's dtype.

    The oracle of :func:`plora_hpo.kernels._adapted_linear.adapted_linear_triton` and the CPU
    path: the adapters' products accumulate into the base output (:func:`add_packed_lora_`);
    autograd adds the two gradients of x here, which is what the Triton path avoids.
    """
    return add_packed_lora_(torch.nn.functional.linear(x, weight, bias), x, a_cat, b_cat, layout)
