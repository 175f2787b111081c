"""The restricted ILP F(d, K): which remaining configs form the best pack on ``d`` GPUs.

What is maximised: **useful training tokens per second of the pack over its whole life**.
Config ``k`` does ``steps_k`` optimizer steps of ``tokens_k`` tokens and leaves the pack when done,
so the pack runs in phases: between consecutive distinct step counts the same configs are alive.
Host launches and GPU work overlap, so a step costs the larger of the two, and the pack takes::

    D(H) = Σ_p len_p · max(c0 + Σ_{k alive in p} H_k c_k,  g0 + Σ_{k alive in p} H_k g_k)

(``c``: host seconds per step, ``g``: GPU seconds per step, ``0``: shared by the pack) — the same
duration the simulator uses. The objective is ``N(H) / D(H)`` with
``N(H) = Σ_k H_k · steps_k · tokens_k``, subject to ``Σ_k H_k · mem_k ≤ C · M_gpu − fixed(d)``,
optionally at most ``max_items`` configs and ``D(H) ≤ max_seconds``.

Linearisation: one continuous ``z_p ≥`` both forms per phase makes ``D = Σ_p z_p`` linear, and
the ratio is solved by Dinkelbach's method — maximise ``N(H) − λ·D``, set ``λ = N/D`` of the
answer, repeat until the maximum is ≈ 0; each round is one small MILP. The phases depend on the
pack's longest step count ``S``, so ``S`` is fixed per solve: the caller enumerates the distinct
step counts and keeps the best (with ``S`` fixed, phases beyond the chosen configs' own longest
count only overestimate ``D``, and that pack is also found, exactly, in its own class).

Identical configs (same rank, batch size and steps) are merged: the paper's binary ``H_k`` become
integer counts ``0 ≤ H_t ≤ n_t`` per type — an exact reformulation with far fewer variables.

Backends: gurobipy and HiGHS (highspy), both quiet. ``"auto"`` uses gurobipy
unless it is missing, unlicensed, or the model exceeds the pip license's 2000 variables / 2000
constraints, and then HiGHS; every answer says which solver ran. MILPs are solved to a 1e-4 gap
within a node budget; the solver's dual bound keeps the reported throughput bound valid regardless.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from plora_hpo.errors import PloraError

GUROBI_SIZE_LIMIT = 2000  # gurobipy's pip (size-limited) license: variables and constraints
SOLVERS = ("auto", "gurobi", "highs")
_GAP = 1e-4  # MIP gap, relative and absolute (scaled units: one config does ≤ 1 unit of work)
# Branch-and-bound nodes per MILP: a deterministic budget (the same plan on a busy or idle machine).
# Past it the incumbent is used and the dual bound keeps the throughput bound honest. The time limit
# is only a safety net.
_NODE_LIMIT = 1000
_TIME_LIMIT_S = 10.0
_MAX_ROUNDS = 60


@dataclass(frozen=True)
class PackProblem:
    """One restricted ILP instance over ``n`` config types and ``P`` phases.

    Attributes:
        work: (n,) useful tokens of one config of the type over its life (steps × tokens per step).
        memory: (n,) bytes per GPU one config of the type adds.
        available: (n,) configs of the type that remain.
        launch: (n,) host seconds per step one config adds.
        device: (n,) GPU seconds per step one config adds.
        alive: (P, n) 1 where the type is still training in the phase.
        phase_steps: (P,) steps in each phase.
        launch_fixed, device_fixed: seconds per step of the pack itself.
        capacity: bytes per GPU left for adapters (C · M_gpu − the pack's own bytes).
        max_items: most configs in one pack (None: no cap).
        max_seconds: the pack must end within this many seconds (None: no cap).
    """

    work: np.ndarray
    memory: np.ndarray
    available: np.ndarray
    launch: np.ndarray
    device: np.ndarray
    alive: np.ndarray
    phase_steps: np.ndarray
    launch_fixed: float
    device_fixed: float
    capacity: float
    max_items: int | None = None
    max_seconds: float | None = None

    @property
    def size(self) -> tuple[int, int]:
        """(variables, constraints) of one Dinkelbach round."""
        phases = len(self.phase_steps)
        extra = (self.max_items is not None) + (self.max_seconds is not None)
        return len(self.work) + phases, 1 + 2 * phases + extra

    def launch_rows(self) -> tuple[np.ndarray, np.ndarray]:
        """Host seconds of each phase: ``rows @ H + const``."""
        return self.phase_steps[:, None] * self.alive * self.launch, self.phase_steps * self.launch_fixed

    def device_rows(self) -> tuple[np.ndarray, np.ndarray]:
        """GPU seconds of each phase: ``rows @ H + const``."""
        return self.phase_steps[:, None] * self.alive * self.device, self.phase_steps * self.device_fixed

    def phase_seconds(self, counts: np.ndarray) -> np.ndarray:
        """Seconds of each phase with ``counts`` configs per type."""
        (lr, lc), (dr, dc) = self.launch_rows(), self.device_rows()
        return np.maximum(lr @ counts + lc, dr @ counts + dc)

    def single_seconds(self) -> np.ndarray:
        """(n,) duration of a pack holding one config of each type alone."""
        launch = self.launch_fixed + self.alive * self.launch
        device = self.device_fixed + self.alive * self.device
        return self.phase_steps @ np.maximum(launch, device)

    def seconds(self, counts: np.ndarray) -> float:
        """D(H): the pack's duration with ``counts`` configs per type."""
        return float(self.phase_seconds(counts).sum())

    def fits(self, counts: np.ndarray) -> bool:
        """Within the available counts, the memory and the pack size (exact, no solver tolerance)."""
        return bool(
            np.all(counts <= self.available)
            and self.memory @ counts <= self.capacity
            and (self.max_items is None or counts.sum() <= self.max_items)
        )

    def feasible(self, counts: np.ndarray) -> bool:
        """Fits and ends within ``max_seconds``."""
        return self.fits(counts) and (self.max_seconds is None or self.seconds(counts) <= self.max_seconds)


@dataclass(frozen=True)
class PackSolution:
    """The chosen counts per type and the pack's predicted throughput."""

    counts: np.ndarray
    throughput: float  # useful tokens per second (N / D)
    throughput_bound: float  # proven upper bound on the optimum (≥ throughput)
    work: float
    seconds: float
    solver: str
    rounds: int
    solver_note: str = ""  # why "auto" fell back to HiGHS


class _Gurobi:
    """A quiet, reused gurobipy environment; construction fails if gurobipy is unusable."""

    def __init__(self) -> None:
        import gurobipy as gp

        self.gp = gp
        self.env = gp.Env(empty=True)
        self.env.setParam("OutputFlag", 0)
        self.env.start()

    def solve(self, p: PackProblem, lam: float, start: np.ndarray) -> tuple[np.ndarray, float]:
        gp = self.gp
        (lr, lc), (dr, dc) = p.launch_rows(), p.device_rows()
        with gp.Model(env=self.env) as model:
            model.Params.MIPGap = _GAP
            model.Params.MIPGapAbs = _GAP
            model.Params.NodeLimit = _NODE_LIMIT
            model.Params.TimeLimit = _TIME_LIMIT_S
            x = model.addMVar(len(p.work), lb=0.0, ub=p.available.astype(float), vtype=gp.GRB.INTEGER)
            z = model.addMVar(len(p.phase_steps), lb=0.0)
            x.Start, z.Start = start, p.phase_seconds(start)
            model.setObjective(p.work @ x - lam * z.sum(), gp.GRB.MAXIMIZE)
            model.addConstr(p.memory @ x <= p.capacity)
            model.addConstr(z >= lr @ x + lc)
            model.addConstr(z >= dr @ x + dc)
            if p.max_items is not None:
                model.addConstr(x.sum() <= p.max_items)
            if p.max_seconds is not None:
                model.addConstr(z.sum() <= p.max_seconds)
            model.optimize()
            if model.SolCount == 0:  # no feasible point within the budget: keep the start
                return start, float(model.ObjBound)
            return np.rint(x.X).astype(int), float(model.ObjBound)


@functools.cache
def _gurobi() -> tuple[_Gurobi | None, str]:
    """gurobipy if usable, else None and why (cached: the license check costs a moment)."""
    try:
        return _Gurobi(), ""
    except ImportError:
        return None, "gurobipy is not installed"
    except Exception as err:  # gurobipy.GurobiError: no or invalid license
        return None, f"gurobipy unusable ({str(err).splitlines()[0]})"


class _Highs:
    """A quiet, reused HiGHS instance (highspy)."""

    def __init__(self) -> None:
        import highspy

        self.highspy = highspy
        with _stdout_silenced():  # the constructor prints a banner from C before options apply
            self.h = highspy.Highs()
        self.h.setOptionValue("output_flag", False)

    def solve(self, p: PackProblem, lam: float, start: np.ndarray) -> tuple[np.ndarray, float]:
        hs, h = self.highspy, self.h
        n, phases = len(p.work), len(p.phase_steps)
        (lr, lc), (dr, dc) = p.launch_rows(), p.device_rows()
        minus_z = -np.eye(phases)
        rows = [np.append(p.memory, np.zeros(phases))[None, :], np.hstack([lr, minus_z]), np.hstack([dr, minus_z])]
        upper = [np.array([p.capacity]), -lc, -dc]
        if p.max_items is not None:
            rows.append(np.append(np.ones(n), np.zeros(phases))[None, :])
            upper.append(np.array([p.max_items]))
        if p.max_seconds is not None:
            rows.append(np.append(np.zeros(n), np.ones(phases))[None, :])
            upper.append(np.array([p.max_seconds]))
        dense = np.vstack(rows)
        row_index, col_index = np.nonzero(dense)  # row-major: already CSR order
        indptr = np.searchsorted(row_index, np.arange(dense.shape[0] + 1)).astype(np.int32)
        bound = np.concatenate(upper)
        h.clearModel()
        h.addVars(n + phases, np.zeros(n + phases), np.append(p.available.astype(float), np.full(phases, hs.kHighsInf)))
        columns = np.arange(n + phases, dtype=np.int32)
        h.changeColsCost(n + phases, columns, np.append(p.work, np.full(phases, -lam)))
        h.changeColsIntegrality(n, columns[:n], np.array([hs.HighsVarType.kInteger] * n))
        h.addRows(
            len(bound),
            np.full(len(bound), -hs.kHighsInf),
            bound,
            len(col_index),
            indptr[:-1],
            col_index.astype(np.int32),
            dense[row_index, col_index],
        )
        h.changeObjectiveSense(hs.ObjSense.kMaximize)
        h.setOptionValue("mip_rel_gap", _GAP)
        h.setOptionValue("mip_abs_gap", _GAP)
        h.setOptionValue("mip_max_nodes", _NODE_LIMIT)
        h.setOptionValue("time_limit", _TIME_LIMIT_S)
        # No MIP start here: HiGHS 1.16 presolve can mis-map a start and stop at a wrong "optimum".
        h.run()
        info = h.getInfo()
        if info.primal_solution_status != 2:  # no feasible point within the budget: keep the start
            return start, float(info.mip_dual_bound)
        x = np.array(h.getSolution().col_value[:n])
        return np.rint(x).astype(int), float(info.mip_dual_bound)


@contextlib.contextmanager
def _stdout_silenced() -> Iterator[None]:
    """Send file descriptor 1 to /dev/null (for C code that prints), then restore it."""
    sys.stdout.flush()
    saved = os.dup(1)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 1)
            yield
    finally:
        os.dup2(saved, 1)
        os.close(saved)


