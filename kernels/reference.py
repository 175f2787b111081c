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
    pieces: list[torch.Tensor] = []
    cursor = 0
    for k in range(layout.num_adapters):
        t0, t1 = layout.token_offsets[k], layout.token_offsets[k + 1]
        r0, r1 = layout.rank_offsets[k], layout.rank_offsets[k + 1]
        if t1 == t0:
            continue
        if t0 > cursor:
            pieces.append(x.new_zeros(t0 - cursor, d_out, dtype=compute_dtype))
        xs = x[t0:t1].to(compute_dtype)
        pieces.append((xs @ a_cat[r0:r1].t()) @ b_cat[:, r0:r1].t() * layout.scalings[k])
        cursor = t1
    if cursor < n:
        pieces.append(x.new_zeros(n - cursor, d_out, dtype=compute_dtype))
    return torch.cat(pieces).to(x.dtype) if pieces else x.new_zeros(n, d_out)
