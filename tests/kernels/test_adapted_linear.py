"""adapted_linear (frozen base layer + packed LoRA in one node) against the fp64 reference.

dx must be ``dy·W`` plus the adapters' dx, built in one buffer by the kernels: on rows outside
every segment and on rank-0 adapters' rows it is the base layer's gradient alone.
"""

from __future__ import annotations

import pytest
import torch

from plora_hpo.kernels import _tuning as tuning
from plora_hpo.kernels import adapted_linear, adapted_linear_reference
from plora_hpo.kernels._adapted_linear import adapted_linear_triton
from tests.kernels._oracle import Case, random_inputs, rel_err
from tests.kernels.test_triton_lora import BF16_TOL, CASE_MODES, DEVICE, FP32_TOL, MODES, ON_GPU, _tuning_for

CASES = {
    "ragged_empty_mixed": Case([5, 0, 37, 20, 0, 1], [8, 128, 16, 128, 32, 8], d_in=40, d_out=72, lead=3, tail=4),
    "rank0_and_odd": Case([9, 12, 7], [24, 0, 3], d_in=33, d_out=50, tail=2),
}


def _frozen(case: Case, gen: torch.Generator, dtype: torch.dtype, bias: bool) -> tuple[torch.Tensor, ...]:
    weight = (torch.randn(case.d_out, case.d_in, generator=gen) * case.d_in**-0.5).to(DEVICE, dtype)
    b = (torch.randn(case.d_out, generator=gen)).to(DEVICE, dtype) if bias else None
    return weight, b


def _want(x, weight, bias, a, b, layout, dy) -> list[torch.Tensor]:
    """y, dx, dA, dB in float64 on the CPU."""
    x64, a64, b64 = (t.detach().cpu().double().requires_grad_() for t in (x, a, b))
    bias64 = None if bias is None else bias.cpu().double()
    y = adapted_linear_reference(x64, weight.cpu().double(), bias64, a64, b64, layout)
    return [y.detach(), *torch.autograd.grad(y, (x64, a64, b64), dy.cpu().double())]


def _got(fn, x, a, b, dy) -> list[torch.Tensor]:
    y = fn()
    return [y, *torch.autograd.grad(y, (x, a, b), dy)]


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no_bias"])
@pytest.mark.parametrize("mode", CASE_MODES)
@pytest.mark.parametrize("name", CASES)
def test_matches_fp64_reference(name: str, mode: str, bias: bool) -> None:
    case = CASES[name]
    gen = torch.Generator().manual_seed(len(name) + 7 * bias)
    layout = case.layout(gen)
    x, a, b, _, dy = random_inputs(case, gen, torch.float32, torch.float32, DEVICE)
    weight, bias_t = _frozen(case, gen, torch.float32, bias)
    with tuning.override(**_tuning_for(mode)):
        got = _got(lambda: adapted_linear_triton(x, weight, bias_t, a, b, layout), x, a, b, dy)
    errors = [rel_err(g, w) for g, w in zip(got, _want(x, weight, bias_t, a, b, layout, dy))]
    assert max(errors) <= FP32_TOL, dict(zip(("y", "dx", "dA", "dB"), errors))
    assert weight.grad is None


def _views(buffer: torch.Tensor, case: Case) -> tuple[torch.Tensor, torch.Tensor]:
    """Views shaped like A_cat and B_cat in a buffer laid out as the trainer's pack gradient (a
    row per rank: 3 other columns, A's, Bᵀ's, 2 other columns)."""
    return buffer[:, 3 : 3 + case.d_in], buffer[:, 3 + case.d_in : -2].t()


