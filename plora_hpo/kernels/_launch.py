"""Host wrappers: size the grids, allocate the buffers and launch one kernel per launch group.

Each wrapper takes the weight as (tensor, stride along its hidden dim, stride along its rank
dim), so forward and backward reuse the same three kernels on A, Aᵀ, B and Bᵀ without copies.

A reduction is split across programs (fp32 atomics into a zeroed buffer, then a cast) only when
one program would otherwise stream megabytes while the GPU sits idle: on small problems the
extra memset and cast launches cost more than the parallelism gains.

Everything that depends only on the layout, the sizes, strides and dtypes of the tensors and
the tuning (groups, grids, splits, constexprs, rows no tile writes) is worked out once and
cached on the plan (``Plan.launch_specs``) as :class:`~plora_hpo.kernels._compiled.Launch`
objects, which after their first call skip Triton's per-call dispatch: a layer call then costs
its allocations and the launches themselves.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from plora_hpo.kernels._compiled import Launch
from plora_hpo.kernels._plan import LaunchGroup, Plan
from plora_hpo.kernels._segment_kernels import expand_kernel, outer_kernel, shrink_kernel
from plora_hpo.kernels._tuning import LaunchConfig, Tuning, cdiv, multiprocessors

_MIN_BLOCKS_PER_SPLIT = 4  # a split of a hidden-dim reduction keeps its loads pipelined
_SPLIT_BYTES = 1 << 20  # a split reads at least this much of the big tensor
_merge_failed: list[bool] = []  # set once if the rank-branching kernels fail to build here


@dataclass(frozen=True)
class _Spec:
    launches: tuple[Launch, ...]
    atomic: bool  # a split reduction: accumulate in a zeroed fp32 buffer
    bare_rows: tuple[tuple[int, int], ...] = ()  # rows no tile writes (expand, fused dx)


def empty(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, tuning: Tuning) -> torch.Tensor:
    """``torch.empty``, or NaN-filled when ``tuning.poison`` is set."""
    out = torch.empty(shape, dtype=dtype, device=device)
    return out.fill_(float("nan")) if tuning.poison else out


def _split(forced: int | None, cap: int, programs: int, bytes_per_program: int, target: int) -> int:
    """How many partial sums to cut a reduction into (1: no atomics). A forced count is taken as
    is (tests: an empty split just adds zeros)."""
    if forced:
        return forced
    if programs >= target or bytes_per_program < 2 * _SPLIT_BYTES:
        return 1
    return max(1, min(cdiv(target, programs), cap, bytes_per_program // _SPLIT_BYTES))


def _atomic_alternatives(forced: int | None, split: int, bytes_may_split: bool) -> tuple[dict[str, Any], ...]:
    """The other ``USE_ATOMIC`` a launch may take on another step: the split follows the batch's
    rows unless it is forced or the reduction is too small to split at any batch size."""
    return () if forced or not bytes_may_split else ({"USE_ATOMIC": split == 1},)


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
    if not (merge and plan.branching):
        return launch(spec)
    try:
        return launch(spec)
    except Exception as exc:
        warnings.warn(f"rank-branching Triton kernels failed ({exc!r}); launching per rank", stacklevel=3)
        _merge_failed.append(True)
        return launch(build(plan.per_rank))


def _hint(stride: int) -> int:
    """The power of two (≤ 16) dividing a stride, which the kernels hint on the offsets it scales
    (Triton specialises only on multiples of 16); 1, no hint, for a unit stride."""
    if stride == 1:
        return 1
    align = 16
    while stride % align:
        align //= 2
    return align


def _consts(
    g: LaunchGroup, block_m: int, cfg: LaunchConfig, n_cols: int, align: int, **extra: Any
) -> tuple[dict[str, Any], list[int]]:
    """The constexprs and launch options of one group's launch, and its bodies' column widths
    (as the kernels derive them: ``BLOCK_C`` to rank tile 64, ``BLOCK_C_BIG·128/tile`` above)."""
    big = cfg.block_c if cfg.block_c_big is None else cfg.block_c_big
    big = max([big, *(16 * t // 128 for t in g.rank_tiles)])  # no body narrower than tl.dot's 16
    widths = [cfg.block_c if t <= 64 else big * 128 // t for t in g.rank_tiles]
    consts = {
        **g.flags(),
        "BLOCK_M": block_m,
        "BLOCK_C": cfg.block_c,
        "BLOCK_C_BIG": big,
        "EVEN_C": n_cols % max(widths) == 0,  # powers of two: every width divides then
        "ALIGN": align,
        "num_warps": cfg.num_warps,
        "num_stages": cfg.num_stages,
        **extra,
    }
    return consts, widths


def shrink(
    m: torch.Tensor, w: torch.Tensor, stride_wc: int, stride_wr: int, plan: Plan, tuning: Tuning
) -> torch.Tensor:
    """Per-token rank buffer ``h`` (compact) with ``h_k = s_k · m_k · w_k``, in m's dtype.

    Split reductions accumulate in fp32 and are cast afterwards; the consumers (expand, outer)
    feed ``h`` to bf16 dots anyway, and re-read it once per column block, so a 16-bit ``h``
    halves that traffic and the memory autograd keeps for the backward.
    """
    n_cols = m.shape[1]
    ints = (n_cols, *m.stride(), stride_wc, stride_wr)

    def build(groups: tuple[LaunchGroup, ...]) -> _Spec:
        cfg = tuning.shrink
        target = tuning.waves * multiprocessors(m.device)
        per_program = tuning.block_m * n_cols * m.element_size()
        launches = []
        for g in groups:
            consts, widths = _consts(g, tuning.block_m, cfg, n_cols, plan.align)
            cap = max(1, cdiv(n_cols, max(widths)) // _MIN_BLOCKS_PER_SPLIT)
            split = _split(tuning.shrink_split, cap, g.num_tiles, per_program, target)
            consts.update(USE_ATOMIC=split > 1, W_ALIGN_C=_hint(stride_wc), W_ALIGN_R=_hint(stride_wr))
            fixed = (g.tiles, plan.token_offsets, plan.rank_offsets, plan.h_offsets, plan.scalings, *ints)
            others = _atomic_alternatives(tuning.shrink_split, split, cap > 1 and per_program >= 2 * _SPLIT_BYTES)
            launches.append(Launch(shrink_kernel, (g.num_tiles, split, 1), 3, fixed, consts, others))
        return _Spec(tuple(launches), any(ln.grid[1] > 1 for ln in launches))

    def launch(spec: _Spec) -> torch.Tensor:
        numel = max(plan.h_numel, 1)
        if spec.atomic:
            h = torch.zeros(numel, dtype=torch.float32, device=m.device)
        else:
            h = empty((numel,), m.dtype, m.device, tuning)
        for ln in spec.launches:
            ln(m, w, h)
        return h.to(m.dtype) if spec.atomic else h

    return _run(plan, tuning, ("shrink", *ints, m.dtype, w.dtype), build, launch)


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
    """Fill ``out`` with ``base + h_k · w_k`` on adapter rows and ``base`` (or 0) elsewhere.

    ``base`` may be ``out`` itself: the delta is then added in place and other rows are left
    as they are.
    """
    n_rows, n_cols = out.shape
    src = out if base is None else base
    in_place = base is out
    ints = (n_cols, stride_wr, stride_wc, *out.stride(), *src.stride())

    def build(groups: tuple[LaunchGroup, ...]) -> _Spec:
        cfg = tuning.expand
        target = tuning.waves * multiprocessors(out.device)
        launches = []
        for g in groups:
            consts, widths = _consts(
                g, tuning.block_m, cfg, n_cols, plan.align,
                HAS_BASE=base is not None, W_ALIGN_R=_hint(stride_wr), W_ALIGN_C=_hint(stride_wc),
            )  # fmt: skip
            grid_c = min(tuning.expand_grid or max(1, cdiv(target, g.num_tiles)), cdiv(n_cols, min(widths)))
            fixed = (g.tiles, plan.token_offsets, plan.rank_offsets, plan.h_offsets, n_cols, grid_c, *ints[1:])
            launches.append(Launch(expand_kernel, (g.num_tiles * grid_c, 1, 1), 4, fixed, consts))
        bare = () if in_place else tuple(plan.rows_without_delta(n_rows))
        return _Spec(tuple(launches), False, bare)

    def launch(spec: _Spec) -> torch.Tensor:
        for ln in spec.launches:
            ln(h, w, out, src)
        _bare_rows(out, base, spec.bare_rows)
        return out

    key = ("expand", n_rows, *ints, h.dtype, w.dtype, out.dtype, src.dtype, base is not None, in_place)
    return _run(plan, tuning, key, build, launch)


def weight_grad(
    m: torch.Tensor,
    h: torch.Tensor,
    like: torch.Tensor,
    rank_dim: int,
    plan: Plan,
    tuning: Tuning,
    dx: tuple[torch.Tensor, torch.Tensor] | None = None,
    accumulate: bool = False,
    into: torch.Tensor | None = None,
) -> torch.Tensor:
    """Gradient shaped like ``like`` (A: rank_dim 0, B: rank_dim 1): ``Σ_t m[t, c] h[t, j]``.

    With ``dx=(a_cat, dx_out)`` (the dA pass: m = x, h = g) it also writes ``g · A_k`` into
    ``dx_out`` (shaped like x) in the same pass over the rows: on adapter rows, with 0 on the
    others; or, with ``accumulate``, added to what ``dx_out`` holds, other rows untouched.
    With ``into`` (shaped like ``like``, fp32, any strides: a view of the trainer's gradient
    buffer) the gradient is added into it and ``into`` is returned: no gradient tensor of its
    own, no cast, no separate add.
    """
    n_rows, n_cols = m.shape
    fused = dx is not None
    a, d = dx if fused else (m, m)  # unused pointers when not fused
    out_strides = (like.shape[1], 1) if into is None else into.stride()  # own gradients are contiguous
    stride_oc, stride_or = out_strides[1 - rank_dim], out_strides[rank_dim]
    ints = (n_cols, *m.stride(), stride_oc, stride_or, *a.stride(), *d.stride())

    def build(groups: tuple[LaunchGroup, ...]) -> _Spec:
        hints = {
            "O_ALIGN_C": _hint(stride_oc),
            "O_ALIGN_R": _hint(stride_or),
            "A_ALIGN_R": _hint(a.stride(0)),
            "A_ALIGN_C": _hint(a.stride(1)),
        }
        cfg = tuning.outer
        block_m = tuning.outer_block_m
        target = tuning.waves * multiprocessors(m.device)
        launches = []
        for g in groups:
            consts, widths = _consts(
                g, block_m, cfg, n_cols, plan.align, DX=fused, DX_ACC=fused and accumulate, OUT_ACC=into is not None
            )
            n_steps = cdiv(n_cols, min(widths))
            per_program = g.max_rows * max(widths) * m.element_size() * (2 if fused else 1)
            programs = n_steps * g.num_adapters
            split = _split(tuning.outer_split, cdiv(g.max_rows, block_m), programs, per_program, target)
            consts.update(GRID_C=min(widths), USE_ATOMIC=split > 1, **hints)
            fixed = (g.adapters, plan.token_offsets, plan.rank_offsets, plan.h_offsets, *ints)
            others = _atomic_alternatives(tuning.outer_split, split, True)  # rows and bytes both follow the batch
            launches.append(Launch(outer_kernel, (n_steps, g.num_adapters, split), 5, fixed, consts, others))
        bare = tuple(plan.rows_without_delta(n_rows)) if fused and not accumulate else ()
        return _Spec(tuple(launches), any(ln.grid[2] > 1 for ln in launches), bare)

    def launch(spec: _Spec) -> torch.Tensor:
        if into is not None:  # added in place, atomically when split
            for ln in spec.launches:
                ln(m, h, into, a, d)
            _bare_rows(d, None, spec.bare_rows)
            return into
        dtype = torch.float32 if spec.atomic else like.dtype
        if spec.atomic or not plan.all_columns_written:
            out = torch.zeros(like.shape, dtype=dtype, device=like.device)
        else:
            out = empty(tuple(like.shape), dtype, like.device, tuning)
        for ln in spec.launches:
            ln(m, h, out, a, d)
        _bare_rows(d, None, spec.bare_rows)
        return out.to(like.dtype) if spec.atomic else out

    key = ("outer", n_rows, *ints, tuple(like.shape), m.dtype, h.dtype, like.dtype, a.dtype, d.dtype, rank_dim)
    return _run(plan, tuning, (*key, fused, accumulate, into is not None), build, launch)
