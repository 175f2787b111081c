"""Admission: which waiting trials join a device's pack now, and with whom.

A device worker asks its :class:`AdmissionPolicy` whenever something changed: a pack is about
to start, a member finished, was pruned or failed, or new proposals arrived. The policy sees
the waiting trials (:class:`Candidate`) and the device's :class:`Room` (members already
training, free slots, memory budget, the worker's calibrated cost model) and returns which
candidates start now. Nothing else: it never touches the queue, the pack or the study.

- :class:`PlannerAdmission` (the default, ``pack.policy: planner``): PLoRA's pack ILP over the
  waiting trials' types (rank, batch size, step budget), on the device's remaining memory and
  slots, longest-running trials first (the job planner's policy on one device).
- :class:`FifoAdmission` (``pack.policy: fifo``): arrival order while the pack has room.
"""

from __future__ import annotations

import math
import time
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from plora_hpo.adapter import AdapterConfig
from plora_hpo.planner.cost_model import CostModel
from plora_hpo.planner.dtm import ConfigType, PackSearch
from plora_hpo.planner.fill import spread_deferred


@dataclass(frozen=True)
class Candidate:
    """A waiting trial as admission sees it: its config and how many steps it has to run."""

    config: AdapterConfig
    steps: int


@dataclass(frozen=True)
class Room:
    """What one device offers a pack right now.

    Attributes:
        members: configs already training in the pack (they stay).
        free_slots: adapters the pack may still take (``pack.size`` minus members).
        memory_limit: bytes a pack may use, in the cost model's (uncorrected) units.
        cost_model: the device's calibrated memory and step-time model.
        idle_peers: other devices of the sweep waiting for trials right now.
        degree: GPUs the pack is split over (a tensor-parallel group); ``memory_limit`` is per GPU.
    """

    members: tuple[AdapterConfig, ...]
    free_slots: int
    memory_limit: float
    cost_model: CostModel
    idle_peers: int = 0
    degree: int = 1

    def fits(self, configs: Sequence[AdapterConfig]) -> bool:
        """Whether ``configs`` join the members within the slots and the memory limit."""
        together = [*self.members, *configs]
        peak = self.cost_model.peak_memory(together, self.degree)
        return len(configs) <= self.free_slots and peak <= self.memory_limit


@dataclass
class Decision:
    """The last admission a policy made: for the sweep's record of pack decisions."""

    solver: str
    seconds: float
    peer_packs: list[list[int]] = field(default_factory=list)  # indices reserved for idle peers, a pack each


class AdmissionPolicy(ABC):
    """Chooses, from the waiting trials, those that start on a device now."""

    name: str

    def __init__(self) -> None:
        self.last: Decision | None = None

    @abstractmethod
    def select(self, waiting: Sequence[Candidate], room: Room) -> list[int]:
        """Indices into ``waiting`` of the trials to start now, in the order they should join.

        An empty pack (no members) must get at least one candidate when any waits, even one the
        cost model says does not fit: the worker then learns its true memory need (out of memory
        splits or fails it), instead of the trial waiting forever.
        """


class FifoAdmission(AdmissionPolicy):
    """Arrival order: the oldest waiting trials while the pack has room; the first that does not
    fit waits at the head of the queue (no overtaking)."""

    name = "fifo"

    def select(self, waiting: Sequence[Candidate], room: Room) -> list[int]:
        started = time.perf_counter()
        chosen: list[int] = []
        slots = fair_share(room.free_slots, len(waiting), room.idle_peers)
        for index, candidate in enumerate(waiting):
            if len(chosen) >= slots:
                break
            configs = [waiting[i].config for i in chosen] + [candidate.config]
            if not room.fits(configs) and (chosen or room.members):
                break
            chosen.append(index)
        self.last = Decision("arrival order", time.perf_counter() - started)
        return chosen


