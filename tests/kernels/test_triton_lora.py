"""Triton packed LoRA against the fp64 reference: forward, dx, dA, dB.

On CPU the kernels run in Triton's interpreter in fp32 (its bf16 ``tl.dot`` is not faithful),
with small tiles so tiny shapes still span several tiles, splits and masked edges. With a GPU
the same cases run with the production tiles, plus larger bf16 cases.
"""

from __future__ import annotations

import random
import zlib

import pytest
import torch

from plora_hpo.kernels import SegmentLayout, packed_lora_add
from plora_hpo.kernels import _tuning as tuning
from plora_hpo.kernels._launch import _hint
from plora_hpo.kernels._plan import build_plan, rank_tile
from plora_hpo.kernels.triton_lora import packed_lora_add_triton, packed_lora_op, packed_lora_triton
from tests.kernels._oracle import Case, oracle, random_inputs, rel_err

ON_GPU = torch.cuda.is_available()
DEVICE = "cuda" if ON_GPU else "cpu"
FP32_TOL = 1e-5
BF16_TOL = 1e-2


def _k64() -> Case:
    rng = random.Random(64)
    lengths = [rng.choice([0, 1, 2, 3, 5]) for _ in range(64)]
    ranks = [rng.choice([8, 8, 16, 128]) for _ in range(64)]
    return Case(lengths, ranks, d_in=24, d_out=20, lead=1, tail=2)


CASES = {
    "k1": Case([37], [8], d_in=40, d_out=24),
    "k2_rank128": Case([19, 30], [128, 8], d_in=33, d_out=48),
    "ragged_empty_mixed": Case([5, 0, 37, 20, 0, 1], [8, 128, 16, 128, 32, 8], d_in=40, d_out=72, lead=3, tail=4),
    "odd_ranks_and_rank0": Case([9, 12, 7], [24, 0, 3], d_in=33, d_out=50, tail=2),
    "k64_tiny_segments": _k64(),
    "rank_above_128": Case([6, 9, 4, 3], [200, 16, 128, 64], d_in=40, d_out=36, lead=2),
}

# Interpreter tiles: small so a 40-wide hidden dim has a ragged last block and segments span tiles;
# rank tiles ≥ 128 get narrower column blocks than the others, as on the GPU.
SMALL_TILES = dict(
    block_m=16,
    outer_block_m=16,
    shrink=tuning.LaunchConfig(32, block_c_big=16),
    expand=tuning.LaunchConfig(32, block_c_big=16),
    outer=tuning.LaunchConfig(32, block_c_big=16),
)
MODES = {
    "direct": {},
    "split": dict(shrink_split=3, outer_split=2, expand_grid=2),
    "per_rank": dict(merge_ranks=False),
    "unfused_dx": dict(fuse_dx=False),
}


def _tuning_for(mode: str) -> dict:
    base = {} if ON_GPU else SMALL_TILES
    return {**base, **MODES[mode], "poison": True}


def _run(fn, x, a, b, dy, extra=()):
    """Output and gradients of the leaves that require them (None for the others)."""
    out = fn()
    leaves = [t for t in (x, a, b, *extra) if t.requires_grad]
    grads = iter(torch.autograd.grad(out, leaves, dy))
    return out, [next(grads) if t.requires_grad else None for t in (x, a, b, *extra)]


# The per-rank fallback compiles the same bodies without the rank branch: interpreter only.
CASE_MODES = list(MODES) if not ON_GPU else ["direct", "split"]


@pytest.mark.parametrize("mode", CASE_MODES)
@pytest.mark.parametrize("name", CASES)
def test_matches_fp64_reference(name: str, mode: str) -> None:
    case = CASES[name]
    gen = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    layout = case.layout(gen)
    x, a, b, _, dy = random_inputs(case, gen, torch.float32, torch.float32, DEVICE)
    with tuning.override(**_tuning_for(mode)):
        out, (dx, da, db) = _run(lambda: packed_lora_triton(x, a, b, layout), x, a, b, dy)
    want = oracle(x, a, b, layout, dy)
    errors = [rel_err(got, ref) for got, ref in zip((out, dx, da, db), want)]
    assert max(errors) <= FP32_TOL, dict(zip(("delta", "dx", "dA", "dB"), errors))
    assert out.dtype == dx.dtype == torch.float32 and da.shape == a.shape and db.shape == b.shape


