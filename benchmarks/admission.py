"""Admission benchmark: the sweep's pack admission policies under the H200 cost model, on this CPU.

Usage (the recorded run; about a minute on 2 shared cores)::

    python benchmarks/admission.py [--out benchmarks/results/admission-cpu.json] [--quick]
        [--pack-size 32] [--adaptive-samples 1000]

What it measures, and why: the sweep's device workers do not run the job planner's whole plan;
each device keeps one pack running and asks its admission policy (``plora_hpo.admission``) which
waiting trials join whenever the pack starts or a member finishes (continuous refill). This
benchmark replays that worker loop as an event simulation under the calibrated H200 cost model
and compares, on the same configs and devices:

* ``planner``: :class:`~plora_hpo.admission.PlannerAdmission` (the default, pack ILP, longest
  first) — its simulated makespan and the wall seconds of every admission decision on this
  machine (goal: ≤ 1 s for 120 queued trials on 2 CPU cores), and which solver ran;
* ``fifo``: :class:`~plora_hpo.admission.FifoAdmission` (arrival order, no overtaking);
* ``plan``: the job planner's offline plan (:func:`plora_hpo.planner.plan_packs`) of the same
  configs: its makespan, its Min-GPU / Max-GPU / greedy baselines and its lower bound.

The simulation: N devices, one shared waiting list in the sampler's proposal order (paper120: the
grid in the order Optuna's seeded GridSampler proposes it, as the sweep's ``make_sampler`` builds
it; adaptive: 1000 seeded draws of the project's SearchSpace, as ``benchmarks/planner.py`` takes
them). At time 0 each device in turn asks its policy for a pack. A pack's step takes
``cost_model.step_seconds(member configs)``; every member runs its own step budget (one epoch of
the task's training split: mixed budgets by batch size). Time advances to the next member
finishing on any device; that device drops its finished members and asks its policy to refill
from the waiting list with ``Room(members, free slots, 0.9 × GPU memory, cost model)``, as
``DeviceWorker.room`` builds it, naming the other devices idle at that moment (fifo then takes an
even share of the waiting trials; the planner plans one pack per idle device at once and the idle
devices start the packs planned for them, as they claim the pool's reservations); idle devices
start a pack whenever trials wait.
Makespan: when the last trial finishes. Not modelled: out-of-memory splits (the memory correction
stays 1), pruning, evaluation, the gather wait, host-side overheads between steps.

Cost model: GpuSpec H200 (139.8 GiB, the bf16 matmul rate measured in
benchmarks/results/throughput-h200.json) with the calibration fitted on that file's packed-engine
runs of the model (the prior, whose constants were fitted to plora_hpo/planner/peft_h200.py's
PEFT table, when there are none); the workload is the sweep's (seq 512, seven targets, bf16, no
micro-batching, no checkpointing), the one ``plan_packs`` builds.

The JSON records date, machine, versions and the exact command; a short table prints last.
"""

from __future__ import annotations

import argparse
import datetime as dt
import heapq
import json
import os
import platform
import shlex
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import _bootstrap  # noqa: F401  (makes plora_hpo importable from a bare checkout)
import optuna
from planner import configs_of, engine_observations, versions

from plora_hpo.adapter import AdapterConfig
from plora_hpo.admission import AdmissionPolicy, Candidate, FifoAdmission, PlannerAdmission, Room
from plora_hpo.config import load_sweep
from plora_hpo.planner import Calibration, CostModel, GpuSpec, Workload, plan_packs, steps_for_epochs
from plora_hpo.planner.cli import TRAIN_EXAMPLES
from plora_hpo.planner.observations import fit_calibration
from plora_hpo.shapes import shape_by_name
from plora_hpo.space import SearchSpace
from plora_hpo.study import make_sampler
from plora_hpo.worker import LOAD_FACTOR

