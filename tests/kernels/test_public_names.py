"""The package's public functions stay bound after the Triton kernels are imported.

``dispatch`` imports the Triton modules lazily, on the first call that takes the Triton path.
Importing a submodule binds it as an attribute of its package, so a submodule named like a
public function would replace that function for every later caller of
``plora_hpo.kernels.<name>``.
"""

from __future__ import annotations

import inspect
import pkgutil

import pytest
import torch

import plora_hpo.kernels as kernels
from plora_hpo.kernels import _tuning as tuning
from plora_hpo.kernels import dispatch
from tests.kernels._oracle import random_inputs, rel_err
from tests.kernels.test_adapted_linear import CASES, _frozen, _got, _want
from tests.kernels.test_triton_lora import DEVICE, FP32_TOL, _tuning_for


def _node_names(y: torch.Tensor) -> set[str]:
    """Names of the autograd nodes that y's gradient passes through."""
    seen, todo = {}, [y.grad_fn]
    while todo:
        node = todo.pop()
        if node is not None and id(node) not in seen:
            seen[id(node)] = type(node).__name__
            todo.extend(next_node for next_node, _ in node.next_functions)
    return set(seen.values())


def test_no_submodule_is_named_like_a_public_name() -> None:
    submodules = {info.name for info in pkgutil.iter_modules(kernels.__path__)}
    assert not submodules & set(kernels.__all__)


def test_adapted_linear_stays_a_function_across_triton_calls(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two calls through the package attribute on the Triton path: the second must reach the
    same function as the first, and both must match the fp64 reference."""
    monkeypatch.setenv("PLORA_KERNELS", "triton")
    monkeypatch.delenv("PLORA_KERNELS_OP", raising=False)
    case = CASES["rank0_and_odd"]
    gen = torch.Generator().manual_seed(13)
    layout = case.layout(gen)
    x, a, b, _, dy = random_inputs(case, gen, torch.float32, torch.float32, DEVICE)
    weight, bias = _frozen(case, gen, torch.float32, True)
    want = _want(x, weight, bias, a, b, layout, dy)
    for call in range(2):
        assert inspect.isfunction(kernels.adapted_linear), (call, kernels.adapted_linear)
        assert kernels.adapted_linear is dispatch.adapted_linear
        with tuning.override(**_tuning_for("direct")):
            y = kernels.adapted_linear(x, weight, bias, a, b, layout)
            assert "_AdaptedLinearBackward" in _node_names(y)  # the Triton node, not the reference
            got = _got(lambda y=y: y, x, a, b, dy)
        errors = [rel_err(g, w) for g, w in zip(got, want)]
        assert max(errors) <= FP32_TOL, (call, dict(zip(("y", "dx", "dA", "dB"), errors)))
    assert inspect.isfunction(kernels.adapted_linear)
