"""The three Triton kernels every packed LoRA pass is built from.

With ``h = s·x·Aᵀ`` (per adapter, per token) and ``g = s·dy·B``:

===========  ===================  ==========================  ==========================
kernel       reduces over         forward                     backward
===========  ===================  ==========================  ==========================
shrink       hidden (d_in/d_out)  h = s·x·A_kᵀ                g = s·dy·B_k        (case 2)
expand       rank (in one tile)   y = base + h·B_kᵀ           dx = g·A_k          (case 4)
outer        tokens of segment k  —                           dB_k = dyᵀ·h (1), dA_k = gᵀ·x (3)
                                                              + dx = g·A_k (4), fused
===========  ===================  ==========================  ==========================

Tiles run along tokens and hidden columns; an adapter's rank is one padded, masked tile
(``RANK_TILE``, a power of two ≥ 16), never split. One launch serves every rank: each tile
carries its rank tile, and the kernel branches to a body compiled for it (the ``T16``…
``TBIG`` flags say which bodies to compile), so a rank-8 adapter does rank-16 work, not
rank-128, and mixed ranks cost one launch, not one per rank.

Dot operands are cast to the dtype of the big activation tensor (bf16 on the GPU, fp32 under
the interpreter) and accumulate in fp32. The rank buffers ``h`` and ``g`` are stored in that
dtype too, except while a split reduction adds into them atomically (fp32, cast afterwards).
``ALIGN`` (a power of two dividing every rank offset) lets the compiler vectorise loads along
the rank dimension, whose start is only known at run time; the ``*_ALIGN_*`` constexprs do the
same for the weights' strides (the power of two each divides), which Triton itself only
specialises when they are multiples of 16: without them the B tiles of mixed ranks (Σr = 1512 for the benchmark's
32) load one bf16 at a time, synchronously (``ld.global.b16`` in the PTX).

Each body picks its own column block ``BC``: ``BLOCK_C`` up to rank tile 64, ``BLOCK_C_BIG`` at
128, scaled down past it (the host keeps it ≥ 16). A launch takes the registers and shared
memory of its largest body, so a rank-128 body as wide as the small ones would halve the
occupancy of every tile of a mixed launch; at half the width it costs what a rank-64 body does.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _rank_columns(rank_ptr, hoff_ptr, k, ALIGN: tl.constexpr):
    """(first rank column, rank, offset into h) of adapter k, with their known alignment."""
    r0 = tl.load(rank_ptr + k)
    rank = tl.load(rank_ptr + k + 1) - r0
    hoff = tl.load(hoff_ptr + k)
    if ALIGN > 1:
        r0 = tl.multiple_of(r0, ALIGN)
        rank = tl.multiple_of(rank, ALIGN)
        hoff = tl.multiple_of(hoff, ALIGN)
    return r0, rank, hoff


@triton.jit
def _shrink_tile(
    m_ptr, w_ptr, h_ptr, k, row0, split, n_split, tok_ptr, rank_ptr, hoff_ptr, scale_ptr,
    n_cols, stride_mt, stride_mc, stride_wc, stride_wr,
    RANK_TILE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_C_BIG: tl.constexpr,
    EVEN_C: tl.constexpr, USE_ATOMIC: tl.constexpr, ALIGN: tl.constexpr,
    W_ALIGN_C: tl.constexpr, W_ALIGN_R: tl.constexpr,
):  # fmt: skip
    BC: tl.constexpr = BLOCK_C if RANK_TILE <= 64 else BLOCK_C_BIG * 128 // RANK_TILE
    t1 = tl.load(tok_ptr + k + 1)
    t0 = tl.load(tok_ptr + k)
    r0, rank, hoff = _rank_columns(rank_ptr, hoff_ptr, k, ALIGN)
    rows = row0 + tl.arange(0, BLOCK_M)
    row_ok = rows < t1
    ranks = tl.arange(0, RANK_TILE)
    rank_ok = ranks < rank
    cols = tl.arange(0, BC)

    chunks = tl.cdiv(tl.cdiv(n_cols, BC), n_split)
    c_begin = split * chunks * BC
    c_end = tl.minimum(n_cols, c_begin + chunks * BC)
    m_ptrs = m_ptr + rows.to(tl.int64)[:, None] * stride_mt + (c_begin + cols)[None, :] * stride_mc
    c_offs = (c_begin + cols) * stride_wc
    r_offs = (r0 + ranks) * stride_wr
    if W_ALIGN_C > 1:  # hints on the op results themselves (through a helper's argument they are lost)
        c_offs = tl.multiple_of(c_offs, W_ALIGN_C)
    if W_ALIGN_R > 1:
        r_offs = tl.multiple_of(r_offs, W_ALIGN_R)
    w_ptrs = w_ptr + c_offs[:, None] + r_offs[None, :]
    dot_dtype = m_ptr.dtype.element_ty

    acc = tl.zeros((BLOCK_M, RANK_TILE), dtype=tl.float32)
    for c0 in range(c_begin, c_end, BC):
        if EVEN_C:
            m = tl.load(m_ptrs, mask=row_ok[:, None], other=0.0)
            w = tl.load(w_ptrs, mask=rank_ok[None, :], other=0.0)
        else:
            c_ok = c0 + cols < c_end
            m = tl.load(m_ptrs, mask=row_ok[:, None] & c_ok[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=c_ok[:, None] & rank_ok[None, :], other=0.0)
        acc = tl.dot(m.to(dot_dtype), w.to(dot_dtype), acc, input_precision="ieee")
        m_ptrs += BC * stride_mc
        w_ptrs += BC * stride_wc

    acc = acc * tl.load(scale_ptr + k)
    h_ptrs = h_ptr + hoff + (rows - t0)[:, None] * rank + ranks[None, :]
    mask = row_ok[:, None] & rank_ok[None, :]
    if USE_ATOMIC:
        tl.atomic_add(h_ptrs, acc, mask=mask, sem="relaxed")
    else:
        tl.store(h_ptrs, acc.to(h_ptr.dtype.element_ty), mask=mask)


@triton.jit
def shrink_kernel(
    m_ptr, w_ptr, h_ptr, tiles_ptr, tok_ptr, rank_ptr, hoff_ptr, scale_ptr,
    n_cols, stride_mt, stride_mc, stride_wc, stride_wr,
    SINGLE: tl.constexpr, T16: tl.constexpr, T32: tl.constexpr, T64: tl.constexpr, T128: tl.constexpr,
    TBIG: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_C_BIG: tl.constexpr, EVEN_C: tl.constexpr,
    USE_ATOMIC: tl.constexpr, ALIGN: tl.constexpr, W_ALIGN_C: tl.constexpr, W_ALIGN_R: tl.constexpr,
):  # fmt: skip
    """``h[t, :r_k] (+)= s_k · Σ_c m[t, c] · w_k[c, :r_k]`` for one row tile and one column split.

    ``w_k[c, j]`` sits at ``w_ptr + c*stride_wc + (rank_offset_k + j)*stride_wr``, so the same
    kernel reads A (as Aᵀ) in the forward and B in the backward. Tiles: (k, first row, rank tile).
    """
    tile = tl.program_id(0)
    split = tl.program_id(1)
    n_split = tl.num_programs(1)
    k = tl.load(tiles_ptr + 3 * tile)
    row0 = tl.load(tiles_ptr + 3 * tile + 1)
    rt = tl.load(tiles_ptr + 3 * tile + 2)
    if SINGLE > 0:  # one rank tile: no runtime branch
        _shrink_tile(
            m_ptr, w_ptr, h_ptr, k, row0, split, n_split, tok_ptr, rank_ptr, hoff_ptr, scale_ptr,
            n_cols, stride_mt, stride_mc, stride_wc, stride_wr,
            SINGLE, BLOCK_M, BLOCK_C, BLOCK_C_BIG, EVEN_C, USE_ATOMIC, ALIGN, W_ALIGN_C, W_ALIGN_R,
        )  # fmt: skip
    else:
        if T16:  # noqa: SIM102 - static (constexpr) test around a runtime one
            if rt == 16:
                _shrink_tile(
                    m_ptr, w_ptr, h_ptr, k, row0, split, n_split, tok_ptr, rank_ptr, hoff_ptr, scale_ptr,
                    n_cols, stride_mt, stride_mc, stride_wc, stride_wr,
                    16, BLOCK_M, BLOCK_C, BLOCK_C_BIG, EVEN_C, USE_ATOMIC, ALIGN, W_ALIGN_C, W_ALIGN_R,
                )  # fmt: skip
        if T32:  # noqa: SIM102 - static (constexpr) test around a runtime one
            if rt == 32:
                _shrink_tile(
                    m_ptr, w_ptr, h_ptr, k, row0, split, n_split, tok_ptr, rank_ptr, hoff_ptr, scale_ptr,
                    n_cols, stride_mt, stride_mc, stride_wc, stride_wr,
                    32, BLOCK_M, BLOCK_C, BLOCK_C_BIG, EVEN_C, USE_ATOMIC, ALIGN, W_ALIGN_C, W_ALIGN_R,
                )  # fmt: skip
        if T64:  # noqa: SIM102 - static (constexpr) test around a runtime one
            if rt == 64:
                _shrink_tile(
                    m_ptr, w_ptr, h_ptr, k, row0, split, n_split, tok_ptr, rank_ptr, hoff_ptr, scale_ptr,
                    n_cols, stride_mt, stride_mc, stride_wc, stride_wr,
                    64, BLOCK_M, BLOCK_C, BLOCK_C_BIG, EVEN_C, USE_ATOMIC, ALIGN, W_ALIGN_C, W_ALIGN_R,
                )  # fmt: skip
        if T128:  # noqa: SIM102 - static (constexpr) test around a runtime one
            if rt == 128:
                _shrink_tile(
                    m_ptr, w_ptr, h_ptr, k, row0, split, n_split, tok_ptr, rank_ptr, hoff_ptr, scale_ptr,
                    n_cols, stride_mt, stride_mc, stride_wc, stride_wr,
                    128, BLOCK_M, BLOCK_C, BLOCK_C_BIG, EVEN_C, USE_ATOMIC, ALIGN, W_ALIGN_C, W_ALIGN_R,
                )  # fmt: skip
        if TBIG > 0:  # noqa: SIM102 - static (constexpr) test around a runtime one
            if rt == TBIG:
                _shrink_tile(
                    m_ptr, w_ptr, h_ptr, k, row0, split, n_split, tok_ptr, rank_ptr, hoff_ptr, scale_ptr,
                    n_cols, stride_mt, stride_mc, stride_wc, stride_wr,
                    TBIG, BLOCK_M, BLOCK_C, BLOCK_C_BIG, EVEN_C, USE_ATOMIC, ALIGN, W_ALIGN_C, W_ALIGN_R,
                )  # fmt: skip


@triton.jit
def _expand_tile(
    h_ptr, w_ptr, out_ptr, base_ptr, k, row0, pid_c, grid_c, tok_ptr, rank_ptr, hoff_ptr,
    n_cols, stride_wr, stride_wc, stride_ot, stride_oc, stride_bt, stride_bc,
    RANK_TILE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_C_BIG: tl.constexpr,
    EVEN_C: tl.constexpr, HAS_BASE: tl.constexpr, ALIGN: tl.constexpr,
    W_ALIGN_R: tl.constexpr, W_ALIGN_C: tl.constexpr,
):  # fmt: skip
    BC: tl.constexpr = BLOCK_C if RANK_TILE <= 64 else BLOCK_C_BIG * 128 // RANK_TILE
    t0 = tl.load(tok_ptr + k)
    t1 = tl.load(tok_ptr + k + 1)
    r0, rank, hoff = _rank_columns(rank_ptr, hoff_ptr, k, ALIGN)
    rows = row0 + tl.arange(0, BLOCK_M)
    row_ok = rows < t1
    rows64 = rows.to(tl.int64)
    ranks = tl.arange(0, RANK_TILE)
    rank_ok = ranks < rank
    cols = tl.arange(0, BC)
    dot_dtype = out_ptr.dtype.element_ty

    h_ptrs = h_ptr + hoff + (rows - t0)[:, None] * rank + ranks[None, :]
    h = tl.load(h_ptrs, mask=row_ok[:, None] & rank_ok[None, :], other=0.0).to(dot_dtype)
    r_offs = (r0 + ranks) * stride_wr
    if W_ALIGN_R > 1:
        r_offs = tl.multiple_of(r_offs, W_ALIGN_R)
    for c0 in range(pid_c * BC, n_cols, grid_c * BC):
        cs = c0 + cols
        c_offs = cs * stride_wc
        if W_ALIGN_C > 1:
            c_offs = tl.multiple_of(c_offs, W_ALIGN_C)
        w_ptrs = w_ptr + r_offs[:, None] + c_offs[None, :]
        if EVEN_C:
            w = tl.load(w_ptrs, mask=rank_ok[:, None], other=0.0)
            o_mask = row_ok[:, None]
        else:
            c_ok = cs < n_cols
            w = tl.load(w_ptrs, mask=rank_ok[:, None] & c_ok[None, :], other=0.0)
            o_mask = row_ok[:, None] & c_ok[None, :]
        acc = tl.dot(h, w.to(dot_dtype), input_precision="ieee")
        if HAS_BASE:
            b_ptrs = base_ptr + rows64[:, None] * stride_bt + cs[None, :] * stride_bc
            acc += tl.load(b_ptrs, mask=o_mask, other=0.0).to(tl.float32)
        o_ptrs = out_ptr + rows64[:, None] * stride_ot + cs[None, :] * stride_oc
        tl.store(o_ptrs, acc.to(out_ptr.dtype.element_ty), mask=o_mask)


@triton.jit(do_not_specialize=["grid_c"])  # it follows the batch: one compiled variant for every value
def expand_kernel(
    h_ptr, w_ptr, out_ptr, base_ptr, tiles_ptr, tok_ptr, rank_ptr, hoff_ptr,
    n_cols, grid_c, stride_wr, stride_wc, stride_ot, stride_oc, stride_bt, stride_bc,
    SINGLE: tl.constexpr, T16: tl.constexpr, T32: tl.constexpr, T64: tl.constexpr, T128: tl.constexpr,
    TBIG: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_C_BIG: tl.constexpr, EVEN_C: tl.constexpr,
    HAS_BASE: tl.constexpr, ALIGN: tl.constexpr, W_ALIGN_R: tl.constexpr, W_ALIGN_C: tl.constexpr,
):  # fmt: skip
    """``out[t, c] = (base[t, c] +) Σ_j h[t, j] · w_k[j, c]`` for one row tile.

    Program ``pid`` serves tile ``pid // grid_c`` and every ``grid_c``-th column block from
    ``pid % grid_c``, so the h tile is loaded once and reused across its column blocks.
    ``w_k[j, c]`` sits at ``w_ptr + (rank_offset_k + j)*stride_wr + c*stride_wc`` (B as Bᵀ in
    the forward, A in the backward). ``base`` may be ``out`` itself (accumulate in place): each
    element is read and written by the same program.
    """
    pid = tl.program_id(0)
    tile = pid // grid_c
    pid_c = pid % grid_c
    k = tl.load(tiles_ptr + 3 * tile)
    row0 = tl.load(tiles_ptr + 3 * tile + 1)
    rt = tl.load(tiles_ptr + 3 * tile + 2)
    if SINGLE > 0:  # one rank tile: no runtime branch
        _expand_tile(
            h_ptr, w_ptr, out_ptr, base_ptr, k, row0, pid_c, grid_c, tok_ptr, rank_ptr, hoff_ptr,
            n_cols, stride_wr, stride_wc, stride_ot, stride_oc, stride_bt, stride_bc,
            SINGLE, BLOCK_M, BLOCK_C, BLOCK_C_BIG, EVEN_C, HAS_BASE, ALIGN, W_ALIGN_R, W_ALIGN_C,
        )  # fmt: skip
    else:
        if T16:  # noqa: SIM102 - static (constexpr) test around a runtime one
            if rt == 16:
                _expand_tile(
                    h_ptr, w_ptr, out_ptr, base_ptr, k, row0, pid_c, grid_c, tok_ptr, rank_ptr, hoff_ptr,
                    n_cols, stride_wr, stride_wc, stride_ot, stride_oc, stride_bt, stride_bc,
                    16, BLOCK_M, BLOCK_C, BLOCK_C_BIG, EVEN_C, HAS_BASE, ALIGN, W_ALIGN_R, W_ALIGN_C,
                )  # fmt: skip
        if T32:  # noqa: SIM102 - static (constexpr) test around a runtime one
            if rt == 32:
                _expand_tile(
                    h_ptr, w_ptr, out_ptr, base_ptr, k, row0, pid_c, grid_c, tok_ptr, rank_ptr, hoff_ptr,
                    n_cols, stride_wr, stride_wc, stride_ot, stride_oc, stride_bt, stride_bc,
                    32, BLOCK_M, BLOCK_C, BLOCK_C_BIG, EVEN_C, HAS_BASE, ALIGN, W_ALIGN_R, W_ALIGN_C,
                )  # fmt: skip
        if T64:  # noqa: SIM102 - static (constexpr) test around a runtime one
            if rt == 64:
                _expand_tile(
                    h_ptr, w_ptr, out_ptr, base_ptr, k, row0, pid_c, grid_c, tok_ptr, rank_ptr, hoff_ptr,
                    n_cols, stride_wr, stride_wc, stride_ot, stride_oc, stride_bt, stride_bc,
                    64, BLOCK_M, BLOCK_C, BLOCK_C_BIG, EVEN_C, HAS_BASE, ALIGN, W_ALIGN_R, W_ALIGN_C,
                )  # fmt: skip
        if T128:  # noqa: SIM102 - static (constexpr) test around a runtime one
            if rt == 128:
                _expand_tile(
                    h_ptr, w_ptr, out_ptr, base_ptr, k, row0, pid_c, grid_c, tok_ptr, rank_ptr, hoff_ptr,
                    n_cols, stride_wr, stride_wc, stride_ot, stride_oc, stride_bt, stride_bc,
                    128, BLOCK_M, BLOCK_C, BLOCK_C_BIG, EVEN_C, HAS_BASE, ALIGN, W_ALIGN_R, W_ALIGN_C,
                )  # fmt: skip
        if TBIG > 0:  # noqa: SIM102 - static (constexpr) test around a runtime one
            if rt == TBIG:
                _expand_tile(
                    h_ptr, w_ptr, out_ptr, base_ptr, k, row0, pid_c, grid_c, tok_ptr, rank_ptr, hoff_ptr,
                    n_cols, stride_wr, stride_wc, stride_ot, stride_oc, stride_bt, stride_bc,
                    TBIG, BLOCK_M, BLOCK_C, BLOCK_C_BIG, EVEN_C, HAS_BASE, ALIGN, W_ALIGN_R, W_ALIGN_C,
                )  # fmt: skip


@triton.jit
def _out_block(out_ptr, cs, rs, c_ok, r_ok, stride_oc, stride_or, O_ALIGN_C: tl.constexpr, O_ALIGN_R: tl.constexpr):
    """Pointers and mask of an outer program's (columns × ranks) block of its gradient."""
    o_c = cs * stride_oc
    o_r = rs * stride_or
    if O_ALIGN_C > 1:  # hints on the op results themselves
        o_c = tl.multiple_of(o_c, O_ALIGN_C)
    if O_ALIGN_R > 1:
        o_r = tl.multiple_of(o_r, O_ALIGN_R)
    return out_ptr + o_c[:, None] + o_r[None, :], c_ok[:, None] & r_ok[None, :]


