"""The planner's answer: packs on GPUs over time, the predicted makespan and its yardsticks."""

from __future__ import annotations

from dataclasses import dataclass, field

from plora_hpo.planner.baselines import Baselines
from plora_hpo.planner.simulate import PlannedPack


@dataclass
class Schedule:
    """A whole plan. Times are predicted seconds from the start of the sweep.

    Attributes:
        packs: every pack, by start time; ``configs`` are indices into the planned config list.
        makespan: when the last pack ends.
        baselines: makespans of the simple policies and the lower bound.
        solver: which ILP solver(s) ran (``gurobi``, ``highs`` or ``gurobi+highs``).
        solver_note: why the automatic choice fell back to HiGHS ('' when it did not).
        planning_seconds: wall seconds spent planning (including the baselines).
        num_gpus, max_degree, memory_limit_bytes: the pool the plan is for.
        unschedulable: indices of configs left out because they fit nowhere.
        calibrated_from: observations behind the cost model's calibration (0: pure prior).
        policy: the :class:`JobPlanner` options (``long_first``, ``horizon_slack``) that gave this
            plan; pass them on to a JobPlanner that re-plans online.
    """

    packs: list[PlannedPack]
    makespan: float
    baselines: Baselines
    solver: str
    planning_seconds: float
    num_gpus: int
    max_degree: int
    memory_limit_bytes: float
    solver_note: str = ""
    unschedulable: list[int] = field(default_factory=list)
    calibrated_from: int = 0
    policy: dict[str, float | None] = field(default_factory=dict)

    @property
    def approximation_ratio(self) -> float:
        """Makespan ÷ lower bound (1.0 is provably optimal under the cost model for packs whose
        members train together to their end; a plan whose members take turns can go below 1)."""
        return self.makespan / self.baselines.lower_bound if self.baselines.lower_bound > 0 else 1.0

    def speedups(self) -> dict[str, float]:
        """Baseline makespan ÷ planned makespan, per baseline."""
        b = self.baselines
        plan = self.makespan or 1.0
        return {"min_gpu": b.min_gpu / plan, "max_gpu": b.max_gpu / plan, "greedy": b.greedy / plan}

    def to_dict(self) -> dict:
        return {
            "packs": [p.to_dict() for p in self.packs],
            "makespan": self.makespan,
            "baselines": self.baselines.to_dict(),
            "solver": self.solver,
            "planning_seconds": self.planning_seconds,
            "approximation_ratio": self.approximation_ratio,
            "speedups": self.speedups(),
            "num_gpus": self.num_gpus,
            "max_degree": self.max_degree,
            "memory_limit_bytes": self.memory_limit_bytes,
            "solver_note": self.solver_note,
            "unschedulable": self.unschedulable,
            "calibrated_from": self.calibrated_from,
            "policy": self.policy,
            "time_unit": "seconds",
        }
