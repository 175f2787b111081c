"""Evaluation drives the engine through its public methods only: it never writes attributes of
the engine's layers or model handle, and never replaces a layer's ``forward``."""

from __future__ import annotations

import sys

import pytest
import torch

from plora_hpo.engine.packed_lora import PackedLoraLinear, PackedLoraModel
from plora_hpo.evaluation import generate_greedy, score_continuations
from plora_hpo.evaluation import generation as generation_module
from plora_hpo.evaluation import scoring as scoring_module
from plora_hpo.evaluation.frozen import frozen_adapter_weights

from .test_frozen import _logits, _rows
from .test_generation import EOS, RANKS, jobs_for, tiny_pack
from .test_scoring import make_requests


def _outside_engine(module: str) -> bool:
    return not module.startswith(("plora_hpo.engine", "torch"))


@pytest.fixture
def foreign_writes(monkeypatch) -> list[tuple[str, str, str]]:
    """``(calling module, class, attribute)`` of every attribute set or deleted on a packed layer
    or model handle by code outside the engine (and torch) while the test runs."""
    writes: list[tuple[str, str, str]] = []

    def recording(cls: type, method: str) -> None:
        original = getattr(cls, method)

        def wrapper(self, name, *args):
            caller = sys._getframe(1).f_globals.get("__name__", "")
            if _outside_engine(caller):
                writes.append((caller, type(self).__name__, name))
            return original(self, name, *args)

        monkeypatch.setattr(cls, method, wrapper)

    for cls in (PackedLoraLinear, PackedLoraModel):
        recording(cls, "__setattr__")
        recording(cls, "__delattr__")
    return writes


@pytest.mark.parametrize("dense_max_tokens, segment_gemms", [(0, False), (10**6, False), (0, True)])
def test_frozen_view_leaves_layer_attributes_and_forward_alone(
    tmp_path, foreign_writes, dense_max_tokens, segment_gemms
):
    _, packed, _ = tiny_pack("qwen2", tmp_path)
    layers = list(packed.layers.values())
    keys_before = [set(vars(layer)) for layer in layers]
    forward = PackedLoraLinear.forward
    ids = _rows(seed=3, rows=6, length=4)
    groups = [("a", 2), ("b", 1), ("c", 3)]
    with frozen_adapter_weights(
        packed, list(RANKS), dense_max_tokens=dense_max_tokens, segment_gemms=segment_gemms
    ) as frozen:
        assert frozen
        _logits(packed, ids, groups)
        assert [set(vars(layer)) for layer in layers] == keys_before
        assert all(layer.frozen_factors is not None for layer in layers)
        assert all((layer.fast_path is not None) == (dense_max_tokens > 0 or segment_gemms) for layer in layers)
        assert type(layers[0]).forward is forward and "forward" not in vars(layers[0])
    assert [set(vars(layer)) for layer in layers] == keys_before
    assert all(layer.frozen_factors is None and layer.fast_path is None for layer in layers)
    assert foreign_writes == []


def test_scoring_and_generation_write_nothing_on_engine_objects(tmp_path, monkeypatch, foreign_writes):
    _, packed, _ = tiny_pack("llama", tmp_path)
    monkeypatch.setattr(scoring_module, "segment_gemms_on", lambda device: True)
    monkeypatch.setattr(generation_module, "segment_gemms_on", lambda device: True)
    monkeypatch.setattr(generation_module, "_dense_tokens", lambda device: 64)
    layers = list(packed.layers.values())
    keys_before = [set(vars(layer)) for layer in layers]
    score_continuations(packed, list(RANKS), make_requests(seed=2)[:4], batch_size=6, max_length=24)
    generate_greedy(packed, jobs_for(seed=3, n_prompts=2), max_batch_size=4, eos_token_ids=[EOS])
    assert foreign_writes == []
    assert [set(vars(layer)) for layer in layers] == keys_before
    assert all("forward" not in vars(layer) and layer.frozen_factors is None for layer in layers)


def test_frozen_views_nest_and_restore(tmp_path):
    _, packed, _ = tiny_pack("qwen2", tmp_path)
    layer = next(iter(packed.layers.values()))
    with packed.frozen_view(["a", "b", "c"]):
        outer = layer.frozen_factors
        with packed.frozen_view(["c"]):
            assert layer.frozen_factors.adapter_ids == ("c",)
        assert layer.frozen_factors is outer
    assert layer.frozen_factors is None
    with pytest.raises(ValueError, match="unknown"), packed.frozen_view(["a", "nope"]):
        pass
    assert layer.frozen_factors is None


def test_frozen_factors_are_the_per_call_concatenation(tmp_path):
    _, packed, _ = tiny_pack("qwen2", tmp_path)
    with packed.frozen_view(["c", "a"]):
        for layer in packed.layers.values():
            factors = layer.frozen_factors
            assert torch.equal(factors.a_cat, torch.cat([layer.lora_A["c"], layer.lora_A["a"]]))
            assert torch.equal(factors.b_cat, torch.cat([layer.lora_B["c"], layer.lora_B["a"]], dim=1))
            assert not factors.a_cat.requires_grad
