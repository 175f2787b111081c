"""Whole plans and the online job planner: the schedule invariants, checked on random sweeps."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from plora_hpo.errors import PloraError
from plora_hpo.planner.cost_model import CostModel, GpuSpec, Workload
from plora_hpo.planner.plan import plan_packs
from plora_hpo.planner.simulate import JobPlanner, UnschedulableError, list_schedule, run_to_completion
from plora_hpo.shapes import shape_by_name
from tests.planner._configs import config

SETTINGS = settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def sweeps(draw):
    n = draw(st.integers(3, 24))
    configs = [
        config(draw(st.sampled_from([4, 16, 64])), draw(st.sampled_from([1, 2, 4, 8])), seed=i) for i in range(n)
    ]
    steps = draw(st.lists(st.sampled_from([20, 50, 200]), min_size=n, max_size=n))
    return {
        "configs": configs,
        "steps": steps,
        "shape": draw(st.sampled_from(["smollm2-135m", "qwen2.5-0.5b"])),
        "seq_len": draw(st.sampled_from([256, 1024])),
        "gpu": GpuSpec("H200", draw(st.sampled_from([4.0, 8.0, 16.0]))),
        "num_gpus": draw(st.integers(1, 6)),
        "max_degree": draw(st.sampled_from([None, 1, 2])),
        "max_pack_size": draw(st.sampled_from([None, 3])),
        "allow_unschedulable": True,
    }


def check_invariants(schedule, n_configs: int, memory_limit: float) -> None:
    planned = sorted(c for p in schedule.packs for c in p.configs)
    assert sorted(planned + schedule.unschedulable) == list(range(n_configs)), "each config exactly once"
    for p in schedule.packs:
        assert p.degree & (p.degree - 1) == 0 and p.degree == len(p.gpus) == len(set(p.gpus))
        assert all(0 <= g < schedule.num_gpus for g in p.gpus)
        assert p.memory_bytes <= memory_limit
        assert p.end > p.start >= 0
        assert 1 <= p.width <= len(p.configs)
        assert p.width == len(p.configs) or p.degree == 1, "only single-GPU packs take turns"
    # No GPU runs two packs at once: packs sharing a GPU do not overlap in time.
    for a in schedule.packs:
        for b in schedule.packs:
            if a.pack_id < b.pack_id and set(a.gpus) & set(b.gpus):
                assert a.end <= b.start + 1e-9 or b.end <= a.start + 1e-9
    assert schedule.makespan == pytest.approx(max(p.end for p in schedule.packs))
    if all(p.width == len(p.configs) for p in schedule.packs):  # the bound of packs that train to their end
        assert schedule.makespan >= schedule.baselines.lower_bound * (1 - 1e-6)
    for baseline in (schedule.baselines.min_gpu, schedule.baselines.max_gpu, schedule.baselines.greedy):
        assert baseline >= schedule.baselines.lower_bound * (1 - 1e-6)


@SETTINGS
@given(sweeps(), st.booleans(), st.booleans())
def test_every_plan_keeps_the_invariants(sweep, fill, rotate):
    try:
        schedule = plan_packs(**sweep, fill=fill, rotate=rotate)
    except PloraError as err:  # nothing fits at all on these GPUs: the error says so
        assert "none of the" in str(err)
        return
    check_invariants(schedule, len(sweep["configs"]), 0.9 * sweep["gpu"].memory_bytes)
    event(f"planned {len(schedule.packs)} packs, {len(schedule.unschedulable)} unschedulable")
    if not rotate:
        assert all(p.width == len(p.configs) for p in schedule.packs)
    assert schedule.max_degree <= (sweep["max_degree"] or sweep["num_gpus"])
    cm = CostModel(Workload(shape_by_name(sweep["shape"]), sweep["seq_len"]), sweep["gpu"])
    for pack in schedule.packs:  # a member's step costs at least its step alone, turns or not
        for c in pack.configs:
            alone = sweep["steps"][c] * cm.step_seconds([sweep["configs"][c]], pack.degree)
            assert pack.end - pack.start >= alone * (1 - 1e-9)


@pytest.mark.parametrize(
    ("shape", "seq_len", "gib", "defers"),
    [("qwen2.5-1.5b", 151, 139.8, True), ("qwen2.5-7b", 512, 80.0, False)],  # all fit in one pack / memory binds
)
def test_a_filled_plan_starts_the_pack_the_sweep_s_admission_starts(shape, seq_len, gib, defers):
    """DTM defers configs that would lower a pack's tokens per second; a sweep's admission gives
    them to the starting pack if they fit, and a plan made with ``fill`` does the same, so it
    predicts the pack the sweep starts."""
    from plora_hpo.admission import Candidate, PlannerAdmission, Room

    cm = CostModel(Workload(shape_by_name(shape), seq_len), GpuSpec("NVIDIA H200", gib))
    kinds = [(r, b) for r in (8, 16, 32, 64, 128) for b in (2, 8)]
    configs = [config(r, b, seed=i) for i, (r, b) in enumerate((kinds * 4)[:32])]
    steps = [150 if c.batch_size == 2 else 60 for c in configs]
    plans = {}
    for fill in (False, True):
        jp = JobPlanner(cm, num_gpus=1, max_pack_size=32, fill=fill)
        jp.add_configs(configs, steps)
        plans[fill] = run_to_completion(jp)
    room = Room(members=(), free_slots=32, memory_limit=jp.memory_limit, cost_model=cm)
    admitted = PlannerAdmission().select([Candidate(c, s) for c, s in zip(configs, steps)], room)
    assert sorted(admitted) == plans[True][0].configs
    if defers:  # DTM alone left configs for later packs; the sweep and the filled plan start them all
        assert len(plans[False]) > 1 and plans[True][0].configs == list(range(32))
    else:
        assert len(plans[True]) > 1
    assert max(p.end for p in plans[True]) <= max(p.end for p in plans[False]) * (1 + 1e-9)


@pytest.mark.parametrize("num_gpus", [1, 2])
def test_a_rotating_plan_gives_the_configs_left_over_to_the_full_packs(num_gpus):
    """Memory binds (32 adapters of a 1.5B model per 80 GB GPU): without turns, the few configs
    that do not fit wait for a pack to end and then run as a small pack that pays a full step's
    fixed cost for few adapters; a sweep with ``pack.rotate`` trains them in the full packs by
    turns, and so does the plan."""
    cm = CostModel(Workload(shape_by_name("qwen2.5-1.5b"), 151), GpuSpec("H100", 79.18))
    kinds = [(r, b) for r in (8, 16, 32, 64, 128) for b in (2, 8)]
    configs = [config(r, b, seed=i) for i, (r, b) in enumerate((kinds * 8)[: 32 * num_gpus])]
    plans = {}
    for rotate in (False, True):
        jp = JobPlanner(cm, num_gpus=num_gpus, max_pack_size=32, fill=True, rotate=rotate)
        jp.add_configs(configs, steps=200)
        plans[rotate] = run_to_completion(jp)
    waits, turns = plans[False], plans[True]
    assert len(waits) > num_gpus, "memory leaves configs for a later pack"
    assert len(turns) == num_gpus and all(p.start == 0 for p in turns)
    assert sorted(c for p in turns for c in p.configs) == list(range(len(configs)))
    for first, pack in zip(waits, turns):  # the packs start as without turns, then take in the rest
        assert pack.width == len(first.configs) < len(pack.configs) and set(first.configs) < set(pack.configs)
        members = [configs[c] for c in pack.configs]
        rotating = cm.rotating_pack_seconds(members, [200] * len(members), memory_limit=jp.memory_limit, max_members=32)
        assert pack.end == pytest.approx(rotating)
    assert max(p.end for p in turns) < max(p.end for p in waits)


def planner(num_gpus: int = 2, **kwargs) -> JobPlanner:
    cm = CostModel(Workload(shape_by_name("qwen2.5-0.5b"), 512), GpuSpec("H200", 40))
    return JobPlanner(cm, num_gpus=num_gpus, **kwargs)


def test_online_replanning_follows_the_real_clock():
    jp = planner(num_gpus=2, max_degree=1)
    jp.add_configs([config(16, b, seed=i) for i, b in enumerate([2, 2, 8, 8, 4, 4, 1, 1])], steps=100)
    first = jp.next_packs()
    assert {g for p in first for g in p.gpus} == {0, 1}
    late = first[0]
    predicted = late.end - late.start
    jp.finished(late.pack_id, actual_seconds=3 * predicted)  # three times slower than predicted
    assert jp.completed == [late] and late.end == pytest.approx(late.start + 3 * predicted)
    assert jp.now == pytest.approx(late.start + 3 * predicted)
    assert all(p.end >= jp.now for p in jp.running.values())  # still-running packs re-predicted
    assert jp.drift == pytest.approx(3.0)
    again = jp.next_packs(free_gpus=late.gpus)
    assert again and all(p.start == jp.now for p in again)
    assert again[0].end - again[0].start == pytest.approx(
        3 * jp.cost_model.pack_seconds([jp.configs[c] for c in again[0].configs], [100] * len(again[0].configs), 1)
    )
    # New trials arrive mid-run and are planned with the rest.
    new_ids = jp.add_configs([config(64, 2, seed=99)], steps=50)
    assert new_ids[0] in {c for p in run_to_completion(jp) for c in p.configs}


def test_next_packs_rejects_busy_gpus_and_unknown_packs():
    jp = planner()
    jp.add_configs([config()] * 4, steps=10)
    packs = jp.next_packs()
    with pytest.raises(PloraError, match="running packs"):
        jp.next_packs(free_gpus=packs[0].gpus)
    with pytest.raises(PloraError, match="not running"):
        jp.finished(12345)


def test_unschedulable_configs_are_named_or_skipped():
    jp = planner(num_gpus=1)
    huge = config(128, 512)
    with pytest.raises(UnschedulableError, match=r"config #1 \(r128-a128-lr1e-04-b512\) cannot fit") as err:
        jp.add_configs([config(), huge], steps=10)
    assert err.value.config_ids == [1] and jp.configs == [] and jp.pending == []
    jp = planner(num_gpus=1)
    jp.add_configs([config(), huge], steps=10, skip_unschedulable=True)
    assert jp.unschedulable == [1] and jp.pending == [0]
    assert [p.configs for p in run_to_completion(jp)] == [[0]]


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"num_gpus": 0}, "at least one GPU"),
        ({"num_gpus": 4, "max_degree": 3}, "power of two"),
        ({"num_gpus": 2, "load_factor": 1.5}, "load factor"),
        ({"num_gpus": 2, "max_pack_size": 0}, "pack size"),
    ],
)
def test_bad_planner_settings(kwargs, words):
    cm = CostModel(Workload(shape_by_name("qwen2.5-0.5b"), 512), GpuSpec("H200", 40))
    with pytest.raises(PloraError, match=words):
        JobPlanner(cm, **kwargs)


def test_bad_steps():
    jp = planner()
    with pytest.raises(PloraError, match="one per config"):
        jp.add_configs([config()] * 2, steps=[10])
    with pytest.raises(PloraError, match="positive whole numbers"):
        jp.add_configs([config()], steps=0)


def test_list_schedule():
    assert list_schedule([(1, 10.0), (1, 10.0), (1, 10.0)], 2) == 20.0
    assert list_schedule([(2, 5.0), (1, 1.0), (1, 1.0)], 2) == 6.0
    assert list_schedule([(1, 4.0), (2, 1.0), (1, 1.0)], 2) == 5.0  # backfill: the third starts at 0
    with pytest.raises(PloraError, match="needs 4 GPUs"):
        list_schedule([(4, 1.0)], 2)