def test_fused_add_and_base_gradient() -> None:
    case = CASES["ragged_empty_mixed"]
    gen = torch.Generator().manual_seed(1)
    layout = case.layout(gen)
    x, a, b, base, dy = random_inputs(case, gen, torch.float32, torch.float32, DEVICE)
    with tuning.override(**_tuning_for("direct")):
        out, (dx, da, db, dbase) = _run(
            lambda: packed_lora_add_triton(base, x, a, b, layout), x, a, b, dy, extra=(base,)
        )
    delta, *want = oracle(x, a, b, layout, dy)
    assert rel_err(out, base.detach().cpu().double() + delta) <= FP32_TOL
    assert torch.equal(dbase, dy)
    assert max(rel_err(g, w) for g, w in zip((dx, da, db), want)) <= FP32_TOL


def test_only_requested_gradients() -> None:
    case = CASES["k2_rank128"]
    gen = torch.Generator().manual_seed(2)
    layout = case.layout(gen)
    x, a, b, _, dy = random_inputs(case, gen, torch.float32, torch.float32, DEVICE)
    x.requires_grad_(False)
    a.requires_grad_(False)
    with tuning.override(**_tuning_for("direct")):
        _, (dx, da, db) = _run(lambda: packed_lora_triton(x, a, b, layout), x, a, b, dy)
    assert dx is None and da is None
    assert rel_err(db, oracle(x, a, b, layout, dy)[3]) <= FP32_TOL


@pytest.mark.parametrize("frozen", ["a", "x", "x_and_b"])
def test_partial_gradients(frozen: str) -> None:
    """dx without dA (separate expand launch), dA without dx (outer kernel without the dx part)."""
    case = CASES["ragged_empty_mixed"]
    gen = torch.Generator().manual_seed(9)
    layout = case.layout(gen)
    x, a, b, _, dy = random_inputs(case, gen, torch.float32, torch.float32, DEVICE)
    for name, t in (("x", x), ("a", a), ("b", b)):
        t.requires_grad_(name not in frozen.split("_and_"))
    with tuning.override(**_tuning_for("direct")):
        _, grads = _run(lambda: packed_lora_triton(x, a, b, layout), x, a, b, dy)
    for got, want, t in zip(grads, oracle(x, a, b, layout, dy)[1:], (x, a, b)):
        assert (got is None) == (not t.requires_grad)
        assert got is None or rel_err(got, want) <= FP32_TOL


def test_custom_op_matches_and_checks(monkeypatch: pytest.MonkeyPatch) -> None:
    """The torch custom op (what torch.compile sees): same numbers, schema, fake and autograd."""
    case = CASES["ragged_empty_mixed"]
    gen = torch.Generator().manual_seed(10)
    layout = case.layout(gen)
    x, a, b, base, dy = random_inputs(case, gen, torch.float32, torch.float32, DEVICE)
    with tuning.override(**_tuning_for("direct")):
        out, (dx, da, db, dbase) = _run(lambda: packed_lora_op(x, a, b, base, layout), x, a, b, dy, extra=(base,))
        monkeypatch.setenv("PLORA_KERNELS_OP", "1")  # the public entry points take the op too
        delta_op = packed_lora_triton(x, a, b, layout)
        args = (x, a, b, base, list(layout.token_offsets), list(layout.rank_offsets), list(layout.scalings))
        torch.library.opcheck(
            torch.ops.plora_hpo.packed_lora.default,
            args,
            test_utils=("test_schema", "test_autograd_registration", "test_faketensor"),
        )
    delta, *want = oracle(x, a, b, layout, dy)
    assert rel_err(out, base.detach().cpu().double() + delta) <= FP32_TOL
    assert rel_err(delta_op, delta) <= FP32_TOL
    assert torch.equal(dbase, dy)
    assert max(rel_err(g, w) for g, w in zip((dx, da, db), want)) <= FP32_TOL


def test_torch_compile_sees_the_op() -> None:
    """fullgraph compile (no graph break) of forward + backward through the custom op."""
    case = CASES["k2_rank128"]
    gen = torch.Generator().manual_seed(11)
    layout = case.layout(gen)
    x, a, b, base, dy = random_inputs(case, gen, torch.float32, torch.float32, DEVICE)
    torch._dynamo.reset()

    @torch.compile(fullgraph=True, backend="aot_eager")
    def step(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, base: torch.Tensor) -> torch.Tensor:
        return packed_lora_add_triton(base * 1.0, x, a, b, layout) * 2.0

    with tuning.override(**_tuning_for("direct")):
        out, (dx, da, db, _) = _run(lambda: step(x, a, b, base), x, a, b, 2.0 * dy, extra=(base,))
    delta, *want = oracle(x, a, b, layout, 4.0 * dy)
    assert rel_err(out, 2.0 * (base.detach().cpu().double() + delta)) <= FP32_TOL
    assert max(rel_err(g, w) for g, w in zip((dx, da, db), want)) <= FP32_TOL


