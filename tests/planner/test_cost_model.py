"""Cost model: memory and step time move the right way, and the PEFT prior matches the H200 PEFT measurements."""

from __future__ import annotations

import pytest

from plora_hpo.errors import ConfigError, PloraError
from plora_hpo.planner.cost_model import GIB, CostModel, GpuSpec, Workload
from plora_hpo.planner.peft_h200 import PEFT_H200_REFERENCE
from plora_hpo.shapes import shape_by_name
from tests.planner._configs import config

H200 = GpuSpec("H200", 139.8)


def model(name: str = "qwen2.5-1.5b", **workload) -> CostModel:
    return CostModel(Workload(shape_by_name(name), 512, **workload), H200)


def test_memory_grows_with_rank_batch_and_pack_size():
    cm = model()
    assert cm.peak_memory([config(rank=64)]) > cm.peak_memory([config(rank=8)])
    assert cm.peak_memory([config(batch=8)]) > cm.peak_memory([config(batch=2)])
    assert cm.peak_memory([config(), config()]) > cm.peak_memory([config()])


def test_memory_parts():
    cm = model("qwen2.5-7b")
    alone = cm.memory_terms([config()])
    assert alone.fixed > shape_by_name("qwen2.5-7b").total_params() * 2  # weights + logits chunk
    assert cm.peak_memory([config()], degree=4) < cm.peak_memory([config()], degree=1)
    assert model(checkpointing=True).peak_memory([config(batch=8)]) < model().peak_memory([config(batch=8)])
    # Full-vocabulary logits (PEFT) cost far more than one chunk at large batch.
    assert model(logits_chunk_tokens=None).peak_memory([config(batch=16)]) > model().peak_memory([config(batch=16)])


def test_step_time_grows_with_rank_and_batch_and_packs_amortise_overhead():
    cm = model("qwen2.5-7b")
    assert cm.step_seconds([config(rank=128, batch=8)]) > cm.step_seconds([config(rank=8, batch=8)])
    assert cm.step_seconds([config(batch=16)]) > cm.step_seconds([config(batch=8)])
    one, four = cm.step_seconds([config()]), cm.step_seconds([config()] * 4)
    assert one < four < 4 * one


def test_pack_seconds_counts_phases_as_adapters_leave():
    cm = model()
    short, long = config(batch=8), config(batch=2)
    together = cm.pack_seconds([short, long], [100, 400])
    expected = 100 * cm.step_seconds([short, long]) + 300 * cm.step_seconds([long])
    assert together == pytest.approx(expected)


def test_members_that_take_turns_train_as_many_at_once_as_fit():
    """``pack.rotate``: each turn the members furthest behind train, as many as memory (and the
    count) hold; what all fit at once runs as a plain pack."""
    cm = model()
    members = [config(batch=4, seed=i) for i in range(6)]
    four = cm.peak_memory(members[:4])
    assert cm.peak_memory(members[:5]) > four
    # turns of one step: 48 adapter steps, four at a time, are 12 full steps
    assert cm.rotating_pack_seconds(members, [8] * 6, memory_limit=four, turns=8) == pytest.approx(
        12 * cm.step_seconds(members[:4])
    )
    assert cm.rotating_pack_seconds(members, [8] * 6, memory_limit=cm.peak_memory(members), max_members=3) == (
        pytest.approx(16 * cm.step_seconds(members[:3]))
    )
    turns = cm.rotating_pack_seconds(members, [300] * 6, memory_limit=four)
    apart = cm.pack_seconds(members[:4], [300] * 4) + cm.pack_seconds(members[4:], [300] * 2)
    assert turns < apart  # the two left over alone would pay a full step's fixed cost for two
    roomy = cm.peak_memory(members)
    assert cm.rotating_pack_seconds(members, [300] * 6, memory_limit=roomy) == cm.pack_seconds(members, [300] * 6)

    # Smaller members: more of them fit at once.
    small = [config(batch=1, seed=i) for i in range(40)]
    n = max(k for k in range(1, 41) if cm.peak_memory(small[:k]) <= four)
    assert 4 < n < 20
    assert cm.rotating_pack_seconds(small[: 2 * n], [8] * (2 * n), memory_limit=four) == pytest.approx(
        16 * cm.step_seconds(small[:n])
    )

    # A member longer than the others' turns together trains on alone once they are done.
    long, short = config(rank=64, batch=8), config(rank=8, batch=2)
    alone = cm.peak_memory([long])
    seconds = cm.rotating_pack_seconds([long, short, short], [1000, 10, 10], memory_limit=alone * 2, max_members=2)
    assert seconds == pytest.approx(20 * cm.step_seconds([long, short]) + 980 * cm.step_seconds([long]))


