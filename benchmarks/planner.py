"""Planner benchmark: planning time, plan quality, and cost-model accuracy, on this CPU.

Usage::

    python benchmarks/planner.py [--out benchmarks/results/planner-cpu.json] [--quick]

Rows:

* ``plan``: planning seconds, predicted makespan, baselines (Min GPU, Max GPU, greedy), lower
  bound, approximation ratio and speedups for paper120 on 8 × 80 GiB GPUs (goal ≤ 10 s) and for
  1000 configs sampled from search_spaces/adaptive.yaml on 64 GPUs (goal ≤ 60 s), with the
  uncalibrated prior and the default solver; paper120 is repeated with HiGHS forced;
* ``cli``: wall seconds of ``python -m plora_hpo.planner.cli search_spaces/paper120.yaml --model
  qwen2.5-7b --gpus 8 --gpu-memory-gib 80 --json`` as a fresh process (goal ≤ 10 s);
* ``accuracy``: cost model vs measured H200 runs — the eager PEFT table of
  plora_hpo/planner/peft_h200.py (full logits; rows ``design-6-peft``), and the packed-engine
  observations of benchmarks/results/throughput-h200{,-extras}.json (rows whose engine settings
  the cost model describes). Reported for the prior and for leave-one-out calibration (fit on the
  model's other runs, predict the held-out one). The PEFT prior's constants were fitted to that
  table, so its prior errors are in-sample;
* ``held_out``: packed-engine calibration fitted on the small/first packs of those runs,
  predicting the later K 32 packs (goal: memory within 10%, step within 15%).

The JSON records date, machine, versions and the exact command; a short table prints last.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import shlex
import subprocess
import sys
import tempfile
import time
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from plora_hpo.adapter import AdapterConfig  # noqa: E402
from plora_hpo.config import load_sweep  # noqa: E402
from plora_hpo.planner import Calibration, CostModel, GpuSpec, plan_packs, steps_for_epochs  # noqa: E402
from plora_hpo.planner.cli import TRAIN_EXAMPLES  # noqa: E402
from plora_hpo.planner.observations import Observation, fit_calibration, held_out_errors  # noqa: E402
from plora_hpo.planner.peft_h200 import PEFT_H200_REFERENCE  # noqa: E402
from plora_hpo.shapes import TARGET_MODULES, shape_by_name  # noqa: E402
from plora_hpo.space import SearchSpace  # noqa: E402

GIB = 2**30
THROUGHPUT_RESULT = ROOT / "benchmarks" / "results" / "throughput-h200.json"


def configs_of(space_file: str, samples: int | None) -> tuple[list[AdapterConfig], list[int], int]:
    sweep = load_sweep(ROOT / space_file)
    configs = SearchSpace(sweep.space, seed=sweep.seed).enumerate_configs(samples)
    steps = steps_for_epochs(configs, epochs=sweep.budget.epochs, train_examples=TRAIN_EXAMPLES[sweep.tasks[0]])
    return configs, steps, sweep.pack.size


def plan_row(name: str, space_file: str, samples: int | None, model: str, gpus: int, goal_s: float, **kw) -> dict:
    configs, steps, pack_size = configs_of(space_file, samples)
    started = time.perf_counter()
    schedule = plan_packs(
        configs,
        shape=model,
        seq_len=512,
        gpu=GpuSpec("H200", 80),
        num_gpus=gpus,
        steps=steps,
        max_pack_size=pack_size,
        calibration=Calibration(),
        **kw,
    )
    wall = time.perf_counter() - started
    b = schedule.baselines
    return {
        "kind": "plan",
        "name": name,
        "space": space_file,
        "configs": len(configs),
        "model": model,
        "gpus": gpus,
        "gpu_memory_gib": 80,
        "max_pack_size": pack_size,
        "solver": schedule.solver,
        "planning_seconds": wall,
        "goal_seconds": goal_s,
        "goal_met": wall <= goal_s,
        "packs": len(schedule.packs),
        "degrees": sorted({p.degree for p in schedule.packs}),
        "makespan_s": schedule.makespan,
        "baselines_s": b.to_dict(),
        "approximation_ratio": schedule.approximation_ratio,
        "speedups": schedule.speedups(),
        "policy": schedule.policy,
    }


def cli_row() -> dict:
    command = [
        sys.executable,
        "-m",
        "plora_hpo.planner.cli",
        "search_spaces/paper120.yaml",
        "--model",
        "qwen2.5-7b",
        "--gpus",
        "8",
        "--gpu-memory-gib",
        "80",
        "--json",
        "--no-gantt",
    ]
    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, "PLORA_HPO_CACHE": cache, "PYTHONPATH": str(ROOT)}
        started = time.perf_counter()
        done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, check=True)
        wall = time.perf_counter() - started
    out = json.loads(done.stdout)
    return {
        "kind": "cli",
        "command": "plora-hpo plan " + shlex.join(command[3:]),
        "wall_seconds": wall,
        "goal_seconds": 10.0,
        "goal_met": wall <= 10.0,
        "makespan_s": out["makespan"],
        "speedup_over_min_gpu": out["baselines"]["min_gpu"] / out["makespan"],
        "approximation_ratio": out["makespan"] / out["baselines"]["lower_bound"],
        "solver": out["solver"],
    }


def reference_observations() -> list[tuple[str, Observation]]:
    return [
        (
            model,
            Observation(
                (16,),
                (batch,),
                512,
                TARGET_MODULES,
                batch * 512 / tps,
                gib * GIB,
                logits_chunk_tokens=None,
                engine="peft",
            ),
        )
        for model, batch, tps, gib in PEFT_H200_REFERENCE
    ]


def engine_observations() -> tuple[list[tuple[str, Observation, str]], float | None]:
    """(model, observation, benchmark row) of every packed row of the throughput result whose
    engine settings the cost model describes, and the bf16 matmul TFLOP/s measured in that run."""
    if not THROUGHPUT_RESULT.is_file():
        return [], None
    data = json.loads(THROUGHPUT_RESULT.read_text())
    found = []
    for row in data.get("observations", []):
        obs = Observation.from_dict(row)
        if obs.modelled:
            found.append((row["model"].removeprefix("random:"), obs, row["name"]))
    return found, data["matmul_tflops"]


def accuracy_rows(source: str, observations: list[tuple[str, Observation]], tflops: float | None = None) -> list[dict]:
    """Prior and leave-one-out calibrated errors per run; ``tflops``: the rate measured with them."""
    gpu = GpuSpec("H200", 139.8, matmul_tflops=tflops) if tflops else GpuSpec("H200", 139.8)
    rows = []
    for i, (model, obs) in enumerate(observations):
        shape = shape_by_name(model)
        others = [o for j, (m, o) in enumerate(observations) if m == model and j != i]
        calibrated = fit_calibration(others, shape, gpu) if others else None
        row = {"kind": "accuracy", "source": source, "model": model, "ranks": obs.ranks, "batch_sizes": obs.batch_sizes}
        for label, calibration in (("prior", Calibration()), ("loo_calibrated", calibrated)):
            if calibration is None:
                continue
            cm = CostModel(obs.workload(shape), gpu, calibration)
            configs = obs.configs()
            row[f"{label}_step_error"] = cm.step_seconds(configs, obs.degree) / obs.step_seconds - 1
            row[f"{label}_memory_error"] = cm.peak_memory(configs, obs.degree) / obs.peak_bytes - 1
        row["measured_step_s"], row["measured_peak_gib"] = obs.step_seconds, obs.peak_bytes / GIB
        rows.append(row)
    return rows


def held_out_rows(found: list[tuple[str, Observation, str]], tflops: float) -> list[dict]:
    """Calibration fitted on the first/small packs, predicting later, larger ones (the held-out check):
    qwen2.5-1.5b: fit on the packs of fewer than 32 adapters, predict the K 32 packs; qwen2.5-7b
    (K 32 packs only): fit on the first (seq 512), predict the rest."""
    rows = []
    for model in sorted({m for m, *_ in found}):
        mine = [(o, n) for m, o, n in found if m == model]
        small = [x for x in mine if len(x[0].ranks) < 32]
        fit, predict = (small, [x for x in mine if len(x[0].ranks) >= 32]) if small else (mine[:1], mine[1:])
        if not fit or not predict:
            continue
        result = held_out_errors([o for o, *_ in fit], [o for o, *_ in predict], shape_by_name(model),
                                 GpuSpec("H200", 139.8, matmul_tflops=tflops))  # fmt: skip
        for (_, name), row in zip(predict, result["rows"]):
            rows.append({"kind": "held_out", "model": model, "row": name, "fit_on": [n for _, n in fit],
                         **{k: v for k, v in row.items() if k.endswith("error")}})  # fmt: skip
    return rows


def versions() -> dict[str, str]:
    out = {"python": platform.python_version()}
    for package in ("numpy", "scipy", "gurobipy", "highspy", "matplotlib"):
        try:
            out[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            out[package] = "absent"
    return out


def print_table(rows: list[dict]) -> None:
    print(
        f"\n{'plan':<28} {'configs':>7} {'gpus':>4} {'plan s':>7} {'goal':>5} {'makespan s':>10} "
        f"{'ratio':>6} {'vs min':>6} {'vs max':>7} {'vs greedy':>9}  solver"
    )
    for r in rows:
        if r["kind"] == "plan":
            s = r["speedups"]
            print(
                f"{r['name']:<28} {r['configs']:>7} {r['gpus']:>4} {r['planning_seconds']:>7.2f} "
                f"{'ok' if r['goal_met'] else 'MISS':>5} {r['makespan_s']:>10.0f} {r['approximation_ratio']:>6.3f} "
                f"{s['min_gpu']:>5.2f}x {s['max_gpu']:>6.2f}x {s['greedy']:>8.2f}x  {r['solver']}"
            )
        elif r["kind"] == "cli":
            print(
                f"{'cli (fresh process)':<28} {120:>7} {8:>4} {r['wall_seconds']:>7.2f} "
                f"{'ok' if r['goal_met'] else 'MISS':>5} {r['makespan_s']:>10.0f}"
            )
    accuracy = [r for r in rows if r["kind"] == "accuracy"]
    if accuracy:
        print(
            f"\n{'cost model vs H200':<30} {'runs':>4} {'prior step':>10} {'prior mem':>9} "
            f"{'LOO step':>8} {'LOO mem':>8}"
        )
        groups: dict[tuple[str, str], list[dict]] = {}
        for r in accuracy:
            groups.setdefault((r["source"], r["model"]), []).append(r)
        for (source, model), group in groups.items():

            def worst(key: str, group: list[dict] = group) -> str:
                values = [abs(r[key]) for r in group if key in r]
                return f"{100 * max(values):.1f}%" if values else "-"

            print(
                f"{source + ' ' + model:<30} {len(group):>4} {worst('prior_step_error'):>10} "
                f"{worst('prior_memory_error'):>9} {worst('loo_calibrated_step_error'):>8} "
                f"{worst('loo_calibrated_memory_error'):>8}"
            )
        print("(worst absolute relative error per model; LOO: calibrated on the model's other runs)")
    held = [r for r in rows if r["kind"] == "held_out"]
    if held:
        print(
            f"\n{'held out (calibrated on small/first packs)':<46} {'prior mem':>9} {'cal mem':>8} "
            f"{'prior step':>10} {'cal step':>8}"
        )
        for r in held:
            print(
                f"{r['row']:<46} {r['memory_prior_error']:>+9.3f} {r['memory_error']:>+8.3f} "
                f"{r['step_prior_error']:>+10.3f} {r['step_error']:>+8.3f}"
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "planner-cpu.json"))
    parser.add_argument("--quick", action="store_true", help="paper120 rows only (no 1000 × 64)")
    args = parser.parse_args()
    load_before = os.getloadavg()
    rows = [
        plan_row("paper120 qwen2.5-7b 8 GPUs", "search_spaces/paper120.yaml", None, "qwen2.5-7b", 8, 10.0),
        plan_row("paper120 qwen2.5-3b 8 GPUs", "search_spaces/paper120.yaml", None, "qwen2.5-3b", 8, 10.0),
        plan_row("paper120 qwen2.5-1.5b 8 GPUs", "search_spaces/paper120.yaml", None, "qwen2.5-1.5b", 8, 10.0),
        plan_row(
            "paper120 7b 8 GPUs (HiGHS)", "search_spaces/paper120.yaml", None, "qwen2.5-7b", 8, 10.0, solver="highs"
        ),
    ]
    if not args.quick:
        rows += [
            plan_row("1000 qwen2.5-1.5b 64 GPUs", "search_spaces/adaptive.yaml", 1000, "qwen2.5-1.5b", 64, 60.0),
            plan_row("1000 qwen2.5-7b 64 GPUs", "search_spaces/adaptive.yaml", 1000, "qwen2.5-7b", 64, 60.0),
        ]
    rows.append(cli_row())
    rows += accuracy_rows("design-6-peft", reference_observations())
    engine_runs, engine_tflops = engine_observations()
    if engine_runs:
        rows += accuracy_rows("throughput-h200", [(m, o) for m, o, _ in engine_runs], engine_tflops)
        rows += held_out_rows(engine_runs, engine_tflops)
    result = {
        "benchmark": "planner",
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "machine": {
            "platform": platform.platform(),
            "processor": platform.processor(),
            "cpu_count": os.cpu_count(),
            "load_average_1m_before_after": [load_before[0], os.getloadavg()[0]],  # other work slows the timings
        },
        "versions": versions(),
        "command": shlex.join([sys.executable, *sys.argv]),
        "notes": (
            "Times are predicted seconds under the uncalibrated cost-model prior of H200 GPUs (80 GiB, load factor "
            "0.9); epoch budgets use the task's training-split size. Approximation ratio = makespan / lower bound "
            "(total work / (GPUs x best per-GPU pack rate, from the ILP's proven bound), or the slowest config's "
            "fastest solo run). Accuracy rows compare with measured H200 runs; design-6 rows are in-sample for the "
            "PEFT prior. held_out rows: packed-engine calibration fitted on the small/first packs of a throughput "
            "run and evaluated on the later K32 packs (signed relative errors)."
        ),
        "rows": rows,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"wrote {out}")
    print_table(rows)


if __name__ == "__main__":
    main()
