"""Baselines simulated on the same GPU pool and cost model, and the lower bound.

Why: a planned makespan means little alone; these say what simpler policies would take.

- Min GPU: every config alone on the fewest GPUs that hold it, started in config order as GPUs
  free up (with backfill) — one trial per job, as a plain sweep runs them.
- Max GPU: every config alone on the largest allowed degree, one after another.
- Greedy: first-fit-decreasing packing by memory (a pack's degree is its first config's smallest
  degree), packs started in creation order as GPUs free up.
- Lower bound: no schedule beats total useful work ÷ (GPUs × best per-GPU rate of any pack, from
  the ILP's proven bound), nor the slowest config's fastest solo run. The pack rate counts a pack
  until its longest member is done, so the bound holds for packs whose members train together to
  their end; members that take turns (``rotate``) refill the places of those done and may end
  below it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from plora_hpo.planner.dtm import powers_of_two
from plora_hpo.planner.simulate import JobPlanner, list_schedule


@dataclass(frozen=True)
class Baselines:
    """Makespans in seconds (the same unit as the plan's)."""

    min_gpu: float
    max_gpu: float
    greedy: float
    lower_bound: float

    def to_dict(self) -> dict[str, float]:
        return asdict(self)


def _solo_seconds(planner: JobPlanner, cid: int, degree: int) -> float:
    return planner.cost_model.pack_seconds([planner.configs[cid]], [planner.steps[cid]], degree)


def min_gpu(planner: JobPlanner, ids: list[int]) -> float:
    jobs = [(planner.min_degree(c), _solo_seconds(planner, c, planner.min_degree(c))) for c in ids]
    return list_schedule(jobs, planner.num_gpus)


def max_gpu(planner: JobPlanner, ids: list[int]) -> float:
    return sum(_solo_seconds(planner, c, planner.max_degree) for c in ids)


def greedy(planner: JobPlanner, ids: list[int]) -> float:
    search, cap = planner.search, planner.max_pack_size
    types = {c: planner.type_index(c) for c in ids}

    def memory(c: int, degree: int) -> float:
        return float(search.table(degree).memory[types[c]])

    order = sorted(ids, key=lambda c: -memory(c, planner.min_degree(c)))
    packs: list[tuple[int, list[int], list[float]]] = []  # degree, members, [memory left]
    for c in order:
        for degree, members, left in packs:
            fits = degree >= planner.min_degree(c) and (cap is None or len(members) < cap)
            if fits and memory(c, degree) <= left[0]:
                members.append(c)
                left[0] -= memory(c, degree)
                break
        else:
            d = planner.min_degree(c)
            packs.append((d, [c], [search.table(d).capacity - memory(c, d)]))
    cm = planner.cost_model
    jobs = [
        (d, cm.pack_seconds([planner.configs[m] for m in ms], [planner.steps[m] for m in ms], d)) for d, ms, _ in packs
    ]
    return list_schedule(jobs, planner.num_gpus)


def lower_bound(planner: JobPlanner, ids: list[int]) -> float:
    search = planner.search
    counts = np.zeros(len(search.types), dtype=int)
    for c in ids:
        counts[planner.type_index(c)] += 1
    rate = search.best_rate_per_gpu(counts, planner.max_degree)
    work_bound = float(search.work @ counts) / (planner.num_gpus * rate)
    solo = {
        planner.type_index(c): min(
            _solo_seconds(planner, c, d) for d in powers_of_two(planner.max_degree) if d >= planner.min_degree(c)
        )
        for c in ids
    }
    return max(work_bound, max(solo.values()))


def compute_baselines(planner: JobPlanner) -> Baselines:
    """All baselines for the configs the planner could schedule."""
    skipped = set(planner.unschedulable)
    ids = [c for c in range(len(planner.configs)) if c not in skipped]
    return Baselines(min_gpu(planner, ids), max_gpu(planner, ids), greedy(planner, ids), lower_bound(planner, ids))
