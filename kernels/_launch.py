"""Host wrappers: size the grids, allocate the buffers and launch one kernel per launch group.

Each wrapper takes the weight as (tensor, stride along its hidden dim, stride along its rank
dim), so forward and backward reuse the same three kernels on A, Aᵀ, B and Bᵀ without copies.

A reduction is split across programs (fp32 atomics into a zeroed buffer, then a cast) only when
one program would otherwise stream megabytes while the GPU sits idle: on small problems the
extra memset and cast launches cost more than the parallelism gains.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import TypeVar

import torch

from plora_hpo.kernels._plan import LaunchGroup, Plan
from plora_hpo.kernels._segment_kernels import expand_kernel, outer_kernel, shrink_kernel
from plora_hpo.kernels._tuning import Tuning, cdiv, multiprocessors

_MIN_BLOCKS_PER_SPLIT = 4  # a split of a hidden-dim reduction keeps its loads pipelined
_SPLIT_BYTES = 1 << 20  # a split reads at least this much of the big tensor
_merge_failed: list[bool] = []  # set once if the rank-branching kernels fail to build here

T = TypeVar("T")


def empty(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, tuning: Tuning) -> torch.Tensor:
    """``torch.empty``, or NaN-filled when ``tuning.poison`` is set."""
    out = torch.empty(shape, dtype=dtype, device=device)
    return out.fill_(float("nan")) if tuning.poison else out


def _split(forced: int | None, cap: int, programs: int, bytes_per_program: int, target: int) -> int:
    """How many partial sums to cut a reduction into (1: no atomics)."""
    if forced:
        return max(1, min(forced, cap))
    if programs >= target or bytes_per_program < 2 * _SPLIT_BYTES:
        return 1
    return max(1, min(cdiv(target, programs), cap, bytes_per_program // _SPLIT_BYTES))


def _with_fallback(plan: Plan, tuning: Tuning, run: Callable[[tuple[LaunchGroup, ...]], T]) -> T:
    """``run`` on the merged groups; if the rank-branching kernels fail to build, per rank."""
    merge = tuning.merge_ranks and not _merge_failed
    if not (merge and any(len(g.rank_tiles) > 1 for g in plan.merged)):
        return run(plan.groups(merge))
    try:
        return run(plan.merged)
    except Exception as exc:  # raised while compiling, before the launch wrote anything
        warnings.warn(f"rank-branching Triton kernels failed ({exc!r}); launching per rank", stacklevel=3)
        _merge_failed.append(True)
        return run(plan.per_rank)


def shrink(
    m: torch.Tensor, w: torch.Tensor, stride_wc: int, stride_wr: int, plan: Plan, tuning: Tuning
) -> torch.Tensor:
    """Per-token rank buffer ``h`` (compact) with ``h_k = s_k · m_k · w_k``, in m's dtype.

    Split reductions accumulate in fp32 and are cast afterwards; the consumers (expand, outer)
    feed ``h`` to bf16 dots anyway, and re-read it once per column block, so a 16-bit ``h``
    halves that traffic and the memory autograd keeps for the backward.
    """
    n_cols = m.shape[1]
    cfg = tuning.shrink
    target = tuning.waves * multiprocessors(m.device)
    n_blocks = cdiv(n_cols, cfg.block_c)
    cap = max(1, n_blocks // _MIN_BLOCKS_PER_SPLIT)
    per_program = tuning.block_m * n_cols * m.element_size()

    def run(groups: tuple[LaunchGroup, ...]) -> torch.Tensor:
        splits = [_split(tuning.shrink_split, cap, g.num_tiles, per_program, target) for g in groups]
        atomic = any(s > 1 for s in splits)
        if atomic:
            h = torch.zeros(max(plan.h_numel, 1), dtype=torch.float32, device=m.device)
        else:
            h = empty((max(plan.h_numel, 1),), m.dtype, m.device, tuning)
        for g, split in zip(groups, splits):
            shrink_kernel[(g.num_tiles, split)](
                m, w, h, g.tiles, plan.token_offsets, plan.rank_offsets, plan.h_offsets, plan.scalings,
                n_cols, m.stride(0), m.stride(1), stride_wc, stride_wr,
                **g.flags(), BLOCK_M=tuning.block_m, BLOCK_C=cfg.block_c, EVEN_C=n_cols % cfg.block_c == 0,
                USE_ATOMIC=split > 1, ALIGN=plan.align, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
            )  # fmt: skip
        return h.to(m.dtype) if atomic else h

    return _with_fallback(plan, tuning, run)


def expand(
    h: torch.Tensor,
    w: torch.Tensor,
    stride_wr: int,
    stride_wc: int,
    out: torch.Tensor,
    base: torch.Tensor | None,
    plan: Plan,
    tuning: Tuning,
) -> torch.Tensor:
    """Fill ``out`` with ``base + h_k · w_k`` on adapter rows and ``base`` (or 0) elsewhere."""
    n_cols = out.shape[1]
    cfg = tuning.expand
    target = tuning.waves * multiprocessors(out.device)
    n_blocks = cdiv(n_cols, cfg.block_c)
    src = out if base is None else base

    def run(groups: tuple[LaunchGroup, ...]) -> None:
        for g in groups:
            grid_c = min(tuning.expand_grid or max(1, cdiv(target, g.num_tiles)), n_blocks)
            expand_kernel[(g.num_tiles * grid_c,)](
                h, w, out, src, g.tiles, plan.token_offsets, plan.rank_offsets, plan.h_offsets,
                n_cols, grid_c, stride_wr, stride_wc, out.stride(0), out.stride(1), src.stride(0), src.stride(1),
                **g.flags(), BLOCK_M=tuning.block_m, BLOCK_C=cfg.block_c, EVEN_C=n_cols % cfg.block_c == 0,
                HAS_BASE=base is not None, ALIGN=plan.align, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
            )  # fmt: skip

    _with_fallback(plan, tuning, run)
    for first, last in plan.rows_without_delta(out.shape[0]):
        if base is None:
            out[first:last].zero_()
        else:
            out[first:last].copy_(base[first:last])
    return out


def weight_grad(
    m: torch.Tensor, h: torch.Tensor, like: torch.Tensor, rank_dim: int, plan: Plan, tuning: Tuning
) -> torch.Tensor:
    """Gradient shaped like ``like`` (A: rank_dim 0, B: rank_dim 1): ``Σ_t m[t, c] h[t, j]``."""
    n_cols = m.shape[1]
    cfg = tuning.outer
    block_m = tuning.outer_block_m
    target = tuning.waves * multiprocessors(m.device)
    n_blocks = cdiv(n_cols, cfg.block_c)

    def split_of(g: LaunchGroup) -> int:
        per_program = g.max_rows * cfg.block_c * m.element_size()
        programs = n_blocks * g.num_adapters
        return _split(tuning.outer_split, cdiv(g.max_rows, block_m), programs, per_program, target)

    def run(groups: tuple[LaunchGroup, ...]) -> torch.Tensor:
        splits = [split_of(g) for g in groups]
        atomic = any(s > 1 for s in splits)
        dtype = torch.float32 if atomic else like.dtype
        if atomic or not plan.all_columns_written:
            out = torch.zeros(like.shape, dtype=dtype, device=like.device)
        else:
            out = empty(tuple(like.shape), dtype, like.device, tuning)
        for g, split in zip(groups, splits):
            outer_kernel[(n_blocks, g.num_adapters, split)](
                m, h, out, g.adapters, plan.token_offsets, plan.rank_offsets, plan.h_offsets,
                n_cols, m.stride(0), m.stride(1), out.stride(1 - rank_dim), out.stride(rank_dim),
                **g.flags(), BLOCK_M=block_m, BLOCK_C=cfg.block_c, EVEN_C=n_cols % cfg.block_c == 0,
                USE_ATOMIC=split > 1, ALIGN=plan.align, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
            )  # fmt: skip
        return out.to(like.dtype)

    return _with_fallback(plan, tuning, run)