ROOT = Path(__file__).resolve().parents[1]
H200_GIB = 139.8  # what torch reports for one H200 (as benchmarks/planner.py's accuracy rows use)
SEQ_LEN = 512


# --- inputs ---------------------------------------------------------------------------------------
def proposal_order(space_file: str, samples: int | None) -> tuple[list[AdapterConfig], list[int], str, tuple]:
    """Configs in the order the sweep's sampler proposes them, their epoch budgets, the task, the targets."""
    sweep = load_sweep(ROOT / space_file)
    if samples is None:  # a grid: Optuna's seeded GridSampler, as the sweep's make_sampler builds it
        space = SearchSpace(sweep.space, seed=sweep.seed)
        optuna.logging.set_verbosity(optuna.logging.WARNING)
        study = optuna.create_study(sampler=make_sampler(sweep, space), direction="maximize")
        # asked without telling, as the sweep's concurrent trials are (GridSampler skips running points)
        configs = [space.suggest(study.ask()) for _ in range(space.grid_size())]
        if len({c.label() for c in configs}) != len(configs):
            raise RuntimeError("the grid sampler proposed a point twice")
        task = sweep.tasks[0]
        steps = steps_for_epochs(configs, epochs=sweep.budget.epochs, train_examples=TRAIN_EXAMPLES[task])
    else:  # seeded draws of the project's SearchSpace, in draw order (benchmarks/planner.py's sample)
        configs, steps, _ = configs_of(space_file, samples)
        task = sweep.tasks[0]
    return configs, steps, task, tuple(sweep.target_modules)


def h200_cost_model(model: str, targets: tuple[str, ...]) -> tuple[CostModel, GpuSpec, Calibration, str]:
    """The H200 cost model the sweep's worker would use after calibrating on the measured runs."""
    runs, tflops = engine_observations()
    gpu = GpuSpec("H200", H200_GIB, matmul_tflops=tflops) if tflops else GpuSpec("H200", H200_GIB)
    shape = shape_by_name(model)
    mine = [obs for m, obs, _ in runs if m == model]
    if mine:
        calibration = fit_calibration(mine, shape, gpu)
        source = f"fitted on {len(mine)} packed-engine H200 runs of benchmarks/results/throughput-h200.json"
    else:
        calibration, source = Calibration(), "prior (no packed-engine H200 runs of this model)"
    workload = Workload(shape, SEQ_LEN, targets)
    return CostModel(workload, gpu, calibration), gpu, calibration, source