def test_launch_specs_are_cached() -> None:
    """The second call with a layout plans nothing: every launch spec comes from the plan's cache."""
    case = CASES["ragged_empty_mixed"]
    gen = torch.Generator().manual_seed(12)
    layout = case.layout(gen)
    x, a, b, _, dy = random_inputs(case, gen, torch.float32, torch.float32, DEVICE)
    with tuning.override(**_tuning_for("direct")) as t:
        _run(lambda: packed_lora_triton(x, a, b, layout), x, a, b, dy)
        from plora_hpo.kernels._plan import plan_for

        specs = plan_for(layout, t.block_m, x.device).launch_specs
        first = dict(specs)
        _run(lambda: packed_lora_triton(x, a, b, layout), x, a, b, dy)
    assert len(first) == 5 and all(specs[k] is first[k] for k in first) and len(specs) == 5


def test_strided_weights() -> None:
    """A stored column-major and B as a slice of a wider matrix: no contiguity assumed."""
    case = CASES["ragged_empty_mixed"]
    gen = torch.Generator().manual_seed(3)
    layout = case.layout(gen)
    x, a, b, _, dy = random_inputs(case, gen, torch.float32, torch.float32, DEVICE)
    a_t = a.detach().t().contiguous().t().requires_grad_()
    wide = torch.randn(case.d_out, b.shape[1] + 5, generator=gen).to(DEVICE)
    wide[:, 2 : 2 + b.shape[1]] = b.detach()
    b_view = wide[:, 2 : 2 + b.shape[1]].requires_grad_()
    with tuning.override(**_tuning_for("split")):
        out, grads = _run(lambda: packed_lora_triton(x, a_t, b_view, layout), x, a_t, b_view, dy)
    want = oracle(x, a, b, layout, dy)
    assert max(rel_err(g, w) for g, w in zip((out, *grads), want)) <= FP32_TOL


def test_dispatch_uses_triton_when_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    case = CASES["k1"]
    gen = torch.Generator().manual_seed(4)
    layout = case.layout(gen)
    x, a, b, base, _ = random_inputs(case, gen, torch.float32, torch.float32, DEVICE)
    monkeypatch.setenv("PLORA_KERNELS", "triton")
    calls = []
    import plora_hpo.kernels.triton_lora as triton_lora

    original = triton_lora.packed_lora_add_triton
    monkeypatch.setattr(triton_lora, "packed_lora_add_triton", lambda *args: calls.append(1) or original(*args))
    with tuning.override(**_tuning_for("direct")):
        out = packed_lora_add(base, x, a, b, layout)
    assert calls and rel_err(out, base.detach().cpu().double() + oracle(x, a, b, layout, base)[0]) <= FP32_TOL


def test_rejects_mismatched_shapes() -> None:
    layout = SegmentLayout.from_counts([4], [8], [1.0])
    x = torch.randn(4, 16)
    with pytest.raises(ValueError, match="total rank"):
        packed_lora_triton(x, torch.randn(9, 16), torch.randn(8, 9), layout)
    with pytest.raises(ValueError, match="rows"):
        packed_lora_triton(torch.randn(3, 16), torch.randn(8, 16), torch.randn(8, 8), layout)


def test_plan_groups_and_tiles() -> None:
    assert [rank_tile(r) for r in (1, 8, 16, 17, 64, 100, 128)] == [16, 16, 16, 32, 64, 128, 128]
    layout = SegmentLayout.from_counts([40, 0, 17, 5], [8, 128, 128, 0], [1.0] * 4, token_start=2)
    plan = build_plan(layout, block_m=16, device=torch.device("cpu"))
    assert [g.rank_tiles for g in plan.per_rank] == [(128,), (16,)]
    (merged,) = plan.merged
    assert merged.tiles.view(-1, 3).tolist() == [[2, 42, 128], [2, 58, 128], [0, 2, 16], [0, 18, 16], [0, 34, 16]]
    assert merged.adapters.view(-1, 2).tolist() == [[2, 128], [0, 16]] and merged.max_rows == 40
    assert merged.flags() == {"SINGLE": 0, "T16": 1, "T32": 0, "T64": 0, "T128": 1, "TBIG": 0}
    assert plan.per_rank[0].flags()["SINGLE"] == 128
    assert plan.rows_without_delta(70) == [(0, 2), (59, 64), (64, 70)]
    assert not plan.all_columns_written  # adapter 1 has rank but no rows: its dA/dB must be zero
    assert plan.h_offsets.tolist() == [0, 320, 320, 2496] and plan.align == 8
    odd = build_plan(SegmentLayout.from_counts([3, 3], [24, 3], [1.0, 1.0]), 16, torch.device("cpu"))
    assert odd.align == 1 and odd.merged[0].rank_tiles == (16, 32)
    two_big = build_plan(SegmentLayout.from_counts([3, 3, 3], [200, 300, 8], [1.0] * 3), 16, torch.device("cpu"))
    assert two_big.merged == two_big.per_rank and [g.flags()["TBIG"] for g in two_big.merged] == [512, 256, 0]


