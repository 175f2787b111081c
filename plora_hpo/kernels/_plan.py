"""Host-side plan of a packed batch: which tiles each kernel launch walks.

Every adapter with rows and a non-zero rank gets a rank tile (its rank padded to a power of
two, at least 16: the kernels' compile-time rank). A launch group lists, for the tile kernels,
(adapter, first token row, rank tile) per row tile, and for the token-reduced kernels (adapter,
rank tile). Tiles follow the segments, so no tile mixes adapters and nothing is sorted or
gathered. By default one group holds all adapters (largest ranks first, so long tiles start
early) and each kernel branches on the tile's rank; ``per_rank`` groups give one launch per
rank tile instead.

The per-token rank buffer ``h`` is compact: adapter k's rows occupy ``n_k * r_k`` values
starting at ``h_offsets[k]``, row stride ``r_k``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from plora_hpo.kernels.layout import SegmentLayout

MIN_RANK_TILE = 16  # smallest dimension tl.dot accepts
_ALIGN_CAP = 8  # 8 bf16 = 16 bytes, the widest vector load


def rank_tile(rank: int) -> int:
    """Power-of-two tile (≥16) a rank is padded to inside the kernel (masked, never stored)."""
    return max(MIN_RANK_TILE, 1 << (rank - 1).bit_length())


@dataclass(frozen=True)
class LaunchGroup:
    """Adapters served by one launch of each kernel.

    Attributes:
        tiles: int32 (num_tiles, 3) rows of (adapter, first token row, rank tile).
        adapters: int32 (num_adapters, 2) rows of (adapter, rank tile).
        rank_tiles: the distinct rank tiles present (which kernel bodies to compile).
        max_rows: most token rows any one adapter of the group has.
    """

    tiles: torch.Tensor
    adapters: torch.Tensor
    rank_tiles: tuple[int, ...]
    num_tiles: int
    num_adapters: int
    max_rows: int

    def flags(self) -> dict[str, int]:
        """The kernels' constexprs: ``SINGLE`` (the one rank tile, no runtime branch) or which
        rank bodies ``T16``…``TBIG`` to compile and branch between."""
        big = [t for t in self.rank_tiles if t > 128]
        if len(big) > 1:
            raise ValueError(f"one launch supports one rank tile above 128, got {big}")
        present = set(self.rank_tiles)
        return {
            "SINGLE": self.rank_tiles[0] if len(self.rank_tiles) == 1 else 0,
            "T16": int(16 in present),
            "T32": int(32 in present),
            "T64": int(64 in present),
            "T128": int(128 in present),
            "TBIG": big[0] if big else 0,
        }


@dataclass(frozen=True)
class Plan:
    """Device tensors and launch groups for one layout, one tile height and one device."""

    token_offsets: torch.Tensor
    rank_offsets: torch.Tensor
    scalings: torch.Tensor
    h_offsets: torch.Tensor
    h_numel: int
    merged: tuple[LaunchGroup, ...]
    per_rank: tuple[LaunchGroup, ...]
    align: int
    adapter_rows: tuple[int, int]
    rankless_rows: tuple[tuple[int, int], ...]
    all_columns_written: bool
    branching: bool  # a merged launch branches between rank bodies (may fail to build)
    launch_specs: dict[Any, Any] = field(default_factory=dict, compare=False, repr=False)
    """Launches (grids, fixed arguments, constexprs, compiled kernels) per (kernel, sizes, strides,
    dtypes, tuning), filled by ``_launch`` on first use, so a layer call after the first does no
    planning in Python and no Triton dispatch."""

    def groups(self, merge: bool) -> tuple[LaunchGroup, ...]:
        return self.merged if merge else self.per_rank

    def rows_without_delta(self, n_rows: int) -> list[tuple[int, int]]:
        """Row ranges no tile writes: outside the segments, or in segments of rank-0 adapters."""
        first, last = self.adapter_rows
        ranges = [(0, first), *self.rankless_rows, (last, n_rows)]
        return [(a, b) for a, b in ranges if b > a]


def _alignment(rank_offsets: tuple[int, ...]) -> int:
    align = _ALIGN_CAP
    while align > 1 and any(r % align for r in rank_offsets):
        align //= 2
    return align


def _group(layout: SegmentLayout, adapters: list[int], block_m: int, device: torch.device) -> LaunchGroup:
    tok, rk = layout.token_offsets, layout.rank_offsets
    tiles_of = {k: rank_tile(rk[k + 1] - rk[k]) for k in adapters}
    tiles = [(k, row, tiles_of[k]) for k in adapters for row in range(tok[k], tok[k + 1], block_m)]
    # the adapter rows start 16-byte aligned whatever the batch: Triton specialises a kernel on each
    # pointer's alignment, and a flip would compile it again mid-sweep
    head = [v for t in tiles for v in t]
    head += [0] * (-len(head) % 4)
    packed = torch.tensor(head + [v for k in adapters for v in (k, tiles_of[k])])
    packed = packed.to(torch.int32).to(device)
    return LaunchGroup(
        tiles=packed[: 3 * len(tiles)],
        adapters=packed[len(head) :],
        rank_tiles=tuple(sorted(set(tiles_of.values()))),
        num_tiles=len(tiles),
        num_adapters=len(adapters),
        max_rows=max(tok[k + 1] - tok[k] for k in adapters),
    )


def build_plan(layout: SegmentLayout, block_m: int, device: torch.device) -> Plan:
    tok, rk = layout.token_offsets, layout.rank_offsets
    h_offsets: list[int] = []
    h_numel = 0
    active: list[int] = []
    rankless: list[tuple[int, int]] = []
    all_columns_written = True
    for k in range(layout.num_adapters):
        rows, rank = tok[k + 1] - tok[k], rk[k + 1] - rk[k]
        h_offsets.append(h_numel)
        h_numel += rows * rank
        if rows and rank:
            active.append(k)
        elif rows:
            rankless.append((tok[k], tok[k + 1]))
        elif rank:
            all_columns_written = False

    def tile_of(k: int) -> int:
        return rank_tile(rk[k + 1] - rk[k])

    by_tile: dict[int, list[int]] = {}
    for k in active:
        by_tile.setdefault(tile_of(k), []).append(k)
    per_rank = tuple(_group(layout, by_tile[t], block_m, device) for t in sorted(by_tile, reverse=True))
    if sum(t > 128 for t in by_tile) > 1:  # a launch compiles one body above 128: keep them apart
        merged = per_rank
    else:
        ordered = sorted(active, key=lambda k: -tile_of(k))
        merged = (_group(layout, ordered, block_m, device),) if active else ()
    token_offsets, rank_offsets, scalings = layout.device_tensors(device)
    return Plan(
        token_offsets=token_offsets,
        rank_offsets=rank_offsets,
        scalings=scalings,
        h_offsets=torch.tensor(h_offsets or [0], dtype=torch.int64).to(device),
        h_numel=h_numel,
        merged=merged,
        per_rank=per_rank,
        align=_alignment(rk),
        adapter_rows=(tok[0], tok[-1]),
        rankless_rows=tuple(rankless),
        all_columns_written=all_columns_written,
        branching=any(len(g.rank_tiles) > 1 for g in merged),
    )


def plan_for(layout: SegmentLayout, block_m: int, device: torch.device) -> Plan:
    """The plan, built once per (layout, tile height, device) and cached on the layout."""
    plans = layout.cached("triton_plans", dict)  # keyed by the device object: no str() per call
    plan = plans.get((block_m, device))
    if plan is None:
        plan = plans[block_m, device] = build_plan(layout, block_m, device)
    return plan
