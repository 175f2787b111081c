"""Prebuilt adapter factors change nothing; the dense small-batch path computes the same function."""

from __future__ import annotations

import copy
import random

import pytest
import torch
from peft import PeftModel

from plora_hpo.evaluation import GenerationJob, generate_greedy
from plora_hpo.evaluation import generation as generation_module
from plora_hpo.evaluation.frozen import _row_scales, frozen_adapter_weights, full_route
from plora_hpo.kernels import SegmentLayout
from tests.engine.conftest import VOCAB

from .test_generation import EOS, RANKS, jobs_for, peft_generate, tiny_pack


def test_full_route_lists_every_adapter_in_order():
    assert full_route(["b", "b", "c"], ["a", "b", "c", "d"]) == [("a", 0), ("b", 2), ("c", 1), ("d", 0)]
    assert full_route([], ["a"]) == [("a", 0)]
    with pytest.raises(ValueError, match="not grouped"):
        full_route(["c", "b"], ["a", "b", "c"])
    with pytest.raises(ValueError, match="not grouped"):
        full_route(["b", "c", "b"], ["a", "b", "c"])


def _rows(seed: int, rows: int, length: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (rows, length), generator=generator)


def _logits(packed, ids: torch.Tensor, groups: list[tuple[str, int]]) -> torch.Tensor:
    with torch.no_grad(), packed.route(groups):
        return packed.model(ids).logits


@pytest.mark.parametrize("length", [1, 5])
def test_prebuilt_and_dense_paths_match_the_layer_path(tmp_path, length):
    _, packed, _ = tiny_pack("qwen2", tmp_path)
    order = list(RANKS)  # a (r4), b (r8), c (r16)
    ids = _rows(seed=length, rows=6, length=length)
    groups = [("a", 2), ("b", 0), ("c", 4)]  # an adapter without rows in this batch
    present = [(a, n) for a, n in groups if n]
    want = _logits(packed, ids, present)
    with frozen_adapter_weights(packed, order) as frozen:
        assert frozen
        prebuilt = _logits(packed, ids, groups)
        other = _logits(packed, ids, present)  # a route over other adapters falls through
    with frozen_adapter_weights(packed, order, dense_max_tokens=10**6):
        dense = _logits(packed, ids, groups)
    assert torch.equal(prebuilt, want) and torch.equal(other, want)
    torch.testing.assert_close(dense, want, rtol=1e-5, atol=1e-5)
    layer = next(iter(packed.layers.values()))
    assert "_weights" not in vars(layer) and "forward" not in vars(layer)  # restored on exit


def test_prebuilt_factors_cast_once_equal_the_per_call_casts(tmp_path):
    """fp32 masters under a bf16 model: casting the concatenation is the per-call path bit for bit."""
    _, packed, _ = tiny_pack("qwen2", tmp_path)
    packed.model.to(torch.bfloat16)
    for layer in packed.layers.values():
        for p in (*layer.lora_A.values(), *layer.lora_B.values()):
            p.data = p.data.float()
    ids = _rows(seed=8, rows=4, length=3)
    groups = [("a", 1), ("b", 2), ("c", 1)]
    want = _logits(packed, ids, groups)
    with frozen_adapter_weights(packed, list(RANKS)) as frozen:
        assert frozen
        assert torch.equal(_logits(packed, ids, groups), want)


def test_row_scales_keep_inexact_scalings_in_fp32():
    """rsLoRA scalings (alpha/√r) are not exact in bf16: the dense path then scales in fp32."""
    like = torch.zeros(1, dtype=torch.bfloat16)
    exact = SegmentLayout.from_counts([2, 1, 3], [4, 8, 2], [2.0, 0.5, 4.0])
    inexact = SegmentLayout.from_counts([2, 1, 3], [4, 8, 2], [2.0, 16 / 8**0.5, 4.0])
    assert _row_scales(exact, 6, like).dtype == torch.bfloat16
    scale = _row_scales(inexact, 6, like)
    assert scale.dtype == torch.float32
    assert torch.equal(scale[2, 4:12], torch.full((8,), 16 / 8**0.5))  # not rounded to bf16
    assert torch.equal(scale[:2, :4], torch.full((2, 4), 2.0)) and torch.equal(scale[3:, 12:], torch.full((3, 2), 4.0))
    assert int((scale != 0).sum()) == 2 * 4 + 8 + 3 * 2  # each adapter's rows × its rank columns only


def test_dense_path_matches_the_layer_path_in_bf16(tmp_path):
    """The dense small-batch path and the kernels' path agree to bf16 rounding."""
    _, packed, _ = tiny_pack("llama", tmp_path)
    packed.model.to(torch.bfloat16)
    for layer in packed.layers.values():  # fp32 adapter masters, as on the GPU
        for p in (*layer.lora_A.values(), *layer.lora_B.values()):
            p.data = p.data.float()
    ids = _rows(seed=7, rows=4, length=1)
    groups = [("a", 1), ("b", 2), ("c", 1)]
    want = _logits(packed, ids, groups).float()
    with frozen_adapter_weights(packed, list(RANKS), dense_max_tokens=64):
        dense = _logits(packed, ids, groups).float()
    assert (dense - want).abs().max() < 0.05 * want.abs().max()


def test_generation_through_the_dense_path_matches_peft(tmp_path, monkeypatch):
    base, packed, dirs = tiny_pack("mistral", tmp_path)
    monkeypatch.setattr(generation_module, "_dense_tokens", lambda device: 64)
    jobs = jobs_for(seed=4, n_prompts=4)
    outputs = generate_greedy(packed, jobs, max_batch_size=6, eos_token_ids=[EOS], refill_fraction=0.3)
    models = {a: PeftModel.from_pretrained(copy.deepcopy(base), d).eval() for a, d in dirs.items()}
    for job, out in zip(jobs, outputs):
        assert out == peft_generate(models[job.adapter_id], job), job


def test_adapter_changes_between_calls_are_seen(tmp_path):
    """The prebuilt factors live for one call: the next call sees updated weights."""
    _, packed, _ = tiny_pack("llama", tmp_path)
    rng = random.Random(0)
    jobs = [GenerationJob(a, tuple(rng.randrange(3, VOCAB) for _ in range(6)), 5) for a in RANKS]
    before = generate_greedy(packed, jobs, max_batch_size=3)
    with torch.no_grad():
        for layer in packed.layers.values():
            layer.lora_B["b"].mul_(-3.0)
    after = generate_greedy(packed, jobs, max_batch_size=3)
    assert before[0] == after[0] and before[2] == after[2] and before[1] != after[1]