@pytest.mark.parametrize("counts", [[40, 0, 17, 5], [1, 2, 3], [16], [5, 9, 33, 2, 7]])
def test_plan_index_tensors_start_16_byte_aligned_whatever_the_batch(counts: list[int]) -> None:
    """Triton compiles a kernel once per pointer alignment: a batch whose tile count is not a
    multiple of four must not move the adapter rows off a 16-byte boundary."""
    layout = SegmentLayout.from_counts(counts, [8, 16, 64, 32, 128][: len(counts)], [1.0] * len(counts))
    plan = build_plan(layout, block_m=16, device=torch.device("cpu"))
    for group in (*plan.merged, *plan.per_rank):
        assert group.tiles.data_ptr() % 16 == 0 and group.adapters.data_ptr() % 16 == 0, group.num_tiles


def test_alignment_hints() -> None:
    """The power of two each stride is hinted with: Σr = 1512 (32 mixed ranks) → 8; unit → none."""
    assert [_hint(s) for s in (1, 1512, 2048, 27, 6, 0)] == [1, 8, 16, 1, 2, 16]


# ---- GPU only: production tiles, bf16 activations, larger and non-multiple-of-tile shapes ----


def _k64_ragged() -> Case:
    rng = random.Random(5)
    lengths = [rng.randrange(0, 90) for _ in range(64)]
    ranks = [rng.choice([8, 16, 32, 64, 128]) for _ in range(64)]
    return Case(lengths, ranks, d_in=1536, d_out=1100)


GPU_CASES = {
    "k1_r8": Case([1000], [8], d_in=2048, d_out=2048),
    "k8_mixed_8_128": Case([700, 0, 513, 64, 1, 999, 300, 200], [8, 128] * 4, d_in=1000, d_out=3000, lead=7, tail=9),
    "k64_ragged": _k64_ragged(),
}
gpu = pytest.mark.skipif(not ON_GPU, reason="needs CUDA (bf16 tl.dot is not faithful in the interpreter)")


@gpu
@pytest.mark.parametrize("mode", ["direct", "split"])
@pytest.mark.parametrize("w_dtype", [torch.float32, torch.bfloat16], ids=["fp32_weights", "bf16_weights"])
@pytest.mark.parametrize("name", GPU_CASES)
def test_bf16_on_gpu(name: str, w_dtype: torch.dtype, mode: str) -> None:
    """Twice: the second call takes the compiled launchers directly (no JIT dispatch)."""
    case = GPU_CASES[name]
    gen = torch.Generator().manual_seed(7)
    layout = case.layout(gen)
    x, a, b, base, dy = random_inputs(case, gen, torch.bfloat16, w_dtype, DEVICE)
    delta, *want = oracle(x, a, b, layout, dy)
    for _ in range(2):
        with tuning.override(**MODES[mode], poison=True):
            out, (dx, da, db, _) = _run(
                lambda: packed_lora_add_triton(base, x, a, b, layout), x, a, b, dy, extra=(base,)
            )
            with torch.no_grad():
                alone = packed_lora_triton(x, a, b, layout)
        errors = {
            "delta": rel_err(alone, delta),
            "out": rel_err(out, base.detach().cpu().double() + delta),
            "dx": rel_err(dx, want[0]),
            "dA": rel_err(da, want[1]),
            "dB": rel_err(db, want[2]),
        }
        assert max(errors.values()) <= BF16_TOL, errors
    assert (out.dtype, dx.dtype, da.dtype, db.dtype) == (torch.bfloat16, torch.bfloat16, w_dtype, w_dtype)


@gpu
@pytest.mark.parametrize("name", GPU_CASES)
def test_fp32_on_gpu(name: str) -> None:
    case = GPU_CASES[name]
    gen = torch.Generator().manual_seed(8)
    layout = case.layout(gen)
    x, a, b, _, dy = random_inputs(case, gen, torch.float32, torch.float32, DEVICE)
    with tuning.override(poison=True):
        out, grads = _run(lambda: packed_lora_triton(x, a, b, layout), x, a, b, dy)
    want = oracle(x, a, b, layout, dy)
    errors = [rel_err(g, w) for g, w in zip((out, *grads), want)]
    assert max(errors) <= FP32_TOL, errors
