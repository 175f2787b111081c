"""Adapter factors concatenated once per evaluation call instead of once per layer call.

A packed layer builds its ``(A_cat, B_cat)`` from the route's adapters on every call: K casts
of the fp32 factors to the activations' dtype plus two concatenations. Training needs that
(the factors change every step); evaluation does not, and a decode step calls every adapted
projection once per generated token: for 32 adapters on a 28-layer model that is ~13k small
kernels and ~18 GB of memory traffic per step, more than the step's real work.

:func:`frozen_adapter_weights` builds each layer's concatenation once, in exactly the dtype and
layout the per-call path produces, and serves it to every forward whose route lists exactly
those adapters (groups without rows included), so results are bit-identical. Any other route
falls through to the layer's own path. :func:`full_route` turns a batch's adapter-grouped rows
into such a route.

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
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from itertools import pairwise

import torch

from plora_hpo.engine.packed_lora import PackedLoraLinear, PackedLoraModel, Route
from plora_hpo.evaluation._model import run_lengths
from plora_hpo.evaluation.segment_gemms import SegmentGemms
from plora_hpo.kernels import SegmentLayout

_OVERRIDE = "_weights"  # the PackedLoraLinear method that returns (A_cat, B_cat) for a route


def _result_dtype(layer: PackedLoraLinear, master: torch.dtype, dtype: torch.dtype) -> torch.dtype:
    """The dtype ``layer._weights`` returns for activations of ``dtype`` (it casts fp32 masters)."""
    cast = layer.router.cast_adapters and dtype.is_floating_point and master != dtype
    return dtype if cast else master


def _concatenated(layer: PackedLoraLinear, ids: tuple[str, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """What ``layer._weights`` returns for a route over ``ids`` when activations have the base's dtype.

    That path casts each adapter's factors and then concatenates; casting the concatenation is
    the same elementwise cast in two launches instead of 2K (host time that a GPU profile of 32
    adapters on 196 layers showed per evaluation call).
    """
    a_cat = torch.cat([layer.lora_A[i].detach() for i in ids])
    b_cat = torch.cat([layer.lora_B[i].detach() for i in ids], dim=1)
    dtype = _result_dtype(layer, a_cat.dtype, layer.base.weight.dtype)
    return a_cat.to(dtype), b_cat.to(dtype)


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

    Yields whether the prebuilt factors are in use (``False`` when disabled or when the layers
    lack the hook). The factors are snapshots: do not change adapter weights inside the block.
    """
    ids = tuple(adapter_ids)
    layers = list(packed.layers.values())
    if not enabled or not ids or not all(callable(getattr(layer, _OVERRIDE, None)) for layer in layers):
        yield False
        return
    shadowed = []
    try:
        with torch.no_grad():
            for layer in layers:
                shadowed.append((layer, {name: vars(layer).get(name) for name in (_OVERRIDE, "forward")}))
                frozen = _FrozenWeights(layer, ids)
                setattr(layer, _OVERRIDE, frozen)
                if dense_max_tokens > 0 or segment_gemms:
                    layer.forward = _EvalForward(layer, frozen, dense_max_tokens, segment_gemms)
        yield True
    finally:
        for layer, previous in shadowed:
            for name, value in previous.items():
                if value is not None:
                    setattr(layer, name, value)
                elif name in vars(layer):
                    delattr(layer, name)


class _FrozenWeights:
    """A layer's ``_weights`` for the block: the prebuilt pair for its route, else the layer's own."""

    def __init__(self, layer: PackedLoraLinear, ids: tuple[str, ...]) -> None:
        self.layer, self.ids = layer, ids
        self.own = getattr(layer, _OVERRIDE)
        self.master = layer.lora_A[ids[0]].dtype
        self.a_cat, self.b_cat = _concatenated(layer, ids)

    def serves(self, route: Route | None, dtype: torch.dtype) -> bool:
        return (
            route is not None
            and route.adapter_ids == self.ids
            and _result_dtype(self.layer, self.master, dtype) == self.a_cat.dtype
        )

    def __call__(self, route: Route, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        if self.serves(route, dtype):
            return self.a_cat, self.b_cat
        return self.own(route, dtype)


class _EvalForward:
    """A layer's ``forward`` for the block: the dense or the segment-GEMM path where they apply (module doc)."""

    def __init__(self, layer: PackedLoraLinear, frozen: _FrozenWeights, max_tokens: int, gemms: bool) -> None:
        self.layer, self.frozen, self.max_tokens, self.gemms = layer, frozen, max_tokens, gemms
        self.own = layer.forward  # the class's forward (it reads the prebuilt factors too)
        self.a_t = frozen.a_cat.t()  # (d_in, Σr)
        self.b_t = frozen.b_cat.t()  # (Σr, d_out)
        self.segments: SegmentGemms | None = None  # built on first use (it needs the route's scalings)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        route = self.layer.router.current
        tokens = x.numel() // x.shape[-1]
        dense = tokens <= self.max_tokens
        if (
            not (dense or self.gemms)
            or x.dtype != self.a_t.dtype
            or not self.frozen.serves(route, x.dtype)
            or torch.is_grad_enabled()
        ):
            return self.own(x)
        layout = route.layout(x.shape[-2] if x.dim() == 3 else 1)
        if layout.token_offsets[-1] > tokens:
            return self.own(x)  # let the layer's own path report the mismatch
        if dense:
            return self._dense(x, layout, tokens)
        if self.segments is None:
            self.segments = SegmentGemms(self.frozen.a_cat, self.frozen.b_cat, layout)
        y = self.layer.base(x)
        if y.is_contiguous() and self.segments.add_(y.view(tokens, -1), x.reshape(tokens, -1), layout):
            return y
        return self.own(x)

    def _dense(self, x: torch.Tensor, layout: SegmentLayout, tokens: int) -> torch.Tensor:
        y = self.layer.base(x)
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
