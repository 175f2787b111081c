"""Baselines: simple policies on the same simulator, and a lower bound below all of them."""

from __future__ import annotations

import pytest

from plora_hpo.planner.baselines import compute_baselines, greedy, max_gpu, min_gpu
from plora_hpo.planner.cost_model import CostModel, GpuSpec, Workload
from plora_hpo.planner.simulate import JobPlanner
from plora_hpo.shapes import shape_by_name
from tests.planner._configs import config


def planner(num_gpus: int, memory_gib: float = 80) -> JobPlanner:
    cm = CostModel(Workload(shape_by_name("qwen2.5-0.5b"), 512), GpuSpec("H200", memory_gib))
    jp = JobPlanner(cm, num_gpus=num_gpus)
    jp.add_configs([config(r, b, seed=i) for i, (r, b) in enumerate([(8, 2), (16, 4), (64, 8), (8, 1)])], steps=100)
    return jp


def solo(jp: JobPlanner, cid: int, degree: int) -> float:
    return jp.cost_model.pack_seconds([jp.configs[cid]], [jp.steps[cid]], degree)


def test_max_gpu_runs_one_after_another_on_all_gpus():
    jp = planner(num_gpus=4)
    assert max_gpu(jp, [0, 1, 2, 3]) == pytest.approx(sum(solo(jp, c, 4) for c in range(4)))


def test_min_gpu_on_one_gpu_is_sequential_and_parallel_on_many():
    one = planner(num_gpus=1)
    assert min_gpu(one, [0, 1, 2, 3]) == pytest.approx(sum(solo(one, c, 1) for c in range(4)))
    many = planner(num_gpus=4)
    assert min_gpu(many, [0, 1, 2, 3]) == pytest.approx(max(solo(many, c, 1) for c in range(4)))


def test_greedy_packs_what_fits_and_beats_min_gpu_on_one_gpu():
    jp = planner(num_gpus=1)
    assert greedy(jp, [0, 1, 2, 3]) < min_gpu(jp, [0, 1, 2, 3])


def test_lower_bound_is_below_every_baseline():
    for gpus in (1, 2, 4):
        b = compute_baselines(planner(gpus))
        # on one GPU the bound is tight (host-bound: one pack of all four), equal up to rounding
        assert 0 < b.lower_bound <= min(b.min_gpu, b.max_gpu, b.greedy) * (1 + 1e-12)