@triton.jit
def _outer_cols(
    m_ptr, h_ptr, out_ptr, a_ptr, dx_ptr, k, c0, split, n_split, tok_ptr, rank_ptr, hoff_ptr,
    n_cols, stride_mt, stride_mc, stride_oc, stride_or, stride_ar, stride_ac, stride_dt, stride_dc,
    RANK_TILE: tl.constexpr, BLOCK_M: tl.constexpr, BC: tl.constexpr,
    EVEN_C: tl.constexpr, USE_ATOMIC: tl.constexpr, ALIGN: tl.constexpr, DX: tl.constexpr, DX_ACC: tl.constexpr,
    OUT_ACC: tl.constexpr,
    O_ALIGN_C: tl.constexpr, O_ALIGN_R: tl.constexpr, A_ALIGN_R: tl.constexpr, A_ALIGN_C: tl.constexpr,
):  # fmt: skip
    t0 = tl.load(tok_ptr + k)
    t1 = tl.load(tok_ptr + k + 1)
    r0, rank, hoff = _rank_columns(rank_ptr, hoff_ptr, k, ALIGN)
    h_base = h_ptr + hoff
    cs = c0 + tl.arange(0, BC)
    c_ok = cs < n_cols
    ranks = tl.arange(0, RANK_TILE)
    rank_ok = ranks < rank
    dot_dtype = m_ptr.dtype.element_ty
    if DX:  # this program's block of A_k, reused for every row tile of the segment
        a_r = (r0 + ranks) * stride_ar
        a_c = cs * stride_ac
        if A_ALIGN_R > 1:
            a_r = tl.multiple_of(a_r, A_ALIGN_R)
        if A_ALIGN_C > 1:
            a_c = tl.multiple_of(a_c, A_ALIGN_C)
        a_ptrs = a_ptr + a_r[:, None] + a_c[None, :]
        a_blk = tl.load(a_ptrs, mask=rank_ok[:, None] & c_ok[None, :], other=0.0).to(dot_dtype)

    if OUT_ACC and not USE_ATOMIC:  # start from what out holds: its load overlaps the first tiles'
        o_ptrs, mask = _out_block(out_ptr, cs, r0 + ranks, c_ok, rank_ok, stride_oc, stride_or, O_ALIGN_C, O_ALIGN_R)
        acc = tl.load(o_ptrs, mask=mask, other=0.0).to(tl.float32)
    else:
        acc = tl.zeros((BC, RANK_TILE), dtype=tl.float32)
    for row0 in range(t0 + split * BLOCK_M, t1, n_split * BLOCK_M):
        rows = row0 + tl.arange(0, BLOCK_M)
        row_ok = rows < t1
        m_ptrs = m_ptr + rows.to(tl.int64)[None, :] * stride_mt + cs[:, None] * stride_mc
        if EVEN_C:
            m = tl.load(m_ptrs, mask=row_ok[None, :], other=0.0)
        else:
            m = tl.load(m_ptrs, mask=c_ok[:, None] & row_ok[None, :], other=0.0)
        h_ptrs = h_base + (rows - t0)[:, None] * rank + ranks[None, :]
        h = tl.load(h_ptrs, mask=row_ok[:, None] & rank_ok[None, :], other=0.0).to(dot_dtype)
        acc = tl.dot(m.to(dot_dtype), h, acc, input_precision="ieee")
        if DX:  # dx[rows, cs] (+)= g[rows, :] · A_k[:, cs]: the rank reduction fits in the tile
            d = tl.dot(h, a_blk, input_precision="ieee")
            d_ptrs = dx_ptr + rows.to(tl.int64)[:, None] * stride_dt + cs[None, :] * stride_dc
            d_mask = row_ok[:, None] if EVEN_C else row_ok[:, None] & c_ok[None, :]
            if DX_ACC:
                d += tl.load(d_ptrs, mask=d_mask, other=0.0).to(tl.float32)
            tl.store(d_ptrs, d.to(dx_ptr.dtype.element_ty), mask=d_mask)

    o_ptrs, mask = _out_block(out_ptr, cs, r0 + ranks, c_ok, rank_ok, stride_oc, stride_or, O_ALIGN_C, O_ALIGN_R)
    if USE_ATOMIC:
        tl.atomic_add(o_ptrs, acc, mask=mask, sem="relaxed")
    else:
        tl.store(o_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _outer_tile(
    m_ptr, h_ptr, out_ptr, a_ptr, dx_ptr, k, pid_c, split, n_split, tok_ptr, rank_ptr, hoff_ptr,
    n_cols, stride_mt, stride_mc, stride_oc, stride_or, stride_ar, stride_ac, stride_dt, stride_dc,
    RANK_TILE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_C_BIG: tl.constexpr,
    GRID_C: tl.constexpr, EVEN_C: tl.constexpr, USE_ATOMIC: tl.constexpr, ALIGN: tl.constexpr,
    DX: tl.constexpr, DX_ACC: tl.constexpr, OUT_ACC: tl.constexpr,
    O_ALIGN_C: tl.constexpr, O_ALIGN_R: tl.constexpr, A_ALIGN_R: tl.constexpr, A_ALIGN_C: tl.constexpr,
):  # fmt: skip
    """Columns ``pid_c·GRID_C`` on, one body-width block; a body wider than the grid's step
    (``GRID_C``, the narrowest body of the launch) takes only the programs its width divides."""
    BC: tl.constexpr = BLOCK_C if RANK_TILE <= 64 else BLOCK_C_BIG * 128 // RANK_TILE
    c0 = pid_c * GRID_C
    if BC == GRID_C:  # noqa: SIM114 - static (constexpr) test: no runtime branch when widths agree
        _outer_cols(
            m_ptr, h_ptr, out_ptr, a_ptr, dx_ptr, k, c0, split, n_split, tok_ptr, rank_ptr, hoff_ptr,
            n_cols, stride_mt, stride_mc, stride_oc, stride_or, stride_ar, stride_ac, stride_dt, stride_dc,
            RANK_TILE, BLOCK_M, BC, EVEN_C, USE_ATOMIC, ALIGN, DX, DX_ACC, OUT_ACC,
            O_ALIGN_C, O_ALIGN_R, A_ALIGN_R, A_ALIGN_C,
        )  # fmt: skip
    elif c0 % BC == 0:
        _outer_cols(
            m_ptr, h_ptr, out_ptr, a_ptr, dx_ptr, k, c0, split, n_split, tok_ptr, rank_ptr, hoff_ptr,
            n_cols, stride_mt, stride_mc, stride_oc, stride_or, stride_ar, stride_ac, stride_dt, stride_dc,
            RANK_TILE, BLOCK_M, BC, EVEN_C, USE_ATOMIC, ALIGN, DX, DX_ACC, OUT_ACC,
            O_ALIGN_C, O_ALIGN_R, A_ALIGN_R, A_ALIGN_C,
        )  # fmt: skip


@triton.jit
def outer_kernel(
    m_ptr, h_ptr, out_ptr, a_ptr, dx_ptr, adapters_ptr, tok_ptr, rank_ptr, hoff_ptr,
    n_cols, stride_mt, stride_mc, stride_oc, stride_or, stride_ar, stride_ac, stride_dt, stride_dc,
    SINGLE: tl.constexpr, T16: tl.constexpr, T32: tl.constexpr, T64: tl.constexpr, T128: tl.constexpr,
    TBIG: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_C_BIG: tl.constexpr, GRID_C: tl.constexpr,
    EVEN_C: tl.constexpr, USE_ATOMIC: tl.constexpr, ALIGN: tl.constexpr, DX: tl.constexpr, DX_ACC: tl.constexpr,
    OUT_ACC: tl.constexpr,
    O_ALIGN_C: tl.constexpr, O_ALIGN_R: tl.constexpr, A_ALIGN_R: tl.constexpr, A_ALIGN_C: tl.constexpr,
):  # fmt: skip
    """``out_k[c, j] (+)= Σ_t m[t, c] · h[t, j]`` over (a split of) adapter k's token rows.

    Grid: (column steps of ``GRID_C``, adapters, token splits); split ``i`` takes row tiles
    ``i, i + n_split, ...`` of the segment. ``out_k[c, j]`` sits at ``out_ptr + c*stride_oc +
    (rank_offset_k + j)*stride_or`` (dB as is, dA transposed). Adapters: (k, rank tile).

    With ``DX`` (backward cases 3 and 4 in one pass, m = x, h = g) each program also writes
    ``dx[t, c] = Σ_j g[t, j] · A_k[j, c]`` for the rows and columns it visits, with ``A_k[j, c]``
    at ``a_ptr + (rank_offset_k + j)*stride_ar + c*stride_ac``: g is read once for both, and
    dx costs no launch of its own. ``DX_ACC`` adds that into dx instead (the base layer's
    ``dy·W`` already there), so no separate add pass over dx is needed. ``OUT_ACC`` likewise adds
    ``out_k`` into what ``out`` holds (the trainer's fp32 gradient buffer) instead of storing it.
    """
    pid_c = tl.program_id(0)
    k = tl.load(adapters_ptr + 2 * tl.program_id(1))
    rt = tl.load(adapters_ptr + 2 * tl.program_id(1) + 1)
    split = tl.program_id(2)
    n_split = tl.num_programs(2)
    if SINGLE > 0:  # one rank tile: no runtime branch
        _outer_tile(
            m_ptr, h_ptr, out_ptr, a_ptr, dx_ptr, k, pid_c, split, n_split, tok_ptr, rank_ptr, hoff_ptr,
            n_cols, stride_mt, stride_mc, stride_oc, stride_or, stride_ar, stride_ac, stride_dt, stride_dc,
            SINGLE, BLOCK_M, BLOCK_C, BLOCK_C_BIG, GRID_C, EVEN_C, USE_ATOMIC, ALIGN, DX, DX_ACC, OUT_ACC,
            O_ALIGN_C, O_ALIGN_R, A_ALIGN_R, A_ALIGN_C,
        )  # fmt: skip
    else:
        if T16:  # noqa: SIM102 - static (constexpr) test around a runtime one
            if rt == 16:
                _outer_tile(
                    m_ptr, h_ptr, out_ptr, a_ptr, dx_ptr, k, pid_c, split, n_split, tok_ptr, rank_ptr, hoff_ptr,
                    n_cols, stride_mt, stride_mc, stride_oc, stride_or, stride_ar, stride_ac, stride_dt, stride_dc,
                    16, BLOCK_M, BLOCK_C, BLOCK_C_BIG, GRID_C, EVEN_C, USE_ATOMIC, ALIGN, DX, DX_ACC, OUT_ACC,
                    O_ALIGN_C, O_ALIGN_R, A_ALIGN_R, A_ALIGN_C,
                )  # fmt: skip
        if T32:  # noqa: SIM102 - static (constexpr) test around a runtime one
            if rt == 32:
                _outer_tile(
                    m_ptr, h_ptr, out_ptr, a_ptr, dx_ptr, k, pid_c, split, n_split, tok_ptr, rank_ptr, hoff_ptr,
                    n_cols, stride_mt, stride_mc, stride_oc, stride_or, stride_ar, stride_ac, stride_dt, stride_dc,
                    32, BLOCK_M, BLOCK_C, BLOCK_C_BIG, GRID_C, EVEN_C, USE_ATOMIC, ALIGN, DX, DX_ACC, OUT_ACC,
                    O_ALIGN_C, O_ALIGN_R, A_ALIGN_R, A_ALIGN_C,
                )  # fmt: skip
        if T64:  # noqa: SIM102 - static (constexpr) test around a runtime one
            if rt == 64:
                _outer_tile(
                    m_ptr, h_ptr, out_ptr, a_ptr, dx_ptr, k, pid_c, split, n_split, tok_ptr, rank_ptr, hoff_ptr,
                    n_cols, stride_mt, stride_mc, stride_oc, stride_or, stride_ar, stride_ac, stride_dt, stride_dc,
                    64, BLOCK_M, BLOCK_C, BLOCK_C_BIG, GRID_C, EVEN_C, USE_ATOMIC, ALIGN, DX, DX_ACC, OUT_ACC,
                    O_ALIGN_C, O_ALIGN_R, A_ALIGN_R, A_ALIGN_C,
                )  # fmt: skip
        if T128:  # noqa: SIM102 - static (constexpr) test around a runtime one
            if rt == 128:
                _outer_tile(
                    m_ptr, h_ptr, out_ptr, a_ptr, dx_ptr, k, pid_c, split, n_split, tok_ptr, rank_ptr, hoff_ptr,
                    n_cols, stride_mt, stride_mc, stride_oc, stride_or, stride_ar, stride_ac, stride_dt, stride_dc,
                    128, BLOCK_M, BLOCK_C, BLOCK_C_BIG, GRID_C, EVEN_C, USE_ATOMIC, ALIGN, DX, DX_ACC, OUT_ACC,
                    O_ALIGN_C, O_ALIGN_R, A_ALIGN_R, A_ALIGN_C,
                )  # fmt: skip
        if TBIG > 0:  # noqa: SIM102 - static (constexpr) test around a runtime one
            if rt == TBIG:
                _outer_tile(
                    m_ptr, h_ptr, out_ptr, a_ptr, dx_ptr, k, pid_c, split, n_split, tok_ptr, rank_ptr, hoff_ptr,
                    n_cols, stride_mt, stride_mc, stride_oc, stride_or, stride_ar, stride_ac, stride_dt, stride_dc,
                    TBIG, BLOCK_M, BLOCK_C, BLOCK_C_BIG, GRID_C, EVEN_C, USE_ATOMIC, ALIGN, DX, DX_ACC, OUT_ACC,
                    O_ALIGN_C, O_ALIGN_R, A_ALIGN_R, A_ALIGN_C,
                )  # fmt: skip
