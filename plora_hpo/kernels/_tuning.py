"""Block sizes and work-splitting heuristics for the packed LoRA kernels.

Kept apart from the kernels so the benchmark can sweep them and the tests can force the
split (atomic) paths on a CPU interpreter that would never choose them by itself.

Defaults were picked from H200 sweeps (``benchmarks/lora_kernels.py --sweep``, kernel phases of 7b.up
at K=32; that output is not kept in ``benchmarks/results/``): 128-row tiles for shrink/expand
(halve the weight re-reads per byte of activations), 8 warps; outer products 64 rows × 128
columns, 8 warps; expand writes 64-column blocks (at 128 its accumulator alone takes 64
registers a thread: one program per multiprocessor, which was slower). Rank tiles of 128 and
more take narrower column blocks (``block_c_big``) so that every body of a mixed-rank launch
keeps two programs per multiprocessor, as for rank 64 (``ptxas -v`` on sm_90).
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Iterator
from dataclasses import dataclass, field, fields, replace

import torch


@dataclass(frozen=True)
class LaunchConfig:
    """One kernel's tile width along the hidden dimension and its Triton launch options.

    ``block_c`` serves rank tiles up to 64; ``block_c_big`` (None: ``block_c``) the tile of
    128, and proportionally less above it. Both are powers of two.
    """

    block_c: int
    num_warps: int = 4
    num_stages: int = 3
    block_c_big: int | None = None


@dataclass(frozen=True)
class Tuning:
    """All knobs of one packed-LoRA call.

    Attributes:
        block_m: token rows per tile of shrink and expand; a tile never mixes adapters.
        shrink: reduce over the hidden dimension into the per-token rank buffer (x·Aᵀ, dy·B).
        expand: rank buffer times a weight block out to the hidden dimension (·Bᵀ, ·A).
        outer: token-reduced outer products, the weight gradients (dyᵀ·h, gᵀ·x).
        outer_block_m: token rows per step of the outer kernel's loop over a segment.
        waves: programs to aim for per multiprocessor before splitting a reduction.
        merge_ranks: one launch for all ranks (kernels branch on each tile's rank) instead of
            one launch per rank tile.
        shrink_split / outer_split: force the number of partial sums (atomics) if set.
        expand_grid: force the number of column programs per token tile if set.
        poison: fill every buffer before the kernels write it with NaN (tests: an element a
            kernel forgets to write shows up instead of passing as leftover zeros).
        fuse_dx: compute dx = g·A inside the dA kernel's pass over x (one launch and one read of
            g fewer); off: a separate expand launch, as in the forward.
    """

    block_m: int = 128
    shrink: LaunchConfig = field(default_factory=lambda: LaunchConfig(64, 8, 3, block_c_big=64))
    expand: LaunchConfig = field(default_factory=lambda: LaunchConfig(64, 8, 3, block_c_big=64))
    outer: LaunchConfig = field(default_factory=lambda: LaunchConfig(128, 8, 3, block_c_big=64))
    outer_block_m: int = 64
    waves: int = 4
    merge_ranks: bool = True
    shrink_split: int | None = None
    outer_split: int | None = None
    expand_grid: int | None = None
    poison: bool = False
    fuse_dx: bool = True

    @functools.cached_property
    def _hash(self) -> int:
        return hash(tuple(getattr(self, f.name) for f in fields(self)))

    def __hash__(self) -> int:  # hashed on every layer call (launch-spec cache key): compute once
        return self._hash


_current: list[Tuning] = [Tuning()]


def current() -> Tuning:
    return _current[-1]


@contextlib.contextmanager
def override(**changes: object) -> Iterator[Tuning]:
    """Temporarily change fields of the active :class:`Tuning` (tests, benchmark sweeps)."""
    _current.append(replace(current(), **changes))
    try:
        yield _current[-1]
    finally:
        _current.pop()


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def multiprocessors(device: torch.device) -> int:
    """Multiprocessor count; 1 under the interpreter so CPU runs pick the least work."""
    if device.type != "cuda" or os.environ.get("TRITON_INTERPRET") == "1":
        return 1
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


def cdiv(a: int, b: int) -> int:
    return -(-a // b)
