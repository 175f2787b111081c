"""The job planner (PLoRA Algorithm 2) and an event simulator of the GPU pool.

Why online: predictions are never exact and the sampler proposes new trials while packs run, so
the planner decides only what starts *now* on the GPUs that are free now (running DTM on what is
left), and decides again at the next event with the true clock. The sweep runner drives it::

    planner = JobPlanner(cost_model, num_gpus=8)
    planner.add_configs(configs, steps=[...])
    for pack in planner.next_packs():             # start these (pack.gpus, pack.configs)
        ...
    planner.finished(pack.pack_id, actual_seconds)  # when one ends; then next_packs() again

:func:`run_to_completion` plays the same loop with predicted durations, which is how a whole plan
is made ahead of time.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import numpy as np

from plora_hpo.adapter import AdapterConfig
from plora_hpo.errors import PloraError
from plora_hpo.planner.cost_model import CostModel
from plora_hpo.planner.dtm import ConfigType, PackChoice, PackSearch, decompose, powers_of_two
from plora_hpo.planner.fill import spread_deferred

_EPS = 1e-9


class UnschedulableError(PloraError):
    """Configs that do not fit in memory even alone on the most GPUs a pack may use."""

    def __init__(self, message: str, config_ids: Sequence[int]) -> None:
        super().__init__(message)
        self.config_ids = list(config_ids)


@dataclass
class PlannedPack:
    """One pack: which configs, on which GPUs, when (predicted, or actual once finished)."""

    pack_id: int
    configs: list[int]
    degree: int
    gpus: list[int]
    start: float
    end: float
    memory_bytes: float  # predicted peak per GPU
    step_seconds: float  # predicted seconds of the first (fullest) step
    steps: int  # steps of the longest member
    solver: str
    width: int  # members it starts with; fewer than ``configs`` when the rest take turns with them

    def to_dict(self) -> dict:
        return asdict(self)


class JobPlanner:
    """Online planner: runs DTM on the free GPUs and remaining configs whenever asked.

    Args:
        cost_model: memory and time predictions (calibrated or not).
        num_gpus: GPUs of the pool, ids ``0 .. num_gpus-1``.
        load_factor: fraction C of each GPU's memory a pack may plan to use.
        max_degree: most GPUs per pack (a power of two; default the largest ≤ ``num_gpus``).
        max_pack_size: most adapters per pack (None: memory decides).
        solver: ``"auto"``, ``"gurobi"`` or ``"highs"`` for the pack ILPs.
        long_first: how much pack throughput (a fraction) to give up to start packs of longer-
            running configs first; see :meth:`PackSearch.best`.
        horizon_slack: packs should end within this multiple of the time the remaining work
            needs at the best rate on all GPUs (None: no cap, pure throughput).
        fill: give the configs DTM leaves for a later wave to the starting packs they fit in, as a
            sweep does (:mod:`~plora_hpo.planner.fill`); False: the paper's DTM alone.
        rotate: once every GPU has a pack, the configs still waiting join the single-GPU packs that
            start then as members that take turns, as a sweep with ``pack.rotate`` keeps a full
            pack full (:meth:`CostModel.rotating_pack_seconds`); False: they wait for a GPU.
    """

    def __init__(
        self,
        cost_model: CostModel,
        *,
        num_gpus: int,
        load_factor: float = 0.9,
        max_degree: int | None = None,
        max_pack_size: int | None = None,
        solver: str = "auto",
        long_first: float = 1.0,
        horizon_slack: float | None = 1.0,
        fill: bool = False,
        rotate: bool = False,
    ) -> None:
        if num_gpus < 1:
            raise PloraError(f"need at least one GPU to plan on, got {num_gpus}; pass --gpus 1 or more")
        if not 0 < load_factor <= 1:
            raise PloraError(f"load factor must be in (0, 1], got {load_factor}")
        if max_degree is not None and (max_degree < 1 or max_degree & (max_degree - 1)):
            raise PloraError(f"max degree must be a power of two ≥ 1, got {max_degree}")
        if max_pack_size is not None and max_pack_size < 1:
            raise PloraError(f"max pack size must be at least 1, got {max_pack_size}")
        self.cost_model = cost_model
        self.num_gpus = num_gpus
        self.max_degree = powers_of_two(min(num_gpus, max_degree or num_gpus))[-1]
        self.memory_limit = load_factor * cost_model.gpu.memory_bytes
        self.max_pack_size = max_pack_size
        self.solver = solver
        self.long_first = long_first
        self.horizon_slack = horizon_slack
        self.fill = fill
        self.rotate = rotate
        self.now = 0.0
        self.configs: list[AdapterConfig] = []
        self.steps: list[int] = []
        self.unschedulable: list[int] = []
        self.running: dict[int, PlannedPack] = {}
        self.completed: list[PlannedPack] = []
        self._types: list[ConfigType] = []
        self._type_of: dict[tuple[int, int, int], int] = {}
        self._pending: list[list[int]] = []  # config ids per type, ascending
        self._min_degree: list[int] = []
        self._predicted = self._actual = 0.0
        self._model_seconds: dict[int, float] = {}  # uncorrected predictions, for the drift
        self._next_id = 0
        self._area: np.ndarray | None = None  # per type, see _type_area
        self._search = self._new_search()

    # ---- inputs -------------------------------------------------------------------------
    def _new_search(self, previous: PackSearch | None = None) -> PackSearch:
        search = PackSearch(
            self.cost_model,
            self._types,
            memory_limit=self.memory_limit,
            max_pack_size=self.max_pack_size,
            solver=self.solver,
            long_first=self.long_first,
        )
        if previous is not None:  # keep the record of which solvers ran
            search.solvers_used |= previous.solvers_used
            search.solver_notes |= previous.solver_notes
        return search

    def add_configs(
        self, configs: Sequence[AdapterConfig], steps: int | Sequence[int], *, skip_unschedulable: bool = False
    ) -> list[int]:
        """Queue configs (new trials); returns their ids. Each runs ``steps`` optimizer steps.

        Raises:
            UnschedulableError: a config fits on no allowed number of GPUs, unless
                ``skip_unschedulable`` (then it is listed in :attr:`unschedulable` and not run).
        """
        per_config = [steps] * len(configs) if isinstance(steps, int) else list(steps)
        if len(per_config) != len(configs):
            raise PloraError(f"got {len(per_config)} step counts for {len(configs)} configs; give one per config")
        if any(int(s) != s or s < 1 for s in per_config):
            raise PloraError(f"steps must be positive whole numbers, got {sorted(set(per_config))[:3]}")
        first = len(self.configs)
        ids = list(range(first, first + len(configs)))
        self.configs += list(configs)
        self.steps += [int(s) for s in per_config]
        new_types = False
        for cid in ids:
            t = ConfigType(self.configs[cid], self.steps[cid])
            if t.key not in self._type_of:
                self._type_of[t.key] = len(self._types)
                self._types.append(t)
                self._pending.append([])
                new_types = True
        if new_types:
            self._search = self._new_search(self._search)
            self._min_degree = [self._smallest_degree(i) for i in range(len(self._types))]
        bad = [cid for cid in ids if self._min_degree[self._type_of[self._key(cid)]] == 0]
        if bad and not skip_unschedulable:
            message = self._unschedulable_message(bad)
            del self.configs[first:], self.steps[first:]  # leave the planner as it was
            raise UnschedulableError(message, bad)
        self.unschedulable += bad
        for cid in ids:
            if cid not in bad:
                self._pending[self._type_of[self._key(cid)]].append(cid)
        self._search.forget()  # the pool grew: cached optima are no longer valid
        self._area = None
        return ids

    @property
    def search(self) -> PackSearch:
        """The pack ILPs over this planner's config types."""
        return self._search

    def type_index(self, cid: int) -> int:
        """Index of config ``cid``'s type in :attr:`search`."""
        return self._type_of[self._key(cid)]

    def min_degree(self, cid: int) -> int:
        """Fewest GPUs (a power of two) config ``cid`` fits on alone; 0 if none allowed."""
        return self._min_degree[self.type_index(cid)]

    def _key(self, cid: int) -> tuple[int, int, int]:
        return (self.configs[cid].rank, self.configs[cid].batch_size, self.steps[cid])

    def _smallest_degree(self, type_index: int) -> int:
        return next((d for d in powers_of_two(self.max_degree) if self._search.fits_alone(type_index, d)), 0)

    def _unschedulable_message(self, ids: Sequence[int]) -> str:
        limit = self.memory_limit / 2**30
        first = ids[0]
        need = self.cost_model.peak_memory([self.configs[first]], self.max_degree) / 2**30
        names = ", ".join(f"#{i} ({self.configs[i].label()})" for i in ids[:5])
        more = f" and {len(ids) - 5} more" if len(ids) > 5 else ""
        return (
            f"config {names}{more} cannot fit even alone on {self.max_degree} GPU(s): config #{first} "
            f"needs {need:.1f} GiB per GPU, the limit is {limit:.1f} GiB; use more or larger GPUs, a "
            "smaller batch size or rank, activation checkpointing, or --allow-unschedulable to plan the rest"
        )

    # ---- decisions ----------------------------------------------------------------------
    @property
    def pending(self) -> list[int]:
        """Config ids not yet started."""
        return sorted(cid for ids in self._pending for cid in ids)

    def free_gpus(self) -> list[int]:
        busy = {g for p in self.running.values() for g in p.gpus}
        return [g for g in range(self.num_gpus) if g not in busy]

    def _counts(self) -> np.ndarray:
        return np.array([len(ids) for ids in self._pending], dtype=int)

    def _type_area(self) -> np.ndarray:
        """GPU-seconds one config of each type takes in a pack of its own kind at the best degree.

        An estimate for work not yet planned (mixed packs can do a little better).
        """
        if self._area is None:
            rates = np.array([self._search.homogeneous_rate(i, self.max_degree) for i in range(len(self._types))])
            fits = rates > 0  # types that fit nowhere are never pending
            self._area = np.divide(self._search.work, rates, out=np.zeros_like(rates), where=fits)
        return self._area

    def next_packs(self, free_gpus: Sequence[int] | None = None, now: float | None = None) -> list[PlannedPack]:
        """Packs to start now on ``free_gpus`` (default: every GPU not running a pack)."""
        if now is not None:
            self.now = max(self.now, now)
        free = sorted(self.free_gpus() if free_gpus is None else free_gpus)
        busy = {g for p in self.running.values() for g in p.gpus}
        if busy & set(free) or any(not 0 <= g < self.num_gpus for g in free):
            raise PloraError(f"GPUs {sorted(busy & set(free))} are running packs or unknown; pass only free ones")
        counts = self._counts()
        if not free or not counts.any():
            return []
        area = self._type_area()
        running_end = max((p.end for p in self.running.values()), default=self.now)
        running_area = sum(p.degree * max(p.end - self.now, 0.0) for p in self.running.values())
        drift = self.drift

        def estimate(choices: list[PackChoice]) -> float:
            left = counts - sum(c.counts for c in choices)
            end = max([running_end] + [self.now + c.seconds * drift for c in choices])
            used = running_area + sum(c.degree * c.seconds * drift for c in choices) + float(area @ left)
            return max(end, self.now + used / self.num_gpus)

        # Packs should end by when the remaining work could end at the best rate (the horizon).
        horizon = None
        if self.horizon_slack is not None:
            ideal_end = max(running_end, self.now + (running_area + float(area @ counts)) / self.num_gpus)
            horizon = self.horizon_slack * (ideal_end - self.now)
        choices = decompose(
            self._search, len(free), counts, max_degree=self.max_degree, estimate=estimate, horizon=horizon
        )
        packs = [self._take(choice) for choice in choices]
        if self.fill:
            self._fill(packs, [choice.degree for choice in choices])
        started = [self._start(ids, choice, free) for ids, choice in zip(packs, choices)]
        if self.rotate and not free:  # no GPU left idle: the waiting configs take turns in the new packs
            self._rotate_in(started)
        return started

    def _take(self, choice: PackChoice) -> list[int]:
        """The pending config ids of the types ``choice`` counts (earliest first), taken off the queue."""
        ids: list[int] = []
        for t, n in enumerate(choice.counts):
            ids += self._pending[t][:n]
            del self._pending[t][:n]
        return sorted(ids)

    def _fill(self, packs: list[list[int]], degrees: list[int]) -> None:
        """Give pending configs to the starting ``packs`` (config ids, on ``degrees`` GPUs) they fit in."""
        cm, cap = self.cost_model, self.max_pack_size or math.inf

        def fits(k: int, ids: list[int]) -> bool:
            return len(ids) <= cap and cm.peak_memory([self.configs[i] for i in ids], degrees[k]) <= self.memory_limit

        def seconds(k: int, ids: list[int]) -> float:
            return cm.pack_seconds([self.configs[i] for i in ids], [self.steps[i] for i in ids], degrees[k])

        self._unqueue(spread_deferred(packs, self.pending, self.steps, fits=fits, seconds=seconds))

    def _unqueue(self, placed: list[int]) -> None:
        """Take configs given to packs off the pending queue."""
        gone = set(placed)
        self._pending = [[i for i in ids if i not in gone] for ids in self._pending]

    def _rotate_in(self, started: list[PlannedPack]) -> None:
        """Give the waiting configs that fit one GPU to the single-GPU packs starting now, longest
        first, each to the pack that then ends earliest; there they take turns with the members,
        as many training at once as fit (:meth:`CostModel.rotating_pack_seconds`)."""
        packs = [p for p in started if p.degree == 1]
        waiting = [cid for cid in self.pending if self.min_degree(cid) == 1]
        if not packs or not waiting:
            return
        groups = [list(p.configs) for p in packs]
        spans: dict[frozenset[int], float] = {}  # each group weighed is played once

        def seconds(_: int, ids: list[int]) -> float:
            key = frozenset(ids)
            if key not in spans:
                spans[key] = self._rotating_seconds(ids)
            return spans[key]

        self._unqueue(spread_deferred(groups, waiting, self.steps, fits=lambda k, ids: True, seconds=seconds))
        for pack, ids in zip(packs, groups):
            if len(ids) > len(pack.configs):
                span = seconds(0, ids)
                pack.configs = ids
                pack.end = pack.start + span * self.drift
                self._model_seconds[pack.pack_id] = span

    def _rotating_seconds(self, ids: list[int]) -> float:
        """The pack's span; ties in steps left go to the earlier config, whatever order ``ids`` come in."""
        configs = [self.configs[i] for i in sorted(ids)]
        steps = [self.steps[i] for i in sorted(ids)]
        return self.cost_model.rotating_pack_seconds(
            configs, steps, memory_limit=self.memory_limit, max_members=self.max_pack_size
        )

    def _start(self, ids: list[int], choice: PackChoice, free: list[int]) -> PlannedPack:
        gpus = [free.pop(0) for _ in range(choice.degree)]
        configs = [self.configs[i] for i in ids]
        steps = [self.steps[i] for i in ids]
        seconds = self.cost_model.pack_seconds(configs, steps, choice.degree)
        pack = PlannedPack(
            pack_id=self._next_id,
            configs=ids,
            degree=choice.degree,
            gpus=gpus,
            start=self.now,
            end=self.now + seconds * self.drift,
            memory_bytes=self.cost_model.peak_memory(configs, choice.degree),
            step_seconds=self.cost_model.step_seconds(configs, choice.degree),
            steps=max(steps),
            solver=choice.solver,
            width=len(ids),
        )
        self._next_id += 1
        self._model_seconds[pack.pack_id] = seconds
        self.running[pack.pack_id] = pack
        return pack

    @property
    def drift(self) -> float:
        """Actual ÷ predicted seconds over finished packs; scales predictions of new packs."""
        return self._actual / self._predicted if self._predicted > 0 else 1.0

    def finished(self, pack_id: int, actual_seconds: float | None = None) -> PlannedPack:
        """Record that a pack ended (after ``actual_seconds``; default: as predicted); frees its GPUs.

        A pack that ends later than predicted moves the clock past other packs' predicted ends;
        those are re-predicted to end no earlier than now, and the next :meth:`next_packs` plans
        with the true clock.
        """
        if pack_id not in self.running:
            raise PloraError(f"pack {pack_id} is not running; finished() takes the id of a running pack")
        pack = self.running.pop(pack_id)
        predicted = self._model_seconds.pop(pack_id)
        if actual_seconds is not None:
            if not actual_seconds >= 0:
                raise PloraError(f"actual_seconds must be ≥ 0, got {actual_seconds}")
            self._predicted += predicted
            self._actual += actual_seconds
            pack.end = pack.start + actual_seconds
        self.now = max(self.now, pack.end)
        for other in self.running.values():
            other.end = max(other.end, self.now)
        self.completed.append(pack)
        return pack