@functools.cache
def _highs() -> _Highs:
    return _Highs()


def choose_solver(preference: str, problem: PackProblem) -> tuple[str, str]:
    """(solver that will run, why it was chosen over the preference; '' when it was not)."""
    if preference not in SOLVERS:
        raise PloraError(f"unknown solver {preference!r}; choose from {', '.join(SOLVERS)}")
    if preference == "highs":
        return "highs", ""
    gurobi, why = _gurobi()
    n_vars, n_cons = problem.size
    if gurobi is not None and max(n_vars, n_cons) > GUROBI_SIZE_LIMIT:
        why = f"{n_vars} variables / {n_cons} constraints exceed the gurobipy pip license limit of {GUROBI_SIZE_LIMIT}"
    if why and preference == "gurobi":
        raise PloraError(f"solver 'gurobi' requested but {why}; use --solver highs or auto")
    return ("highs", why) if why else ("gurobi", "")


def _scaled(p: PackProblem) -> PackProblem:
    """Bring work, seconds and bytes to order 1, so solver tolerances mean the same everywhere."""
    w = max(float(p.work.max()), 1e-300)
    s = max(float(p.phase_steps.sum()), 1e-300)
    t = max(float(max(p.launch.max(), p.device.max(), p.launch_fixed, p.device_fixed)), 1e-300)
    m = max(float(p.capacity), 1e-300)
    return PackProblem(
        p.work / w,
        p.memory / m,
        p.available,
        p.launch / t,
        p.device / t,
        p.alive,
        p.phase_steps / s,
        p.launch_fixed / t,
        p.device_fixed / t,
        p.capacity / m,
        p.max_items,
        None if p.max_seconds is None else p.max_seconds / (s * t),
    )