# --- the worker loop, simulated -------------------------------------------------------------------
def simulate(
    configs: list[AdapterConfig],
    steps: list[int],
    cm: CostModel,
    gpus: int,
    pack_size: int,
    make_policy: Callable[[], AdmissionPolicy],
) -> dict:
    """Continuous-refill packs on ``gpus`` devices sharing one waiting list (see the module doc)."""
    memory_limit = LOAD_FACTOR * cm.gpu.memory_bytes
    policies = [make_policy() for _ in range(gpus)]
    waiting = list(range(len(configs)))  # proposal order
    members: list[dict[int, int]] = [{} for _ in range(gpus)]  # trial -> steps left
    since = [0.0] * gpus  # when the device's composition last changed
    step_s = [0.0] * gpus
    finished_at = [0.0] * len(configs)
    decisions: list[dict] = []
    busy_member_seconds = [0.0] * gpus
    busy_seconds = [0.0] * gpus
    packs_started = 0
    over_memory = 0
    events: list[tuple[float, int, int]] = []  # (time, device, the device's event version)
    version = [0] * gpus  # an event is stale once its device's composition changed again

    def left_room(d: int) -> bool:
        """Whether a waiting trial (one per rank and batch size) would still have fit after the decision."""
        if not waiting or len(members[d]) >= pack_size:
            return False
        room = Room(tuple(configs[i] for i in members[d]), pack_size - len(members[d]), memory_limit, cm)
        kinds = {(configs[i].rank, configs[i].batch_size): configs[i] for i in waiting}
        return any(room.fits([c]) for c in kinds.values())

    def refill(d: int, now: float) -> None:
        nonlocal packs_started, over_memory
        if waiting and len(members[d]) < pack_size:
            idle_peers = sum(1 for e in range(gpus) if e != d and not members[e])
            room = Room(
                members=tuple(configs[i] for i in members[d]),
                free_slots=max(0, pack_size - len(members[d])),
                idle_peers=idle_peers,
                memory_limit=memory_limit,
                cost_model=cm,
            )
            policy = policies[d]
            chosen = policy.select([Candidate(configs[i], steps[i]) for i in waiting], room)
            last = policy.last
            decisions.append(
                {"waiting": len(waiting), "started": len(chosen), "seconds": last.seconds, "solver": last.solver}
            )
            if chosen and not members[d]:
                packs_started += 1
            picked = set(chosen)
            for k in chosen:
                members[d][waiting[k]] = steps[waiting[k]]
            # packs the planner made for the idle devices: each claims one (the pool's reservations)
            idle = [e for e in range(gpus) if e != d and not members[e]]
            for e, pack in zip(idle, last.peer_packs):
                for k in pack:
                    members[e][waiting[k]] = steps[waiting[k]]
                picked.update(pack)
                packs_started += 1
                step_s[e] = cm.step_seconds([configs[i] for i in members[e]])
                since[e] = now
                version[e] += 1
                heapq.heappush(events, (now + min(members[e].values()) * step_s[e], e, version[e]))
            waiting[:] = [t for k, t in enumerate(waiting) if k not in picked]
            decisions[-1]["left_room"] = left_room(d)
        if members[d]:
            pack = [configs[i] for i in members[d]]
            if len(pack) > 1 and cm.peak_memory(pack) > memory_limit:
                over_memory += 1
            step_s[d] = cm.step_seconds(pack)
            since[d] = now
            version[d] += 1
            heapq.heappush(events, (now + min(members[d].values()) * step_s[d], d, version[d]))

    started = time.perf_counter()
    for d in range(gpus):
        refill(d, 0.0)
    while events:
        now, d, v = heapq.heappop(events)
        if v != version[d]:
            continue
        ran = min(members[d].values())
        busy_seconds[d] += now - since[d]
        busy_member_seconds[d] += (now - since[d]) * len(members[d])
        for trial in list(members[d]):
            members[d][trial] -= ran
            if members[d][trial] == 0:
                del members[d][trial]
                finished_at[trial] = now
        refill(d, now)
        for e in range(gpus):  # idle devices wake up when trials wait (the pool notifies them)
            if e != d and not members[e] and waiting:
                refill(e, now)
    wall = time.perf_counter() - started
    assert not waiting and not any(members), "the simulation left trials unfinished"
    seconds = [x["seconds"] for x in decisions] or [0.0]
    queued_120 = [x["seconds"] for x in decisions if x["waiting"] >= 120]
    return {
        "makespan_s": max(finished_at),
        "packs_started": packs_started,  # a pack whose members all finished together counts again
        "devices_used": sum(x > 0 for x in busy_seconds),
        "admission_decisions": len(decisions),
        "plan_seconds_max": max(seconds),
        "plan_seconds_median": statistics.median(seconds),
        "plan_seconds_max_at_120_or_more_waiting": max(queued_120) if queued_120 else None,
        "plan_seconds_total": sum(x["seconds"] for x in decisions),
        "decisions_leaving_room": sum(x["left_room"] for x in decisions),  # a waiting trial still fitted
        "solvers": sorted({x["solver"] for x in decisions}),
        "mean_members_while_busy": sum(busy_member_seconds) / max(sum(busy_seconds), 1e-12),
        "gpu_busy_fraction": sum(busy_seconds) / (gpus * max(finished_at)),
        "packs_over_memory_limit": over_memory,
        "simulation_wall_seconds": wall,
    }