def test_multi_gpu_adds_communication():
    cm = model("qwen2.5-7b")
    assert cm.step_terms([config()], degree=1).comm == 0
    assert cm.step_terms([config()], degree=2).comm > 0


@pytest.mark.parametrize("degree", [2, 4, 8])
def test_tensor_parallel_splits_projections_and_heads_not_tokens(degree):
    """Every GPU of a tensor-parallel pack holds the replicated parts whole and runs all the pack's
    tokens: per GPU, memory and time shrink by less than the degree, and all-reduces grow with tokens."""
    cm = model("qwen2.5-7b", micro_batch_tokens=2048)
    shape = cm.workload.shape
    pack = [config(16, 8), config(64, 4)]
    linear = shape.decoder_linear_params() * 2
    assert cm.weight_bytes(degree) == pytest.approx(cm.weight_bytes(1) - linear * (1 - 1 / degree))
    assert cm.micro_batches(pack, degree) == cm.micro_batches(pack) == 3  # 12 rows, 4 a forward
    assert cm.micro_batch_tokens(pack, degree) == cm.micro_batch_tokens(pack) == 2048
    one, split = cm.memory_terms(pack), cm.memory_terms(pack, degree)
    assert one.activations / degree < split.activations < one.activations
    assert one.adapters / degree < split.adapters < one.adapters
    t1, td = cm.step_terms(pack), cm.step_terms(pack, degree)
    assert t1.base / degree < td.base < t1.base  # the LM head is not split
    assert t1.lora / degree < td.lora < t1.lora  # replicated factors' work is not split
    assert td.launch == t1.launch and td.fixed == t1.fixed
    twice = cm.step_terms([config(16, 16)], degree).comm
    assert twice == pytest.approx(2 * cm.step_terms([config(16, 8)], degree).comm, rel=0.01)
    # a ring sends 2(d-1)/d of the bytes: seconds grow with the degree, towards twice degree 2's
    assert td.comm == pytest.approx(cm.step_terms(pack, 2).comm * 2 * (degree - 1) / degree)


@pytest.mark.parametrize(("name", "batch", "tokens_per_s", "peak_gib"), PEFT_H200_REFERENCE)
def test_prior_matches_h200_reference(name, batch, tokens_per_s, peak_gib):
    cm = model(name, logits_chunk_tokens=None, engine="peft")
    configs = [config(rank=16, batch=batch)]
    assert cm.peak_memory(configs) / GIB == pytest.approx(peak_gib, rel=0.02)
    assert cm.step_seconds(configs) == pytest.approx(batch * 512 / tokens_per_s, rel=0.15)


def test_cpu_host_runs_add_host_and_device_time():
    cm = CostModel(Workload(shape_by_name("smollm2-135m"), 128, dtype_bytes=4), GpuSpec.host(8))
    terms = cm.step_terms([config()])
    assert cm.step_seconds([config()]) == pytest.approx(cm.launch_seconds(terms) + cm.device_seconds(terms))
    assert cm.peak_memory([config()]) < 8 * GIB


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"name": "H200", "memory_gib": -1}, "positive"),
        ({"name": "H200", "memory_gib": 0}, "--gpu-memory-gib"),
        ({"name": " ", "memory_gib": 80}, "GPU name"),
        ({"name": "H200", "memory_gib": 80, "matmul_tflops": 0}, "matmul_tflops"),
    ],
)
def test_gpu_spec_rejects_bad_values(kwargs, words):
    with pytest.raises(PloraError, match=words):
        GpuSpec(**kwargs)


def test_workload_rejects_unknown_target_and_bad_lengths():
    shape = shape_by_name("qwen2.5-0.5b")
    with pytest.raises(ConfigError, match="unknown target module 'qkv'"):
        Workload(shape, 512, targets=("qkv",))
    with pytest.raises(ConfigError, match="seq_len"):
        Workload(shape, 0)