def _grad_buffers(case: Case, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A prefilled fp32 buffer and its :func:`_views`."""
    buffer = torch.randn(sum(case.ranks), case.d_in + case.d_out + 5, generator=gen).to(DEVICE)
    return buffer, *_views(buffer, case)


@pytest.mark.parametrize("path", ["triton", "custom_op", "reference"])
@pytest.mark.parametrize("mode", CASE_MODES)
def test_weight_grads_added_into_given_buffers(mode: str, path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """``grads_into``: dA and dB are added into strided fp32 buffers (atomically when split) and
    the weights themselves get no gradient; dx is unchanged. Same on every path."""
    case = CASES["ragged_empty_mixed"]
    gen = torch.Generator().manual_seed(11)
    layout = case.layout(gen)
    x, a, b, _, dy = random_inputs(case, gen, torch.float32, torch.float32, DEVICE)
    weight, bias = _frozen(case, gen, torch.float32, True)
    buffer, a_into, b_into = _grad_buffers(case, gen)
    before = buffer.clone()
    monkeypatch.setenv("PLORA_KERNELS", "reference" if path == "reference" else "triton")
    if path == "custom_op":
        monkeypatch.setenv("PLORA_KERNELS_OP", "1")
    with tuning.override(**_tuning_for(mode)):
        y = adapted_linear(x, weight, bias, a, b, layout, grads_into=(a_into, b_into))
        y.backward(dy)
    want = _want(x, weight, bias, a, b, layout, dy)
    assert a.grad is None and b.grad is None
    assert rel_err(y, want[0]) <= FP32_TOL and rel_err(x.grad, want[1]) <= FP32_TOL
    a_before, b_before = _views(before, case)
    assert rel_err(a_into - a_before, want[2]) <= FP32_TOL and rel_err(b_into - b_before, want[3]) <= FP32_TOL
    assert torch.equal(buffer[:, :3], before[:, :3]) and torch.equal(buffer[:, -2:], before[:, -2:])


def test_only_dx_and_db() -> None:
    """A frozen: dx comes from the separate expand adding into dy·W (no fused dA pass)."""
    case = CASES["ragged_empty_mixed"]
    gen = torch.Generator().manual_seed(3)
    layout = case.layout(gen)
    x, a, b, _, dy = random_inputs(case, gen, torch.float32, torch.float32, DEVICE)
    a.requires_grad_(False)
    weight, bias = _frozen(case, gen, torch.float32, True)
    with tuning.override(**_tuning_for("direct")):
        y = adapted_linear_triton(x, weight, bias, a, b, layout)
        dx, db = torch.autograd.grad(y, (x, b), dy)
    want = _want(x, weight, bias, a.detach().requires_grad_(), b, layout, dy)
    assert rel_err(dx, want[1]) <= FP32_TOL and rel_err(db, want[3]) <= FP32_TOL


def test_dispatch_reference_and_triton_agree_on_3d_input(monkeypatch: pytest.MonkeyPatch) -> None:
    """The public entry flattens (batch, seq, d_in); reference (CPU default) and Triton agree."""
    case = Case([6, 10], [8, 16], d_in=24, d_out=20)
    gen = torch.Generator().manual_seed(5)
    layout = case.layout(gen)
    x, a, b, _, dy = random_inputs(case, gen, torch.float32, torch.float32, DEVICE)
    weight, bias = _frozen(case, gen, torch.float32, True)
    x3 = x.detach().view(2, 8, case.d_in).requires_grad_()
    outs = {}
    for choice in ("reference", "triton"):
        monkeypatch.setenv("PLORA_KERNELS", choice)
        with tuning.override(**_tuning_for("direct")):
            y = adapted_linear(x3, weight, bias, a, b, layout)
            outs[choice] = [y, *torch.autograd.grad(y, (x3, a, b), dy.view(2, 8, -1))]
    assert outs["triton"][0].shape == (2, 8, case.d_out)
    for got, ref in zip(outs["triton"], outs["reference"]):
        assert rel_err(got, ref.detach().cpu().double()) <= FP32_TOL


def test_rejects_trainable_or_misshaped_base(monkeypatch: pytest.MonkeyPatch) -> None:
    case = Case([4], [8], d_in=16, d_out=12)
    gen = torch.Generator().manual_seed(6)
    layout = case.layout(gen)
    x, a, b, _, _ = random_inputs(case, gen, torch.float32, torch.float32, DEVICE)
    weight, bias = _frozen(case, gen, torch.float32, True)
    for kernels in ("reference", "triton"):  # the rule holds on both paths
        monkeypatch.setenv("PLORA_KERNELS", kernels)
        with pytest.raises(ValueError, match="frozen"):
            adapted_linear(x, weight.clone().requires_grad_(), bias, a, b, layout)
    with pytest.raises(ValueError, match="do not fit"):
        adapted_linear_triton(x, weight[:, :8], bias, a, b, layout)


def test_custom_op_and_compile(monkeypatch: pytest.MonkeyPatch) -> None:
    """The custom op door: opcheck, and a fullgraph compile of forward + backward."""
    case = CASES["ragged_empty_mixed"]
    gen = torch.Generator().manual_seed(8)
    layout = case.layout(gen)
    x, a, b, _, dy = random_inputs(case, gen, torch.float32, torch.float32, DEVICE)
    weight, bias = _frozen(case, gen, torch.float32, True)
    offsets = (list(layout.token_offsets), list(layout.rank_offsets), list(layout.scalings))
    torch._dynamo.reset()

    @torch.compile(fullgraph=True, backend="aot_eager")
    def step(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return adapted_linear_triton(x, weight, bias, a, b, layout) * 2.0

    with tuning.override(**_tuning_for("direct")):
        torch.library.opcheck(
            torch.ops.plora_hpo.adapted_linear.default,
            (x, weight, bias, a, b, *offsets),
            test_utils=("test_schema", "test_autograd_registration", "test_faketensor"),
        )
        monkeypatch.setenv("PLORA_KERNELS_OP", "1")
        op = _got(lambda: adapted_linear_triton(x, weight, bias, a, b, layout), x, a, b, dy)
        monkeypatch.delenv("PLORA_KERNELS_OP")
        compiled = _got(lambda: step(x, a, b), x, a, b, dy)
    want = _want(x, weight, bias, a, b, layout, dy)
    assert max(rel_err(g, w) for g, w in zip(op, want)) <= FP32_TOL
    want2 = _want(x, weight, bias, a, b, layout, 2.0 * dy)
    assert rel_err(compiled[0], 2.0 * want[0]) <= FP32_TOL
    assert max(rel_err(g, w) for g, w in zip(compiled[1:], want2[1:])) <= FP32_TOL


@pytest.mark.skipif(not ON_GPU, reason="needs CUDA (bf16 tl.dot is not faithful in the interpreter)")
@pytest.mark.parametrize("mode", ["direct", "split"])
def test_bf16_on_gpu(mode: str) -> None:
    """Twice: the second call takes the compiled launchers directly."""
    case = Case([700, 0, 513, 64, 1, 999, 300, 200], [8, 128] * 4, d_in=1000, d_out=3000, lead=7, tail=9)
    gen = torch.Generator().manual_seed(9)
    layout = case.layout(gen)
    x, a, b, _, dy = random_inputs(case, gen, torch.bfloat16, torch.bfloat16, DEVICE)
    weight, bias = _frozen(case, gen, torch.bfloat16, True)
    want = _want(x, weight, bias, a, b, layout, dy)
    for _ in range(2):
        with tuning.override(**MODES[mode], poison=True):
            got = _got(lambda: adapted_linear_triton(x, weight, bias, a, b, layout), x, a, b, dy)
        errors = [rel_err(g, w) for g, w in zip(got, want)]
        assert max(errors) <= BF16_TOL, errors
    _, a_into, b_into = _grad_buffers(case, gen)
    a_into.zero_(), b_into.zero_()
    with tuning.override(**MODES[mode], poison=True):  # weight gradients straight into fp32 buffers
        adapted_linear_triton(x, weight, bias, a, b, layout, grads_into=(a_into, b_into)).backward(dy)
    errors = [rel_err(a_into, want[2]), rel_err(b_into, want[3])]
    assert max(errors) <= BF16_TOL, errors