def solver_summary(solvers: list[str]) -> str:
    """'gurobi', 'highs', 'gurobi+highs', plus 'fell back' when a note says HiGHS replaced gurobipy."""
    names = {s for entry in solvers for s in ("gurobi", "highs") if s in entry.split(" (")[0]}
    text = "+".join(sorted(names, reverse=True)) or "none"
    if any("(" in entry for entry in solvers):
        text += " (fell back)"
    return text


def row(name: str, space_file: str, samples: int | None, model: str, gpus: int, pack_size: int) -> dict:
    configs, steps, task, targets = proposal_order(space_file, samples)
    cm, gpu, calibration, source = h200_cost_model(model, targets)
    print(f"{name}: {len(configs)} configs, {len(set(steps))} step budgets", flush=True)
    planner = simulate(configs, steps, cm, gpus, pack_size, lambda: PlannerAdmission(solver="auto", long_first=1.0))
    print(f"  planner admission {planner['makespan_s']:.0f} s ({planner['simulation_wall_seconds']:.1f} s wall)")
    highs = simulate(configs, steps, cm, gpus, pack_size, lambda: PlannerAdmission(solver="highs", long_first=1.0))
    print(f"  planner (HiGHS)   {highs['makespan_s']:.0f} s ({highs['simulation_wall_seconds']:.1f} s wall)")
    fifo = simulate(configs, steps, cm, gpus, pack_size, FifoAdmission)
    print(f"  fifo admission    {fifo['makespan_s']:.0f} s")
    started = time.perf_counter()
    schedule = plan_packs(
        configs,
        shape=model,
        seq_len=SEQ_LEN,
        gpu=gpu,
        num_gpus=gpus,
        steps=steps,
        targets=targets,
        max_pack_size=pack_size,
        load_factor=LOAD_FACTOR,
        calibration=calibration,
    )
    plan_wall = time.perf_counter() - started
    print(f"  job planner plan  {schedule.makespan:.0f} s ({plan_wall:.1f} s wall)", flush=True)
    b = schedule.baselines
    return {
        "name": name,
        "space": space_file,
        "task": task,
        "configs": len(configs),
        "step_budgets": sorted(set(steps)),
        "model": model,
        "gpus": gpus,
        "gpu_memory_gib": gpu.memory_gib,
        "memory_limit_gib": LOAD_FACTOR * gpu.memory_gib,
        "pack_size": pack_size,
        "calibration": {"source": source, **calibration.to_dict()},
        "planner_admission": planner,
        "planner_admission_highs": highs,
        "fifo_admission": fifo,
        "planner_over_fifo": planner["makespan_s"] / fifo["makespan_s"],
        "planner_solver": solver_summary(planner["solvers"]),
        "planner_highs_solver": solver_summary(highs["solvers"]),
        "job_plan": {
            "makespan_s": schedule.makespan,
            "planning_seconds": plan_wall,
            "solver": schedule.solver,
            "solver_note": schedule.solver_note,
            "packs": len(schedule.packs),
            "degrees": sorted({p.degree for p in schedule.packs}),
            "policy": schedule.policy,
            "baselines_s": b.to_dict(),
            "approximation_ratio": schedule.approximation_ratio,
        },
        "lower_bound_s": b.lower_bound,
        "planner_over_lower_bound": planner["makespan_s"] / b.lower_bound,
        "fifo_over_lower_bound": fifo["makespan_s"] / b.lower_bound,
        "planner_over_job_plan": planner["makespan_s"] / schedule.makespan,
    }


