"""Host wrappers: size the grids, allocate the buffers and launch one kernel per launch group.

Each wrapper takes the weight as (tensor, stride along its hidden dim, stride along its rank
dim), so forward and backward reuse the same three kernels on A, Aᵀ, B and Bᵀ without copies.

A reduction is split across programs (fp32 atomics into a zeroed buffer, then a cast) only when
one program would otherwise stream megabytes while the GPU sits idle: on small problems the
extra memset and cast launches cost more than the parallelism gains.

Everything that depends only on the layout, the width of the big tensor, its dtype and the
tuning (groups, grids, splits, constexprs, rows no tile writes) is worked out once and cached
on the plan (``Plan.launch_specs``): a layer call then costs its allocations and launches only.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from plora_hpo.kernels._plan import LaunchGroup, Plan
from plora_hpo.kernels._segment_kernels import expand_kernel, outer_kernel, shrink_kernel
from plora_hpo.kernels._tuning import Tuning, cdiv, multiprocessors

_MIN_BLOCKS_PER_SPLIT = 4  # a split of a hidden-dim reduction keeps its loads pipelined
_SPLIT_BYTES = 1 << 20  # a split reads at least this much of the big tensor
_merge_failed: list[bool] = []  # set once if the rank-branching kernels fail to build here


@dataclass(frozen=True)
class _Launch:
    group: LaunchGroup
    grid: tuple[int, ...]
    constexprs: dict[str, Any]
    grid_c: int = 1  # expand: column programs per row tile


@dataclass(frozen=True)
class _Spec:
    launches: tuple[_Launch, ...]
    atomic: bool  # a split reduction: accumulate in a zeroed fp32 buffer
    bare_rows: tuple[tuple[int, int], ...] = ()  # rows no tile writes (expand, fused dx)


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


def _run(
    plan: Plan,
    tuning: Tuning,
    key: tuple,
    build: Callable[[tuple[LaunchGroup, ...]], _Spec],
    launch: Callable[[_Spec], torch.Tensor],
) -> torch.Tensor:
    """``launch`` the cached spec of the merged groups; if the rank-branching kernels fail to
    build (raised while compiling, before anything was written), warn once and go per rank."""
    merge = tuning.merge_ranks and not _merge_failed
    full_key = (key, merge, tuning)
    spec = plan.launch_specs.get(full_key)
    if spec is None:
        spec = plan.launch_specs[full_key] = build(plan.groups(merge))
    if not (merge and any(len(g.rank_tiles) > 1 for g in plan.merged)):
        return launch(spec)
    try:
        return launch(spec)
    except Exception as exc:
        warnings.warn(f"rank-branching Triton kernels failed ({exc!r}); launching per rank", stacklevel=3)
        _merge_failed.append(True)
        return launch(build(plan.per_rank))


def _consts(g: LaunchGroup, block_m: int, cfg: Any, n_cols: int, align: int, **extra: Any) -> dict:
    return {
        **g.flags(),
        "BLOCK_M": block_m,
        "BLOCK_C": cfg.block_c,
        "EVEN_C": n_cols % cfg.block_c == 0,
        "ALIGN": align,
        "num_warps": cfg.num_warps,
        "num_stages": cfg.num_stages,
        **extra,
    }


def shrink(
    m: torch.Tensor, w: torch.Tensor, stride_wc: int, stride_wr: int, plan: Plan, tuning: Tuning
) -> torch.Tensor:
    """Per-token rank buffer ``h`` (compact) with ``h_k = s_k · m_k · w_k``, in m's dtype.

    Split reductions accumulate in fp32 and are cast afterwards; the consumers (expand, outer)
    feed ``h`` to bf16 dots anyway, and re-read it once per column block, so a 16-bit ``h``
    halves that traffic and the memory autograd keeps for the backward.
    """
    n_cols = m.shape[1]

    def build(groups: tuple[LaunchGroup, ...]) -> _Spec:
        cfg = tuning.shrink
        target = tuning.waves * multiprocessors(m.device)
        cap = max(1, cdiv(n_cols, cfg.block_c) // _MIN_BLOCKS_PER_SPLIT)
        per_program = tuning.block_m * n_cols * m.element_size()
        launches = []
        for g in groups:
            split = _split(tuning.shrink_split, cap, g.num_tiles, per_program, target)
            consts = _consts(g, tuning.block_m, cfg, n_cols, plan.align, USE_ATOMIC=split > 1)
            launches.append(_Launch(g, (g.num_tiles, split), consts))
        return _Spec(tuple(launches), any(sp.grid[1] > 1 for sp in launches))

    def launch(spec: _Spec) -> torch.Tensor:
        numel = max(plan.h_numel, 1)
        if spec.atomic:
            h = torch.zeros(numel, dtype=torch.float32, device=m.device)
        else:
            h = empty((numel,), m.dtype, m.device, tuning)
        for ln in spec.launches:
            shrink_kernel[ln.grid](
                m, w, h, ln.group.tiles, plan.token_offsets, plan.rank_offsets, plan.h_offsets, plan.scalings,
                n_cols, m.stride(0), m.stride(1), stride_wc, stride_wr, **ln.constexprs,
            )  # fmt: skip
        return h.to(m.dtype) if spec.atomic else h

    return _run(plan, tuning, ("shrink", n_cols, m.dtype), build, launch)


def _bare_rows(out: torch.Tensor, base: torch.Tensor | None, rows: tuple[tuple[int, int], ...]) -> None:
    for first, last in rows:
        if base is None:
            out[first:last].zero_()
        else:
            out[first:last].copy_(base[first:last])


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
    n_rows, n_cols = out.shape
    src = out if base is None else base

    def build(groups: tuple[LaunchGroup, ...]) -> _Spec:
        cfg = tuning.expand
        target = tuning.waves * multiprocessors(out.device)
        n_blocks = cdiv(n_cols, cfg.block_c)
        launches = []
        for g in groups:
            grid_c = min(tuning.expand_grid or max(1, cdiv(target, g.num_tiles)), n_blocks)
            consts = _consts(g, tuning.block_m, cfg, n_cols, plan.align, HAS_BASE=base is not None)
            launches.append(_Launch(g, (g.num_tiles * grid_c,), consts, grid_c))
        return _Spec(tuple(launches), False, tuple(plan.rows_without_delta(n_rows)))

    def launch(spec: _Spec) -> torch.Tensor:
        for ln in spec.launches:
            expand_kernel[ln.grid](
                h, w, out, src, ln.group.tiles, plan.token_offsets, plan.rank_offsets, plan.h_offsets,
                n_cols, ln.grid_c, stride_wr, stride_wc, out.stride(0), out.stride(1), src.stride(0), src.stride(1),
                **ln.constexprs,
            )  # fmt: skip
        _bare_rows(out, base, spec.bare_rows)
        return out

    return _run(plan, tuning, ("expand", n_rows, n_cols, out.dtype, base is not None), build, launch)


def weight_grad(
    m: torch.Tensor,
    h: torch.Tensor,
    like: torch.Tensor,
    rank_dim: int,
    plan: Plan,
    tuning: Tuning,
    dx: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Gradient shaped like ``like`` (A: rank_dim 0, B: rank_dim 1): ``Σ_t m[t, c] h[t, j]``.

    With ``dx=(a_cat, dx_out)`` (the dA pass: m = x, h = g) it also fills ``dx_out`` (shaped
    like x) with ``g · A_k`` on adapter rows and 0 elsewhere, in the same pass over the rows.
    """
    n_rows, n_cols = m.shape
    fused = dx is not None

    def build(groups: tuple[LaunchGroup, ...]) -> _Spec:
        cfg = tuning.outer
        block_m = tuning.outer_block_m
        target = tuning.waves * multiprocessors(m.device)
        n_blocks = cdiv(n_cols, cfg.block_c)
        launches = []
        for g in groups:
            per_program = g.max_rows * cfg.block_c * m.element_size() * (2 if fused else 1)
            programs = n_blocks * g.num_adapters
            split = _split(tuning.outer_split, cdiv(g.max_rows, block_m), programs, per_program, target)
            consts = _consts(g, block_m, cfg, n_cols, plan.align, USE_ATOMIC=split > 1, DX=fused)
            launches.append(_Launch(g, (n_blocks, g.num_adapters, split), consts))
        bare = tuple(plan.rows_without_delta(n_rows)) if fused else ()
        return _Spec(tuple(launches), any(ln.grid[2] > 1 for ln in launches), bare)

    def launch(spec: _Spec) -> torch.Tensor:
        dtype = torch.float32 if spec.atomic else like.dtype
        if spec.atomic or not plan.all_columns_written:
            out = torch.zeros(like.shape, dtype=dtype, device=like.device)
        else:
            out = empty(tuple(like.shape), dtype, like.device, tuning)
        a, d = dx if fused else (m, m)  # unused pointers when not fused
        for ln in spec.launches:
            outer_kernel[ln.grid](
                m, h, out, a, d, ln.group.adapters, plan.token_offsets, plan.rank_offsets, plan.h_offsets,
                n_cols, m.stride(0), m.stride(1), out.stride(1 - rank_dim), out.stride(rank_dim),
                a.stride(0), a.stride(1), d.stride(0), d.stride(1), **ln.constexprs,
            )  # fmt: skip
        if fused:
            _bare_rows(d, None, spec.bare_rows)
        return out.to(like.dtype)

    return _run(plan, tuning, ("outer", n_rows, n_cols, m.dtype, like.dtype, rank_dim, fused), build, launch)
