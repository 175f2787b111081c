"""Adapter factors concatenated once per evaluation call instead of once per layer call.

A packed layer builds its ``(A_cat, B_cat)`` from the route's adapters on every call: K casts
of the fp32 factors to the activations' dtype plus two concatenations. Training needs that
(the factors change every step); evaluation does not, and a decode step calls every adapted
projection once per generated token: for 32 adapters on a 28-layer model that is ~13k small
kernels and ~18 GB of memory traffic per step, more than the step's real work.

:func:`frozen_adapter_weights` opens the engine's frozen view
(:meth:`~plora_hpo.engine.packed_lora.PackedLoraModel.frozen_view`): each layer's concatenation
is built once, in exactly the dtype and layout the per-call path produces, and serves every
forward whose route lists exactly those adapters (groups without rows included), so results are
bit-identical. Any other route falls through to the layer's own path. :func:`full_route` turns a
batch's adapter-grouped rows into such a route.

Two more ways to apply the prebuilt factors, meant for bf16 on the GPU (they compute the same
function as the segment kernels with a different accumulation order, so the result is within
rounding of the kernel path):

* small batches (a decode step: one token per row, ``dense_max_tokens``) take a dense path:
  ``h = x · A_catᵀ`` for all adapters at once, each row's scaling on its own adapter's rank
  columns and zero elsewhere, then ``y = base + h · B_catᵀ`` — two GEMMs and one multiply
  instead of the segment kernels' launches and per-call planning. The zeroed columns add exact
  zeros; it costs K times the LoRA FLOPs, nothing next to the base layer at a few hundred tokens
  but dominant at prefill sizes;
* larger forwards (prefill, scoring: ``segment_gemms``) take cuBLAS GEMMs per adapter segment,
  batched per run of equal-rank adapters when every adapter owns the same number of tokens
  (:mod:`~plora_hpo.evaluation.segment_gemms`).

Both are the layers' fast path (:data:`~plora_hpo.engine.packed_lora.FastPath`), which the
engine consults itself; evaluation changes nothing on the engine's objects.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from itertools import pairwise

import torch

from plora_hpo.engine.packed_lora import FrozenFactors, PackedLoraLinear, PackedLoraModel
from plora_hpo.evaluation._model import run_lengths
from plora_hpo.evaluation.segment_gemms import SegmentGemms
from plora_hpo.kernels import SegmentLayout


@contextmanager
def frozen_adapter_weights(
    packed: PackedLoraModel,
    adapter_ids: Sequence[str],
    *,
    enabled: bool = True,
    dense_max_tokens: int = 0,
    segment_gemms: bool = False,
) -> Iterator[bool]:
    """Within the block, routes over exactly ``adapter_ids`` (in order) read prebuilt factors.

    Args:
        packed: the model whose packed layers serve the routes.
        adapter_ids: the adapters, in routing order, that every route of the block lists.
        enabled: ``False`` leaves the layers alone (e.g. while adapters are paged and their
            device copies come and go).
        dense_max_tokens: forwards of at most this many tokens take the dense path (module
            doc); 0: never.
        segment_gemms: larger forwards take cuBLAS GEMMs per adapter segment (module doc).

    Yields whether the prebuilt factors are in use (``False`` when disabled or without
    adapters). The factors are snapshots: do not change adapter weights inside the block.
    """
    ids = tuple(adapter_ids)
    if not enabled or not ids:
        yield False
        return
    fast_path = None
    if dense_max_tokens > 0 or segment_gemms:
        fast_path = functools.partial(_EvalPath, max_tokens=dense_max_tokens, gemms=segment_gemms)
    with packed.frozen_view(ids, fast_path=fast_path):
        yield True


class _EvalPath:
    """A layer's fast path for the block: the dense or the segment-GEMM path where they apply (module doc).

    The layer calls it only for routes its frozen factors serve, in their dtype, without
    autograd; ``None`` hands the forward back to the layer's own path.
    """

    def __init__(self, layer: PackedLoraLinear, factors: FrozenFactors, *, max_tokens: int, gemms: bool) -> None:
        self.base, self.factors, self.max_tokens, self.gemms = layer.base, factors, max_tokens, gemms
        self.a_t = factors.a_cat.t()  # (d_in, Σr)
        self.b_t = factors.b_cat.t()  # (Σr, d_out)
        self.segments: SegmentGemms | None = None  # built on first use (it needs the route's scalings)

    def __call__(self, x: torch.Tensor, layout: SegmentLayout) -> torch.Tensor | None:
        tokens = x.numel() // x.shape[-1]
        dense = tokens <= self.max_tokens
        if not (dense or self.gemms) or layout.token_offsets[-1] > tokens:
            return None  # a layout beyond x's tokens: the layer's own path reports the mismatch
        if dense:
            return self._dense(x, layout, tokens)
        if self.segments is None:
            self.segments = SegmentGemms(self.factors.a_cat, self.factors.b_cat, layout)
        y = self.base(x)
        if y.is_contiguous() and self.segments.add_(y.view(tokens, -1), x.reshape(tokens, -1), layout):
            return y
        return None

    def _dense(self, x: torch.Tensor, layout: SegmentLayout, tokens: int) -> torch.Tensor:
        y = self.base(x)
        scale = layout.cached(("dense_scale", str(x.device), x.dtype, tokens), lambda: _row_scales(layout, tokens, x))
        h = torch.mm(x.reshape(tokens, -1), self.a_t)
        h = h.mul_(scale) if scale.dtype == h.dtype else (h * scale).to(h.dtype)
        return torch.addmm(y.reshape(tokens, -1), h, self.b_t).view_as(y)


def _row_scales(layout: SegmentLayout, tokens: int, like: torch.Tensor) -> torch.Tensor:
    """``(tokens, Σr)``: adapter k's scaling on its rows × its rank columns, 0 elsewhere.

    In ``like``'s dtype when every scaling is exact there (then one in-place multiply rounds
    once, as an fp32 multiply would), else fp32.
    """
    scale = torch.zeros(tokens, layout.total_rank, dtype=torch.float32)
    for k, s in enumerate(layout.scalings):
        t0, t1 = layout.token_offsets[k], layout.token_offsets[k + 1]
        r0, r1 = layout.rank_offsets[k], layout.rank_offsets[k + 1]
        scale[t0:t1, r0:r1] = s
    exact = torch.equal(scale.to(like.dtype).float(), scale)
    return scale.to(device=like.device, dtype=like.dtype if exact else torch.float32)


def full_route(row_adapters: Iterable[str], order: Sequence[str]) -> list[tuple[str, int]]:
    """Route groups over every adapter of ``order`` for rows grouped in that order (absent: 0 rows).

    >>> full_route(["b", "b", "c"], ["a", "b", "c", "d"])
    [('a', 0), ('b', 2), ('c', 1), ('d', 0)]
    """
    runs = run_lengths(row_adapters)
    counts = dict(runs)
    position = {a: i for i, a in enumerate(order)}
    if len(counts) != len(runs) or any(position[a] >= position[b] for (a, _), (b, _) in pairwise(runs)):
        raise ValueError(f"rows are not grouped by adapter in routing order: {runs}")
    return [(a, counts.get(a, 0)) for a in order]
