"""Packed LoRA of a large evaluation forward as cuBLAS GEMMs per adapter segment.

For prefill-sized forwards the LoRA pass is bound by reading and writing the layer output ``y``
(tokens × d_out) once more. cuBLAS' in-place ``addmm`` does that on views of the prebuilt factors
(no copies) and needs no per-layout kernel builds: the segment kernels' compile-time constants
depend on which rank tiles a launch holds, so generation's prefill chunks, each with another mix
of adapters, kept compiling new variants (with the fused forwards of ``fast_paths``, the H200
benchmark's prefill went from 16.2 s to 4.3 s: ``prefill_seconds`` in ``eval-h200.json`` before
and after). At scoring sizes a profile (not kept) had these GEMMs a little faster than the
segment kernels without the fused forwards and level with them with those. Per adapter segment k
with tokens: ``h = x_k·A_kᵀ``, ``y_k += s_k·h·B_kᵀ``.

When every adapter owns the same number of tokens ``T`` (scoring: each adapter gets the same
inputs, so adapter k owns tokens ``[k·T, (k+1)·T)``), neighbours of one rank and one scaling
pose equal problems and each such *run* is two batched GEMMs (``bmm``, ``baddbmm_``); the
scoring route orders adapters by (rank, scaling), so a sweep's few ranks give a few runs.

Same function as the segment kernels (each adapter's own rank columns, fp32 accumulation, one
rounding of ``y``); only ``s`` moves from ``h`` into the second product's epilogue, which is exact
for power-of-two scalings and within bf16 rounding otherwise. Meant for the GPU; the CPU keeps
the segment path, bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from plora_hpo.kernels import SegmentLayout

MAX_GROUPS = 16  # most GEMM pairs per layer call; beyond it the launches cost more than they save


@dataclass(frozen=True)
class Run:
    """Adapters ``first .. first + count - 1`` of the route: one rank, one scaling."""

    first: int
    count: int
    rank: int
    rank_offset: int
    scaling: float


def rank_runs(layout: SegmentLayout) -> tuple[Run, ...]:
    """The layout's adapters (rank > 0) as maximal runs of equal (rank, scaling), in route order."""
    runs: list[Run] = []
    for k, (rank, scaling) in enumerate(zip(layout.ranks(), layout.scalings)):
        last = runs[-1] if runs else None
        if last is not None and (last.rank, last.scaling, last.first + last.count) == (rank, scaling, k):
            runs[-1] = Run(last.first, last.count + 1, rank, last.rank_offset, scaling)
        elif rank:
            runs.append(Run(k, 1, rank, layout.rank_offsets[k], scaling))
    return tuple(runs)


def uniform_span(layout: SegmentLayout, tokens: int) -> int:
    """``T`` when adapter k owns exactly tokens ``[k·T, (k+1)·T)`` and they are all ``tokens``; else 0."""
    offsets = layout.token_offsets
    k = layout.num_adapters
    if k == 0 or offsets[0] != 0 or offsets[-1] != tokens or tokens % k:
        return 0
    span = tokens // k
    return span if all(offsets[i] == i * span for i in range(k + 1)) else 0


class SegmentGemms:
    """One layer's prebuilt ``(A_cat, B_cat)`` as GEMM operands: per adapter, and batched per run."""

    def __init__(self, a_cat: torch.Tensor, b_cat: torch.Tensor, layout: SegmentLayout) -> None:
        d_in, d_out = a_cat.shape[1], b_cat.shape[0]
        self.scalings = layout.scalings
        self.per_adapter = [  # (A_kᵀ: d_in × r, B_kᵀ: r × d_out) views
            (a_cat[r0:r1].t(), b_cat[:, r0:r1].t()) for r0, r1 in zip(layout.rank_offsets, layout.rank_offsets[1:])
        ]
        self.runs = rank_runs(layout)
        self.batched = []  # per run: (n × d_in × r, n × r × d_out) views
        for run in self.runs:
            r0, r1 = run.rank_offset, run.rank_offset + run.count * run.rank
            a_t = a_cat[r0:r1].view(run.count, run.rank, d_in).transpose(1, 2)
            b_t = b_cat[:, r0:r1].view(d_out, run.count, run.rank).permute(1, 2, 0)
            self.batched.append((a_t, b_t))

    def add_(self, y: torch.Tensor, x: torch.Tensor, layout: SegmentLayout) -> bool:
        """``y += LoRA(x)`` in place (``x``: tokens × d_in, ``y``: contiguous tokens × d_out).

        Returns ``False``, leaving ``y`` alone, when it would take more than ``MAX_GROUPS`` GEMM pairs.
        """
        tokens = x.shape[0]
        span = layout.cached(("uniform_span", tokens), lambda: uniform_span(layout, tokens))
        if span and len(self.runs) <= MAX_GROUPS:
            x3, y3 = x.view(-1, span, x.shape[-1]), y.view(-1, span, y.shape[-1])
            for run, (a_t, b_t) in zip(self.runs, self.batched):
                rows = slice(run.first, run.first + run.count)
                y3[rows].baddbmm_(torch.bmm(x3[rows], a_t), b_t, alpha=run.scaling)
            return True
        offsets = layout.token_offsets
        present = layout.cached(("segments_with_rank",), lambda: _segments_with_rank(layout))
        if len(present) > MAX_GROUPS:
            return False
        for k in present:
            a_t, b_t = self.per_adapter[k]
            rows = slice(offsets[k], offsets[k + 1])
            y[rows].addmm_(torch.mm(x[rows], a_t), b_t, alpha=self.scalings[k])
        return True


def _segments_with_rank(layout: SegmentLayout) -> list[int]:
    """Adapters that own tokens and have a rank: the ones whose GEMMs change anything."""
    offsets, ranks = layout.token_offsets, layout.ranks()
    return [k for k in range(layout.num_adapters) if offsets[k + 1] > offsets[k] and ranks[k]]
