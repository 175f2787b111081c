"""cuBLAS GEMMs per adapter segment (batched per rank run) compute what the packed layers compute."""

from __future__ import annotations

import copy
import math

import torch
from peft import PeftModel

from plora_hpo.adapter import AdapterConfig
from plora_hpo.evaluation import generate_greedy, score_continuations, segment_gemms
from plora_hpo.evaluation import generation as generation_module
from plora_hpo.evaluation import scoring as scoring_module
from plora_hpo.evaluation.frozen import frozen_adapter_weights
from plora_hpo.evaluation.segment_gemms import Run, rank_runs, uniform_span
from plora_hpo.kernels import SegmentLayout

from .conftest import randomize_b
from .test_frozen import _logits, _rows
from .test_generation import EOS, jobs_for, peft_generate, tiny_pack
from .test_scoring import make_requests, peft_score


def test_runs_join_neighbours_of_equal_rank_and_scaling():
    layout = SegmentLayout.from_counts([3] * 7, [4, 4, 8, 8, 4, 0, 4], [2.0, 2.0, 2.0, 1.0, 2.0, 1.0, 2.0])
    assert rank_runs(layout) == (
        Run(first=0, count=2, rank=4, rank_offset=0, scaling=2.0),
        Run(first=2, count=1, rank=8, rank_offset=8, scaling=2.0),
        Run(first=3, count=1, rank=8, rank_offset=16, scaling=1.0),
        Run(first=4, count=1, rank=4, rank_offset=24, scaling=2.0),
        Run(first=6, count=1, rank=4, rank_offset=28, scaling=2.0),  # a rank-0 adapter splits the run
    )


def test_uniform_span_needs_equal_segments_covering_the_batch():
    ranks, scalings = [4, 8, 4], [1.0, 1.0, 1.0]
    assert uniform_span(SegmentLayout.from_counts([5, 5, 5], ranks, scalings), 15) == 5
    assert uniform_span(SegmentLayout.from_counts([5, 5, 5], ranks, scalings), 16) == 0  # trailing base rows
    assert uniform_span(SegmentLayout.from_counts([5, 0, 10], ranks, scalings), 15) == 0
    assert uniform_span(SegmentLayout.from_counts([5, 5, 5], ranks, scalings, token_start=1), 16) == 0


def _pack_with_twin(tmp_path):
    """The tiny pack plus ``a2``: a second rank-4 adapter with ``a``'s scaling (a run of two)."""
    base, packed, dirs = tiny_pack("qwen2", tmp_path)
    packed.add_adapter("a2", AdapterConfig(rank=4, alpha=8.0, learning_rate=1e-3, batch_size=1, seed=7))
    randomize_b(packed, "a2", seed=7, std=0.3)
    return base, packed, dirs


def test_segment_gemms_match_the_layer_path(tmp_path, monkeypatch):
    _, packed, _ = _pack_with_twin(tmp_path)
    order = ["a", "a2", "b", "c"]
    ids = _rows(seed=1, rows=8, length=5)
    uniform = [(a, 2) for a in order]
    uneven = [("a", 3), ("a2", 0), ("b", 1), ("c", 4)]
    want_uniform, want_uneven = _logits(packed, ids, uniform), _logits(packed, ids, uneven)
    with frozen_adapter_weights(packed, order, segment_gemms=True):
        batched = _logits(packed, ids, uniform)  # batched GEMMs per rank run
        per_segment = _logits(packed, ids, uneven)
        runs = next(iter(packed.layers.values())).fast_path.segments.runs
    assert [(r.first, r.count) for r in runs] == [(0, 2), (2, 1), (3, 1)]
    torch.testing.assert_close(batched, want_uniform, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(per_segment, want_uneven, rtol=1e-5, atol=1e-5)
    monkeypatch.setattr(segment_gemms, "MAX_GROUPS", 2)  # too many GEMM pairs: the layer's own path
    with frozen_adapter_weights(packed, order, segment_gemms=True):
        assert torch.equal(_logits(packed, ids, uneven), want_uneven)
    layer = next(iter(packed.layers.values()))
    assert "forward" not in vars(layer)  # restored on exit


def test_scoring_through_segment_gemms_matches_peft(tmp_path, monkeypatch):
    base, packed, dirs = tiny_pack("llama", tmp_path)
    monkeypatch.setattr(scoring_module, "segment_gemms_on", lambda device: True)
    requests = make_requests(seed=5)
    adapters = ["c", "a", "b"]  # routed as a, b, c (by rank); answered per id whatever the order
    scores = score_continuations(packed, adapters, requests, batch_size=6, max_length=24)
    assert list(scores) == adapters
    for adapter_id in adapters:
        model = PeftModel.from_pretrained(copy.deepcopy(base), dirs[adapter_id]).eval()
        with torch.no_grad():
            for request, (score, greedy) in zip(requests, scores[adapter_id]):
                want, want_greedy = peft_score(model, request, 24)
                assert math.isclose(score, want, rel_tol=1e-5, abs_tol=1e-5), (score, want)
                assert greedy == want_greedy


def test_generation_prefill_through_segment_gemms_matches_peft(tmp_path, monkeypatch):
    base, packed, dirs = tiny_pack("mistral", tmp_path)
    monkeypatch.setattr(generation_module, "segment_gemms_on", lambda device: True)
    jobs = jobs_for(seed=6, n_prompts=4)
    outputs = generate_greedy(packed, jobs, max_batch_size=5, eos_token_ids=[EOS], refill_fraction=0.3)
    models = {a: PeftModel.from_pretrained(copy.deepcopy(base), d).eval() for a, d in dirs.items()}
    for job, out in zip(jobs, outputs):
        assert out == peft_generate(models[job.adapter_id], job), job
