"""Continuous batching across adapters equals greedy ``generate`` of PEFT, one prompt at a time."""

from __future__ import annotations

import copy
import random

import pytest
import torch
from peft import PeftModel

from plora_hpo.adapter import AdapterConfig
from plora_hpo.engine import PackedLoraModel, export_peft_adapter
from plora_hpo.evaluation import AdapterResidency, GenerationJob, GenerationStats, StopWindows, generate_greedy
from tests.engine.conftest import VOCAB, tiny_model

from .conftest import TARGETS, randomize_b

EOS = 2
FAMILIES = ("llama", "qwen2", "mistral")
RANKS = {"a": 4, "b": 8, "c": 16}


def tiny_pack(family: str, tmp_path) -> tuple[torch.nn.Module, PackedLoraModel, dict]:
    base = tiny_model(family)
    packed = PackedLoraModel(copy.deepcopy(base), TARGETS)
    dirs = {}
    for i, (adapter_id, rank) in enumerate(RANKS.items()):
        packed.add_adapter(
            adapter_id, AdapterConfig(rank=rank, alpha=2.0 * rank, learning_rate=1e-3, batch_size=1, seed=i)
        )
        randomize_b(packed, adapter_id, seed=i, std=0.3)
        dirs[adapter_id] = export_peft_adapter(packed, adapter_id, tmp_path / adapter_id, "tiny")
    return base, packed, dirs


def jobs_for(seed: int, n_prompts: int = 6) -> list[GenerationJob]:
    rng = random.Random(seed)
    prompts = [tuple(rng.randrange(3, VOCAB) for _ in range(rng.randint(2, 25))) for _ in range(n_prompts)]
    return [GenerationJob(a, p, rng.randint(1, 10)) for p in prompts for a in RANKS]


def peft_generate(model, job: GenerationJob) -> list[int]:
    out = model.generate(
        torch.tensor([job.prompt]),
        max_new_tokens=job.max_new_tokens,
        do_sample=False,
        eos_token_id=EOS,
        pad_token_id=0,
    )
    return out[0, len(job.prompt) :].tolist()


@pytest.mark.parametrize("family", FAMILIES)
def test_continuous_batching_matches_peft_generate(family, tmp_path):
    base, packed, dirs = tiny_pack(family, tmp_path)
    jobs = jobs_for(seed=1)
    stats = GenerationStats()
    outputs = generate_greedy(packed, jobs, max_batch_size=5, eos_token_ids=[EOS], refill_fraction=0.2, stats=stats)
    assert stats.peak_rows == 5 and stats.admissions > 3  # rows left and joined many times
    models = {a: PeftModel.from_pretrained(copy.deepcopy(base), d).eval() for a, d in dirs.items()}
    for job, out in zip(jobs, outputs):
        assert out == peft_generate(models[job.adapter_id], job), job
    assert len({tuple(o) for o in outputs}) > len(outputs) // 2  # adapters and prompts differ


def test_paging_and_refill_policy_do_not_change_tokens(tmp_path):
    _, packed, _ = tiny_pack("qwen2", tmp_path)
    jobs = jobs_for(seed=2, n_prompts=4)
    jobs.sort(key=lambda j: j.adapter_id)  # adapter-major: one adapter resident at a time suffices
    plain = generate_greedy(packed, jobs, max_batch_size=16)
    one_at_a_time = generate_greedy(packed, jobs, max_batch_size=3, refill_fraction=1.0)
    sizes = [AdapterResidency(packed, list(RANKS), budget_bytes=None).nbytes(a) for a in RANKS]
    residency = AdapterResidency(packed, list(RANKS), budget_bytes=max(sizes))
    with residency:
        paged = generate_greedy(packed, jobs, max_batch_size=4, residency=residency)
    assert plain == one_at_a_time == paged
    assert residency.stats.swaps_in == len(RANKS) and residency.stats.swaps_out == len(RANKS) - 1


def test_stop_strings_end_a_sequence_where_its_text_appears(tmp_path):
    _, packed, _ = tiny_pack("llama", tmp_path)
    job = GenerationJob("b", (5, 9, 11, 17, 23), 10)
    free = generate_greedy(packed, [job], max_batch_size=2)[0]
    assert len(free) == 10
    stop_token = free[3]
    windows = StopWindows(decode=lambda seqs: ["".join(f"<{t}>" for t in s) for s in seqs], encode=lambda s: [0])
    stopped = generate_greedy(
        packed,
        [GenerationJob("b", job.prompt, 10, stop_strings=(f"<{stop_token}>",))],
        max_batch_size=2,
        stop_windows=windows,
    )[0]
    assert stopped == free[: free.index(stop_token) + 1]


def test_stop_strings_need_a_decoder(tmp_path):
    _, packed, _ = tiny_pack("llama", tmp_path)
    with pytest.raises(ValueError, match="stop_windows"):
        generate_greedy(packed, [GenerationJob("a", (1, 2), 3, stop_strings=("x",))], max_batch_size=1)