class PlannerAdmission(AdmissionPolicy):
    """PLoRA's pack ILP on one device: the waiting trials that give the pack the most useful
    tokens per second, longest-running ones first.

    A new pack while other devices also wait for trials is planned for all of them at once: the
    job planner (DTM, :class:`~plora_hpo.planner.JobPlanner`) splits the waiting trials into one
    pack per idle device, balancing their predicted ends; this device takes the first pack and
    the others are left in :attr:`Decision.peer_packs` for the caller to reserve for the idle
    devices, so one start follows one plan.

    The ILP (:class:`~plora_hpo.planner.dtm.PackSearch`, gurobipy or HiGHS) works on trial
    *types* (rank, batch size, steps), so planning 120 waiting trials solves a handful of small
    MILPs. Members already training stay; their adapter memory comes off the budget and their
    count off the slots. Within a type, earlier proposals go first.

    On a device with no idle peers, the trials the ILP leaves out join the starting pack while
    they fit (slots and memory): the ILP ranks packs by tokens per second, but a trial deferred
    to a later wave pays the same per-step fixed cost again there, and when the deferred trials
    run last they run nearly alone — one fuller pack ends the sweep sooner.

    Args:
        solver: ``"auto"`` (gurobipy, HiGHS beyond its size limit or without it), ``"gurobi"``
            or ``"highs"``.
        long_first: throughput (a fraction) given up to start longer-running trials first; 1
            always starts the longest class (longest-processing-time order), 0 pure throughput.
    """

    name = "planner"

    def __init__(self, *, solver: str = "auto", long_first: float = 1.0) -> None:
        super().__init__()
        self.solver = solver
        self.long_first = long_first

    def select(self, waiting: Sequence[Candidate], room: Room) -> list[int]:
        started = time.perf_counter()
        if not waiting or room.free_slots < 1:
            self.last = Decision("none needed", time.perf_counter() - started)
            return []
        if room.idle_peers > 0 and not room.members:
            packs, solver = self._plan_for_idle_devices(waiting, room)
            if packs:
                self.last = Decision(solver, time.perf_counter() - started, peer_packs=packs[1:])
                return packs[0]
        cm = room.cost_model
        slots = fair_share(room.free_slots, len(waiting), room.idle_peers)
        types: list[ConfigType] = []
        members_of: dict[tuple[int, int, int], list[int]] = {}
        for index, candidate in enumerate(waiting):
            t = ConfigType(candidate.config, candidate.steps)
            if t.key not in members_of:
                members_of[t.key] = []
                types.append(t)
            members_of[t.key].append(index)
        taken = sum(cm.memory_bytes(cm.adapter_memory_terms(c, room.degree)) for c in room.members)
        search = PackSearch(
            cm,
            types,
            memory_limit=room.memory_limit - taken,
            max_pack_size=slots,
            solver=self.solver,
            long_first=self.long_first,
        )
        counts = np.array([len(members_of[t.key]) for t in types], dtype=int)
        choice = search.best(room.degree, counts)
        chosen: list[int] = []
        if choice is not None:
            for t, n in zip(types, choice.counts):
                chosen += members_of[t.key][: int(n)]
        chosen.sort()
        while chosen and not room.fits([waiting[i].config for i in chosen]):
            chosen.pop()  # the ILP's linear memory views are bounds; the cost model decides
        if not chosen and not room.members:
            chosen = [max(range(len(waiting)), key=lambda i: (waiting[i].steps, -i))]
        elif room.idle_peers == 0:
            packs = [chosen]
            _spread_deferred(packs, waiting, replace(room, free_slots=slots))
            chosen = packs[0]
        self.last = Decision(_solver_label(search), time.perf_counter() - started)
        return chosen

    def _plan_for_idle_devices(self, waiting: Sequence[Candidate], room: Room) -> tuple[list[list[int]], str]:
        """The packs of a DTM plan over this device and its idle peers, this device's first; each
        trimmed to what the cost model says fits.

        The plan treats each device (or tensor-parallel group) as one GPU at one GPU's memory, which
        for a group is conservative; the room's degree-aware fit then trims and fills the packs."""
        from plora_hpo.planner.simulate import JobPlanner

        cm = room.cost_model
        planner = JobPlanner(
            cm,
            num_gpus=1 + room.idle_peers,
            load_factor=min(1.0, room.memory_limit / cm.gpu.memory_bytes),
            max_degree=1,
            max_pack_size=room.free_slots,
            solver=self.solver,
        )
        planner.add_configs([c.config for c in waiting], [c.steps for c in waiting], skip_unschedulable=True)
        packs = []
        for pack in planner.next_packs():
            chosen = sorted(pack.configs)
            while chosen and not room.fits([waiting[i].config for i in chosen]):
                chosen.pop()
            if chosen:
                packs.append(chosen)
        _spread_deferred(packs, waiting, room)
        return packs, f"job planner over {1 + room.idle_peers} idle devices: {_solver_label(planner.search)}"


def _spread_deferred(packs: list[list[int]], waiting: Sequence[Candidate], room: Room) -> None:
    """Give the waiting trials the plan left for a later wave to the starting packs they fit in
    (:func:`~plora_hpo.planner.fill.spread_deferred`), within the room's slots and memory."""
    if not packs:
        return
    planned = {i for pack in packs for i in pack}
    cm = room.cost_model

    def fits(_: int, together: list[int]) -> bool:
        return room.fits([waiting[i].config for i in together])  # slots and memory

    def seconds(_: int, together: list[int]) -> float:
        members = [waiting[i] for i in together]
        return cm.pack_seconds([c.config for c in members], [c.steps for c in members], room.degree)

    deferred = [i for i in range(len(waiting)) if i not in planned]
    spread_deferred(packs, deferred, [c.steps for c in waiting], fits=fits, seconds=seconds)


def _solver_label(search: PackSearch) -> str:
    """Which solver answered the pack ILPs (and why it fell back, if it did)."""
    label = ", ".join(sorted(search.solvers_used)) or "no solve needed"
    if search.solver_notes:
        label += f" ({'; '.join(sorted(search.solver_notes))})"
    return label


def fair_share(free_slots: int, waiting: int, idle_peers: int) -> int:
    """Slots a pack may fill now when ``idle_peers`` other devices also wait for trials: an even
    share of the waiting trials (rounded up), so the first device to ask does not take them all
    and leave the others idle."""
    if waiting <= 0:
        return 0
    return max(1, min(free_slots, math.ceil(waiting / (1 + max(0, idle_peers)))))


def make_admission(policy: str, *, solver: str = "auto") -> AdmissionPolicy:
    """The sweep file's ``pack.policy``: ``planner`` or ``fifo``."""
    if policy == "fifo":
        return FifoAdmission()
    return PlannerAdmission(solver=solver)