def run_to_completion(planner: JobPlanner) -> list[PlannedPack]:
    """Play the planner forward with predicted durations; returns running + future packs."""
    packs = list(planner.running.values())
    while True:
        packs += planner.next_packs()
        if not planner.running:
            break
        t = min(p.end for p in planner.running.values())
        for pack in [p for p in planner.running.values() if p.end <= t + _EPS]:
            planner.finished(pack.pack_id)
    if planner.pending:
        raise PloraError(f"configs {planner.pending[:5]} could not be placed on {planner.num_gpus} GPUs")
    return sorted(packs, key=lambda p: (p.start, p.pack_id))


def list_schedule(jobs: Sequence[tuple[int, float]], num_gpus: int) -> float:
    """Makespan of ``(degree, seconds)`` jobs started in order as GPUs free up (with backfill)."""
    queue = list(jobs)
    running: list[tuple[float, int]] = []
    now, free = 0.0, num_gpus
    while queue or running:
        waiting = []
        for degree, seconds in queue:
            if degree <= free:
                free -= degree
                heapq.heappush(running, (now + seconds, degree))
            else:
                waiting.append((degree, seconds))
        queue = waiting
        if not running:
            if queue:
                raise PloraError(f"a job needs {queue[0][0]} GPUs but the pool has {num_gpus}")
            break
        now, degree = heapq.heappop(running)
        free += degree
        while running and running[0][0] <= now + _EPS:
            free += heapq.heappop(running)[1]
    return now
