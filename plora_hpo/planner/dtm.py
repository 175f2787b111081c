"""Decomposed Throughput Maximization: fill free GPUs with packs of power-of-two degrees.

For each degree ``d`` that fits in the free GPUs, DTM fills them with the best degree-``d`` packs
(the ILP F(d, K) on what remains, see :mod:`plora_hpo.planner.ilp`), recurses with smaller degrees
on the GPUs left over, and keeps the candidate whose estimated makespan is smallest. The job
planner (:mod:`plora_hpo.planner.simulate`) calls it whenever GPUs free up.

Configs are handled by *type* (rank, batch size, steps): configs of one type cost the same, so the
search works on counts per type and the caller maps counts back to config ids.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace

import numpy as np

from plora_hpo.adapter import AdapterConfig
from plora_hpo.planner.cost_model import CostModel
from plora_hpo.planner.ilp import PackProblem, maximise_throughput


@dataclass(frozen=True)
class ConfigType:
    """What the cost of a config depends on; ``example`` stands for all configs of the type."""

    example: AdapterConfig
    steps: int

    @property
    def key(self) -> tuple[int, int, int]:
        return (self.example.rank, self.example.batch_size, self.steps)


@dataclass(frozen=True)
class PackChoice:
    """How many configs of each type one pack of ``degree`` GPUs takes, and its ILP figures."""

    degree: int
    counts: np.ndarray
    throughput: float  # useful tokens per second
    throughput_bound: float  # proven upper bound on the best pack of this degree
    seconds: float  # predicted duration (the simulator's, when the pack's longest member runs `longest` steps)
    solver: str
    longest: int  # steps of the pack's longest member


@dataclass(frozen=True)
class _DegreeTable:
    """Per-type figures on ``degree`` GPUs; independent of what remains, so computed once.

    The logits chunk holds min(chunk, pack tokens per GPU) rows, which is not linear in the pack.
    Two linear views bound it from above: a full chunk (``capacity``, ``memory``), or one row per
    token (``capacity_bare``, ``memory + logits``). The pack's true memory is the smaller of the
    two, so the best pack over both views is the best pack.
    """

    capacity: float
    memory: np.ndarray
    capacity_bare: float
    logits: np.ndarray  # bytes per GPU of one config's logits rows
    launch: np.ndarray  # host seconds per step
    device: np.ndarray  # GPU seconds per step
    launch_fixed: float
    device_fixed: float


def powers_of_two(limit: int) -> list[int]:
    """1, 2, 4, … up to ``limit``."""
    return [2**i for i in range(int(math.log2(limit)) + 1)] if limit >= 1 else []


class PackSearch:
    """The ILP F(d, K) for every degree, over config types, with answers reused while valid.

    Reuse rule: a pack optimal for the remaining counts ``R`` stays optimal for any ``R' ≤ R``
    that still contains it (the feasible set only shrank). Packs are taken from a shrinking pool,
    so most calls are answered without a solve.
    """

    def __init__(
        self,
        cost_model: CostModel,
        types: Sequence[ConfigType],
        *,
        memory_limit: float,
        max_pack_size: int | None,
        solver: str,
        long_first: float = 0.0,
    ) -> None:
        self.cost_model = cost_model
        self.types = list(types)
        self.memory_limit = memory_limit
        self.max_pack_size = max_pack_size
        self.solver = solver
        self.long_first = long_first
        self.steps = np.array([t.steps for t in self.types], dtype=float)
        self.work = self.steps * [cost_model.tokens_per_step(t.example) for t in self.types]
        self._tables: dict[int, _DegreeTable] = {}
        self._reuse: dict[tuple[int, float, bool], tuple[np.ndarray, float | None, PackChoice | None]] = {}
        self.solvers_used: set[str] = set()
        self.solver_notes: set[str] = set()

    def table(self, degree: int) -> _DegreeTable:
        if degree not in self._tables:
            cm = self.cost_model
            overhead = cm.overhead_terms(degree)
            terms = [cm.adapter_terms(t.example, degree) for t in self.types]
            launch = np.array([cm.launch_seconds(x) for x in terms])
            device = np.array([cm.device_seconds(x) for x in terms])
            launch_fixed, device_fixed = cm.launch_seconds(overhead), cm.device_seconds(overhead)
            if not cm.gpu.async_launch:  # host and device time add up: fold both into one form
                device, launch = device + launch, np.zeros_like(launch)
                device_fixed, launch_fixed = device_fixed + launch_fixed, 0.0
            full_chunk = cm.memory_bytes(cm.base_memory_terms(degree))
            no_chunk = cm.memory_bytes(cm.base_memory_terms(degree, tokens_per_gpu=0))
            chunk_tokens = cm.workload.logits_chunk_tokens or 1
            tokens = np.array([cm.tokens_per_step(t.example) for t in self.types], dtype=float)
            self._tables[degree] = _DegreeTable(
                capacity=self.memory_limit - full_chunk,
                memory=np.array([cm.memory_bytes(cm.adapter_memory_terms(t.example, degree)) for t in self.types]),
                capacity_bare=self.memory_limit - no_chunk,
                # every GPU of a tensor-parallel pack computes logits for all of the pack's tokens
                logits=(full_chunk - no_chunk) / chunk_tokens * tokens,
                launch=launch,
                device=device,
                launch_fixed=launch_fixed,
                device_fixed=device_fixed,
            )
        return self._tables[degree]

    def fits_alone(self, index: int, degree: int) -> bool:
        """Whether one config of type ``index`` fits on ``degree`` GPUs by itself."""
        return bool(self._fitting(degree)[index])

    def _fitting(self, degree: int) -> np.ndarray:
        """(n,) whether one config of each type fits alone, in either memory view."""
        t = self.table(degree)
        return (t.memory <= t.capacity) | (t.memory + t.logits <= t.capacity_bare)

    def best(self, degree: int, counts: np.ndarray, horizon: float | None = None) -> PackChoice | None:
        """The pack of ``degree`` GPUs to start from ``counts``; None when nothing fits.

        Per candidate longest step count S, the highest-throughput pack that ends within
        ``horizon`` seconds (or as soon as its slowest-finishing config could alone); among those,
        the one with the largest S whose throughput is within ``long_first`` (a fraction) of the
        best — 0 picks pure throughput, 1 always starts the longest-running configs first
        (longest-processing-time order, and only one ILP class to solve).
        """
        options = self._options(degree, counts, horizon)
        if self.long_first >= 1:
            return next(options, None)
        found = list(options)
        if not found:
            return None
        top = max(c.throughput for c in found)
        return max((c for c in found if c.throughput >= (1 - self.long_first) * top), key=lambda c: c.longest)

    def _options(self, degree: int, counts: np.ndarray, horizon: float | None) -> Iterator[PackChoice]:
        """The best pack of each longest-step class, longest class first."""
        table = self.table(degree)
        usable = (counts > 0) & self._fitting(degree)
        solo = self.steps * np.maximum(table.launch_fixed + table.launch, table.device_fixed + table.device)
        views = (False, True) if table.logits.any() else (False,)
        for longest in sorted(set(self.steps[usable]), reverse=True):
            cap = None if horizon is None else max(horizon, solo[usable & (self.steps == longest)].min())
            found = [self._class_best(degree, float(longest), counts, cap, per_token) for per_token in views]
            found = [c for c in found if c is not None]
            if found:
                best = max(found, key=lambda c: c.throughput)
                yield replace(best, throughput_bound=max(c.throughput_bound for c in found))

    def _class_best(
        self, degree: int, longest: float, counts: np.ndarray, cap: float | None, per_token: bool
    ) -> PackChoice | None:
        """Best pack whose longest member runs ``longest`` steps and that ends within ``cap`` seconds,
        in one memory view (``per_token``: logits rows counted per token, else a full chunk).

        Reused while provably still best: the pool and the cap only shrank and it still fits.
        """
        key = (degree, longest, per_token)
        cached = self._reuse.get(key)
        if cached is not None:
            pool, old_cap, choice = cached
            limit = math.inf if cap is None else cap
            shrunk = np.all(counts <= pool) and limit <= (math.inf if old_cap is None else old_cap)
            if shrunk and (choice is None or (np.all(choice.counts <= counts) and choice.seconds <= limit)):
                return choice
        table = self.table(degree)
        memory = table.memory + table.logits if per_token else table.memory
        capacity = table.capacity_bare if per_token else table.capacity
        idx = np.flatnonzero((counts > 0) & (memory <= capacity) & (self.steps <= longest))
        if not idx.size:
            self._reuse[key] = (counts.copy(), cap, None)
            return None
        steps = self.steps[idx]
        levels = np.unique(steps)  # phase p ends when the configs with levels[p] steps leave
        problem = PackProblem(
            work=self.work[idx],
            memory=memory[idx],
            available=counts[idx],
            launch=table.launch[idx],
            device=table.device[idx],
            alive=(steps[None, :] >= levels[:, None]).astype(float),
            phase_steps=np.diff(levels, prepend=0.0),
            launch_fixed=table.launch_fixed,
            device_fixed=table.device_fixed,
            capacity=capacity,
            max_items=self.max_pack_size,
            max_seconds=cap,
        )
        start = None
        if cached is not None and cached[2] is not None and np.all(cached[2].counts <= counts):
            start = cached[2].counts[idx]  # the previous answer, if still available, as a first guess
            if start.sum() != cached[2].counts.sum():
                start = None
        solution = maximise_throughput(problem, self.solver, start=start)
        choice = None
        if solution is not None:
            self.solvers_used.add(solution.solver)
            if solution.solver_note:
                self.solver_notes.add(solution.solver_note)
            full = np.zeros(len(self.types), dtype=int)
            full[idx] = solution.counts
            choice = PackChoice(
                degree,
                full,
                solution.throughput,
                solution.throughput_bound,
                solution.seconds,
                solution.solver,
                int(longest),
            )
        self._reuse[key] = (counts.copy(), cap, choice)
        return choice

    def homogeneous_rate(self, index: int, max_degree: int) -> float:
        """Best useful tokens per GPU-second of a pack made only of type ``index``.

        Closed form: the rate grows with the pack, so the largest pack that fits is best at each degree.
        """
        best = 0.0
        for degree in powers_of_two(max_degree):
            t = self.table(degree)
            if not self.fits_alone(index, degree):
                continue
            n = max(t.capacity // t.memory[index], t.capacity_bare // (t.memory[index] + t.logits[index]), 1)
            n = int(min(n, self.max_pack_size or n))
            steps = self.steps[index]
            seconds = steps * max(t.launch_fixed + n * t.launch[index], t.device_fixed + n * t.device[index])
            best = max(best, n * self.work[index] / (degree * seconds))
        return best

    def forget(self) -> None:
        """Drop reused answers (call when the pool grows)."""
        self._reuse.clear()

    def best_rate_per_gpu(self, counts: np.ndarray, max_degree: int) -> float:
        """Upper bound on useful tokens per GPU-second of any pack of any allowed degree."""
        degrees = powers_of_two(max_degree)
        bounds = (c.throughput_bound / d for d in degrees for c in self._options(d, counts, None))
        return max(bounds, default=0.0)


Estimate = Callable[[list[PackChoice]], float]


def decompose(
    search: PackSearch,
    free_gpus: int,
    counts: np.ndarray,
    *,
    max_degree: int,
    estimate: Estimate,
    horizon: float | None = None,
    prefix: tuple[PackChoice, ...] = (),
) -> list[PackChoice]:
    """DTM: the packs (with degrees) to start now on ``free_gpus`` GPUs from ``counts``.

    ``estimate`` scores a full candidate (``prefix`` + new packs) by its predicted makespan;
    ties go to the smaller degree (less communication). ``horizon`` caps pack durations (see
    :meth:`PackSearch.best`).
    """
    best: list[PackChoice] = []
    best_score = math.inf
    for degree in powers_of_two(min(free_gpus, max_degree)):
        chosen: list[PackChoice] = []
        left, gpus = counts.copy(), free_gpus
        while gpus >= degree and left.any():
            choice = search.best(degree, left, horizon)
            if choice is None:
                break
            chosen.append(choice)
            left -= choice.counts
            gpus -= degree
        if not chosen:
            continue
        if 0 < gpus < degree and left.any():  # recurse on the GPUs and configs left over
            chosen += decompose(
                search,
                gpus,
                left,
                max_degree=powers_of_two(gpus)[-1],
                estimate=estimate,
                horizon=horizon,
                prefix=prefix + tuple(chosen),
            )
        score = estimate([*prefix, *chosen])
        if score < best_score:
            best, best_score = chosen, score
    return best
