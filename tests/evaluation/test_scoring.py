"""Batched multi-adapter log-likelihoods equal a PEFT forward of each request alone."""

from __future__ import annotations

import copy
import math
import random

import pytest
import torch
from peft import PeftModel

from plora_hpo.evaluation import AdapterResidency, ScoreRequest, ScoringStats, score_continuations
from tests.engine.conftest import VOCAB

from .test_generation import FAMILIES, RANKS, tiny_pack


def peft_score(model, request: ScoreRequest, max_length: int) -> tuple[float, bool]:
    """What lm-eval's HF model computes for one request: truncate left, read the last positions."""
    tokens = (list(request.context) + list(request.continuation))[-(max_length + 1) :]
    logits = model(torch.tensor([tokens[:-1]])).logits[0]
    logprobs = torch.log_softmax(logits, dim=-1)[-len(request.continuation) :]
    target = torch.tensor(request.continuation)
    score = float(logprobs.gather(1, target[:, None]).sum())
    return score, bool((logprobs.argmax(-1) == target).all())


def make_requests(seed: int) -> list[ScoreRequest]:
    rng = random.Random(seed)
    requests = []
    for _ in range(7):
        context = tuple(rng.randrange(1, VOCAB) for _ in range(rng.randint(1, 30)))
        for _ in range(2):  # two choices per context, sometimes several tokens long
            requests.append(ScoreRequest(context, tuple(rng.randrange(1, VOCAB) for _ in range(rng.randint(1, 3)))))
    requests.append(ScoreRequest(requests[0].context, requests[0].continuation))  # a repeat
    return requests


@pytest.mark.parametrize("family", FAMILIES)
def test_scores_match_peft_per_request(family, tmp_path):
    base, packed, dirs = tiny_pack(family, tmp_path)
    requests = make_requests(seed=3)
    max_length = 24  # some requests are truncated from the left, as HFLM does
    stats = ScoringStats()
    scores = score_continuations(packed, list(RANKS), requests, batch_size=5, max_length=max_length, stats=stats)
    for adapter_id in RANKS:
        model = PeftModel.from_pretrained(copy.deepcopy(base), dirs[adapter_id]).eval()
        with torch.no_grad():
            for request, (score, greedy) in zip(requests, scores[adapter_id]):
                want, want_greedy = peft_score(model, request, max_length)
                assert math.isclose(score, want, rel_tol=1e-5, abs_tol=1e-5), (score, want)
                assert greedy == want_greedy
    assert stats.unique_inputs < len(requests)  # the repeat shared a row
    assert stats.rows == len(RANKS) * stats.unique_inputs


def test_one_token_choices_of_a_context_share_one_row(tmp_path):
    _, packed, _ = tiny_pack("llama", tmp_path)
    context = (5, 6, 7, 8)
    requests = [ScoreRequest(context, (t,)) for t in (11, 12, 13)]
    stats = ScoringStats()
    scores = score_continuations(packed, ["a", "c"], requests, batch_size=8, max_length=64, stats=stats)
    assert stats.unique_inputs == 1 and stats.forwards == 1 and stats.rows == 2
    probs = [math.exp(s) for s, _ in scores["a"]]
    assert len(set(probs)) == 3 and sum(probs) < 1


def test_paged_scoring_is_identical(tmp_path):
    _, packed, _ = tiny_pack("mistral", tmp_path)
    requests = make_requests(seed=4)
    plain = score_continuations(packed, list(RANKS), requests, batch_size=6, max_length=64)
    sizes = {a: AdapterResidency(packed, list(RANKS), budget_bytes=None).nbytes(a) for a in RANKS}
    residency = AdapterResidency(packed, list(RANKS), budget_bytes=sizes["c"])
    with residency:
        paged = score_continuations(packed, list(RANKS), requests, batch_size=6, max_length=64, residency=residency)
    assert residency.stats.swaps_in >= len(RANKS)
    for adapter_id in RANKS:
        for (a, ga), (b, gb) in zip(plain[adapter_id], paged[adapter_id]):
            assert math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-6) and ga == gb