def print_table(rows: list[dict]) -> None:
    print(
        f"\n{'row':<24} {'planner s':>9} {'fifo s':>8} {'pl/fifo':>7} {'plan s':>8} {'lower s':>8} "
        f"{'min-GPU s':>9} {'max-GPU s':>9} {'max dec s':>9} {'med dec s':>9} {'HiGHS max':>9}  solver"
    )
    for r in rows:
        p, f, j = r["planner_admission"], r["fifo_admission"], r["job_plan"]
        print(
            f"{r['name']:<24} {p['makespan_s']:>9.0f} {f['makespan_s']:>8.0f} {r['planner_over_fifo']:>7.3f} "
            f"{j['makespan_s']:>8.0f} {r['lower_bound_s']:>8.0f} {j['baselines_s']['min_gpu']:>9.0f} "
            f"{j['baselines_s']['max_gpu']:>9.0f} {p['plan_seconds_max']:>9.3f} {p['plan_seconds_median']:>9.3f} "
            f"{r['planner_admission_highs']['plan_seconds_max']:>9.3f}  "
            f"{r['planner_solver']}"
        )
    print("(makespans: predicted H200 seconds; dec s: wall seconds of one planner admission decision on this CPU)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "admission-cpu.json"))
    parser.add_argument("--quick", action="store_true", help="paper120 qwen2.5-7b rows only")
    parser.add_argument("--pack-size", type=int, default=32)
    parser.add_argument("--adaptive-samples", type=int, default=1000)
    args = parser.parse_args()
    load_before = os.getloadavg()
    started = time.perf_counter()
    paper, adaptive, n = "search_spaces/paper120.yaml", "search_spaces/adaptive.yaml", args.adaptive_samples
    specs = [(f"paper120 7b {g} GPU", paper, None, "qwen2.5-7b", g) for g in (1, 8)]
    if not args.quick:
        specs += [(f"paper120 1.5b {g} GPU", paper, None, "qwen2.5-1.5b", g) for g in (1, 8)]
        specs += [(f"adaptive{n} 7b {g} GPU", adaptive, n, "qwen2.5-7b", g) for g in (1, 8)]
        specs += [(f"adaptive{n} 1.5b {g} GPU", adaptive, n, "qwen2.5-1.5b", g) for g in (1, 8)]
    rows = [row(name, space, samples, model, gpus, args.pack_size) for name, space, samples, model, gpus in specs]
    result = {
        "benchmark": "admission",
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "machine": {
            "platform": platform.platform(),
            "processor": platform.processor(),
            "cpu_count": os.cpu_count(),
            "load_average_1m_before_after": [load_before[0], os.getloadavg()[0]],  # other work slows the timings
        },
        "versions": {**versions(), "optuna": optuna.__version__},
        "command": shlex.join([sys.executable, *sys.argv]),
        "wall_seconds": time.perf_counter() - started,
        "notes": NOTES,
        "rows": rows,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"wrote {out}")
    print_table(rows)


NOTES = (
    "Makespans are predicted seconds on H200s (139.8 GiB, memory limit 0.9 x that, as DeviceWorker.room) under the "
    "cost model calibrated on benchmarks/results/throughput-h200.json's packed-engine runs of each model. planner / "
    "fifo: an event simulation of the device workers' continuous-refill loop (one pack per device, members leave "
    "when their own step budget ends, the policy refills at every finish; no OOM splits, pruning, evaluation or "
    "gather wait). plan: plan_packs on the same configs, GPUs, pack size and cost model (its packs may span several "
    "GPUs; its lower bound holds for any schedule, so also for the simulated ones). Proposal order: paper120 as "
    "Optuna's GridSampler(seed=0) proposes it; adaptive: SearchSpace(seed=0).enumerate_configs(N) draws. Step "
    "budgets: one epoch of the task's training split (cola 8551, mrpc 3668) by batch size. Pack size 32 for every "
    "row (adaptive.yaml's own is 16). Decision seconds are wall "
    "seconds of PlannerAdmission.select on this machine (2 shared cores); planner_admission uses solver='auto' "
    "(gurobipy's size-limited pip license, HiGHS beyond it), planner_admission_highs forces HiGHS. devices_used: "
    "devices that ever held a pack (the first devices to ask may take every waiting trial, up to the pack size)."
)


if __name__ == "__main__":
    main()
