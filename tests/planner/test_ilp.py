"""Pack ILP: Dinkelbach finds the brute-force optimum; gurobi and HiGHS agree; backend switch."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from plora_hpo.errors import PloraError
from plora_hpo.planner import ilp
from plora_hpo.planner.ilp import GUROBI_SIZE_LIMIT, PackProblem, choose_solver, maximise_throughput

try:
    import gurobipy  # noqa: F401

    HAVE_GUROBI = ilp._gurobi()[0] is not None
except ImportError:
    HAVE_GUROBI = False

SETTINGS = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def problems(draw, max_types: int = 4) -> PackProblem:
    """Small packs: each type has its own step count, memory, host and GPU seconds per step."""
    n = draw(st.integers(1, max_types))
    floats = lambda lo, hi: st.floats(lo, hi, allow_nan=False)  # noqa: E731
    steps = np.array(draw(st.lists(st.sampled_from([50, 100, 400]), min_size=n, max_size=n)), dtype=float)
    levels = np.unique(steps)
    tokens = np.array(draw(st.lists(st.sampled_from([512, 2048, 8192]), min_size=n, max_size=n)), dtype=float)
    return PackProblem(
        work=steps * tokens,
        memory=np.array(draw(st.lists(floats(1.0, 30.0), min_size=n, max_size=n))),
        available=np.array(draw(st.lists(st.integers(0, 4), min_size=n, max_size=n))),
        launch=np.array(draw(st.lists(floats(1e-4, 2e-3), min_size=n, max_size=n))),
        device=np.array(draw(st.lists(floats(1e-3, 5e-2), min_size=n, max_size=n))),
        alive=(steps[None, :] >= levels[:, None]).astype(float),
        phase_steps=np.diff(levels, prepend=0.0),
        launch_fixed=draw(floats(0.01, 0.2)),
        device_fixed=draw(floats(0.001, 0.05)),
        capacity=draw(floats(5.0, 80.0)),
        max_items=draw(st.one_of(st.none(), st.integers(1, 5))),
        max_seconds=draw(st.one_of(st.none(), floats(5.0, 60.0))),
    )


def brute_force(p: PackProblem) -> float:
    best = 0.0
    for counts in itertools.product(*(range(a + 1) for a in p.available)):
        x = np.array(counts)
        if x.any() and p.feasible(x):
            best = max(best, float(p.work @ x) / p.seconds(x))
    return best


@SETTINGS
@given(problems())
def test_dinkelbach_reaches_the_brute_force_optimum(problem):
    best = brute_force(problem)
    solution = maximise_throughput(problem, "highs")
    if best == 0.0:
        assert solution is None
        return
    assert problem.feasible(solution.counts)
    assert solution.throughput == pytest.approx(best, rel=1e-3)
    assert solution.throughput_bound >= best * (1 - 1e-9)
    assert solution.seconds == pytest.approx(problem.seconds(solution.counts))


@pytest.mark.skipif(not HAVE_GUROBI, reason="gurobipy not importable or not licensed")
@SETTINGS
@given(problems(max_types=6))
def test_gurobi_and_highs_reach_the_same_objective(problem):
    by_gurobi = maximise_throughput(problem, "gurobi")
    by_highs = maximise_throughput(problem, "highs")
    assert (by_gurobi is None) == (by_highs is None)
    if by_gurobi is not None:
        assert by_gurobi.solver == "gurobi" and by_highs.solver == "highs"
        assert by_gurobi.throughput == pytest.approx(by_highs.throughput, rel=1e-3)


def uniform_problem(n: int) -> PackProblem:
    return PackProblem(
        work=np.linspace(1.0, 2.0, n),
        memory=np.ones(n),
        available=np.ones(n, dtype=int),
        launch=np.full(n, 1e-3),
        device=np.full(n, 1e-2),
        alive=np.ones((1, n)),
        phase_steps=np.array([100.0]),
        launch_fixed=0.1,
        device_fixed=0.01,
        capacity=10.0,
    )


def test_auto_switches_to_highs_beyond_the_gurobi_pip_license():
    small, large = uniform_problem(10), uniform_problem(GUROBI_SIZE_LIMIT + 1)
    name, why = choose_solver("auto", large)
    assert name == "highs" and ("2000" in why or "gurobipy" in why)
    assert choose_solver("highs", small) == ("highs", "")
    solution = maximise_throughput(large, "auto")
    assert solution.solver == "highs" and solution.counts.sum() == 10
    if HAVE_GUROBI:
        assert choose_solver("auto", small) == ("gurobi", "")
        with pytest.raises(PloraError, match="exceed the gurobipy pip license"):
            choose_solver("gurobi", large)


def test_auto_falls_back_when_gurobi_is_unusable(monkeypatch):
    monkeypatch.setattr(ilp, "_gurobi", lambda: (None, "gurobipy is not installed"))
    assert choose_solver("auto", uniform_problem(3)) == ("highs", "gurobipy is not installed")
    with pytest.raises(PloraError, match="not installed; use --solver highs"):
        choose_solver("gurobi", uniform_problem(3))
    with pytest.raises(PloraError, match="unknown solver"):
        choose_solver("cplex", uniform_problem(3))


def test_nothing_fits():
    p = uniform_problem(3)
    assert maximise_throughput(PackProblem(**{**p.__dict__, "capacity": 0.5})) is None
    assert maximise_throughput(PackProblem(**{**p.__dict__, "max_seconds": 1.0})) is None
