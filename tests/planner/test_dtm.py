"""DTM: packs fit the free GPUs, degrees are powers of two, and reused ILP answers stay optimal."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from plora_hpo.planner.cost_model import CostModel, GpuSpec, Workload
from plora_hpo.planner.dtm import ConfigType, PackSearch, decompose, powers_of_two
from plora_hpo.shapes import shape_by_name
from tests.planner._configs import config

TYPES = [
    ConfigType(config(r, b), s) for r, b, s in [(8, 2, 400), (64, 2, 400), (16, 8, 100), (128, 8, 100), (32, 1, 800)]
]


def search(**kwargs) -> PackSearch:
    cm = CostModel(Workload(shape_by_name("qwen2.5-1.5b"), 512), GpuSpec("H200", 80))
    options = {"memory_limit": 0.9 * 80 * 2**30, "max_pack_size": None, "solver": "auto", **kwargs}
    return PackSearch(cm, TYPES, **options)


def test_powers_of_two():
    assert powers_of_two(1) == [1]
    assert powers_of_two(6) == [1, 2, 4]
    assert powers_of_two(0) == []


@settings(max_examples=15, deadline=None)
@given(
    st.lists(st.lists(st.integers(0, 6), min_size=5, max_size=5), min_size=1, max_size=4), st.sampled_from([0.0, 1.0])
)
def test_reused_answers_equal_fresh_ones(pools, long_first):
    """Pools shrink as packs are taken: a cached answer must be what a fresh solve would give."""
    cached = search(long_first=long_first)
    pool = np.array([6] * 5)
    for shrink in pools:
        pool = np.minimum(pool, np.array(shrink))
        for degree in (1, 2):
            a, b = cached.best(degree, pool, horizon=500.0), search(long_first=long_first).best(degree, pool, 500.0)
            assert (a is None) == (b is None)
            if a is not None:
                assert a.throughput == pytest.approx(b.throughput, rel=1e-3)
                assert np.all(a.counts <= pool)


@settings(max_examples=15, deadline=None)
@given(st.integers(1, 7), st.lists(st.integers(0, 5), min_size=5, max_size=5))
def test_decompose_fills_at_most_the_free_gpus(free, counts):
    counts = np.array(counts)
    s = search()
    packs = decompose(s, free, counts, max_degree=powers_of_two(free)[-1], estimate=lambda c: -len(c))
    assert sum(p.degree for p in packs) <= free
    assert all(p.degree in powers_of_two(free) for p in packs)
    taken = sum((p.counts for p in packs), np.zeros(5, dtype=int))
    assert np.all(taken <= counts)
    if counts.any():
        assert packs, "some config always fits on an 80 GiB GPU here"


def test_homogeneous_rate_prefers_full_packs():
    s = search()
    assert s.homogeneous_rate(0, 1) > 0
    single = search(max_pack_size=1)
    assert s.homogeneous_rate(0, 1) > single.homogeneous_rate(0, 1)