def maximise_throughput(
    problem: PackProblem, solver: str = "auto", start: np.ndarray | None = None
) -> PackSolution | None:
    """Dinkelbach's method on ``problem``; None when no single config fits.

    ``start`` (counts per type) is a first guess, used when feasible and better than the best
    single config: a good guess saves Dinkelbach rounds.
    """
    alone = problem.single_seconds()
    fits = (problem.available > 0) & (problem.memory <= problem.capacity)
    if problem.max_seconds is not None:
        fits &= alone <= problem.max_seconds
    if not fits.any() or problem.max_items == 0:
        return None
    name, note = choose_solver(solver, problem)
    solve = _gurobi()[0].solve if name == "gurobi" else _highs().solve
    scaled = _scaled(problem)

    def ratio(counts: np.ndarray) -> float:
        return float(scaled.work @ counts / scaled.seconds(counts))

    # Start from a feasible pack (the best single config or the guess): every round's maximum is ≥ 0.
    counts = np.zeros(len(alone), dtype=int)
    counts[int(np.argmax(np.where(fits, problem.work / alone, -np.inf)))] = 1
    if start is not None and start.any() and problem.feasible(start) and ratio(start) > ratio(counts):
        counts = start.astype(int)
    lam = ratio(counts)
    value = upper = 0.0
    rounds = 0
    while rounds < _MAX_ROUNDS:
        rounds += 1
        candidate, upper = solve(scaled, lam, counts)
        value = scaled.work @ candidate - lam * scaled.seconds(candidate)
        if value <= _GAP or not candidate.any() or not problem.fits(candidate):
            break
        counts = candidate
        lam = ratio(counts)
    seconds = problem.seconds(counts)
    work = float(problem.work @ counts)
    # Dinkelbach bound: optimum ≤ λ + max F(λ) / D_min, with D_min ≥ the pack's own seconds and
    # max F(λ) ≤ the solver's dual bound of the last round.
    d_min = float((scaled.phase_steps * max(scaled.launch_fixed, scaled.device_fixed)).sum())
    slack = max(upper, value, 0.0) / max(d_min, 1e-300)
    bound = work / seconds * (1 + slack / max(lam, 1e-300))
    return PackSolution(counts, work / seconds, bound, work, seconds, name, rounds, note)
