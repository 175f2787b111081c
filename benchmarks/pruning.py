"""Pruning benchmark: the paper120 grid with ASHA vs without, on this CPU.

Usage::

    python benchmarks/pruning.py [--steps 12] [--out benchmarks/results/pruning-cpu.json]

Both runs train the 120 configs of search_spaces/paper120.yaml (rank × alpha × lr × batch) on the
embedded SmolLM2-135M and the synthetic task, through ``study.optimize`` with packed trials, in
fresh run directories. With ASHA (Optuna's SuccessiveHalvingPruner) every adapter is scored on
``--eval-limit`` eval documents every ``--interval`` steps; pruned adapters leave their pack and
their slot trains the next trial. Reported: wall time of each run, trials pruned, adapter-steps
trained, the best config of each run and whether ASHA found the same one (or how far its best
is from the unpruned best). The JSON records date, machine, versions and the command; a short
table prints last.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import shlex
import sys
import tempfile
import time
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")

import optuna  # noqa: E402
import torch  # noqa: E402

from plora_hpo import PackedObjective, PackedSweep, SweepTracker, create_study, load_sweep  # noqa: E402


def run(pruner: str, args: argparse.Namespace, work: Path) -> dict:
    config = load_sweep(ROOT / "search_spaces" / "paper120.yaml")
    config = config.model_copy(
        update={
            "name": f"paper120-{pruner}",
            "model": "smollm2-135m",
            "tasks": ["synthetic"],
            "seq_len": 64,
            "budget": config.budget.model_copy(update={"steps": args.steps, "epochs": None}),
            "evaluation": config.evaluation.model_copy(update={"limit": args.eval_final, "batch_size": 64}),
            "pack": config.pack.model_copy(update={"size": args.pack_size, "gather_seconds": 2.0}),
            "pruning": config.pruning.model_copy(
                update={"pruner": pruner, "interval": args.interval, "eval_limit": args.eval_limit}
            ),
        }
    )
    run_dir = work / pruner
    tracker = SweepTracker(f"sqlite:///{run_dir / 'mlflow.db'}", config.name, artifact_root=run_dir)
    started = time.perf_counter()
    with PackedSweep(config, tracker=tracker, run_dir=run_dir, device="cpu") as sweep:
        run_dir.mkdir(parents=True, exist_ok=True)
        tracker.start(config.name, {"pruner": pruner})
        study = create_study(config, "synthetic", f"sqlite:///{run_dir / 'optuna.db'}")
        optuna.logging.set_verbosity(optuna.logging.WARNING)
        study.optimize(PackedObjective(sweep, "synthetic"), n_trials=120, n_jobs=sweep.concurrency)
    tracker.finish()
    tracker.close()  # its store's process, which the next run's tracker does not share
    wall = time.perf_counter() - started
    trials = study.trials
    complete = [t for t in trials if t.state == optuna.trial.TrialState.COMPLETE]
    pruned = [t for t in trials if t.state == optuna.trial.TrialState.PRUNED]
    best = max(complete, key=lambda t: t.value)
    adapter_steps = sum(t.user_attrs.get("pruned_at_step", args.steps) for t in complete + pruned)
    return {
        "pruner": pruner,
        "wall_s": wall,
        "trials": len(trials),
        "complete": len(complete),
        "pruned": len(pruned),
        "failed": sum(t.state == optuna.trial.TrialState.FAIL for t in trials),
        "adapter_steps": adapter_steps,
        "best": {"number": best.number, "params": best.params, "value": best.value},
        "values": {json.dumps(t.params, sort_keys=True): t.value for t in complete},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12, help="optimizer steps per adapter")
    parser.add_argument("--interval", type=int, default=4, help="ASHA: score every N steps (min resource)")
    parser.add_argument("--eval-limit", type=int, default=32, help="eval documents per intermediate score")
    parser.add_argument("--eval-final", type=int, default=64, help="eval documents of the final score")
    parser.add_argument("--pack-size", type=int, default=8)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "pruning-cpu.json")
    args = parser.parse_args()
    torch.set_num_threads(os.cpu_count() or 1)

    with tempfile.TemporaryDirectory() as tmp:
        rows = [run(pruner, args, Path(tmp)) for pruner in ("none", "asha")]
    full, asha = rows
    best_full = full["best"]
    asha_value_of_full_best = asha["values"].get(json.dumps(best_full["params"], sort_keys=True))
    summary = {
        "speedup_wall": full["wall_s"] / asha["wall_s"],
        "adapter_steps_saved": 1 - asha["adapter_steps"] / full["adapter_steps"],
        "same_best_config": asha["best"]["params"] == best_full["params"],
        "asha_best_value": asha["best"]["value"],
        "full_best_value": best_full["value"],
        "full_best_completed_under_asha": asha_value_of_full_best is not None,
        "asha_best_rank_in_full": 1
        + sum(v > full["values"][json.dumps(asha["best"]["params"], sort_keys=True)] for v in full["values"].values()),
    }
    result = {
        "benchmark": "pruning",
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "python": platform.python_version()},
        "versions": {p: metadata.version(p) for p in ("torch", "optuna", "transformers", "lm_eval", "mlflow")},
        "command": shlex.join([Path(sys.executable).name, *sys.argv]),
        "settings": vars(args) | {"out": str(args.out)},
        "summary": summary,
        "runs": [{k: v for k, v in r.items() if k != "values"} for r in rows],
        "values": {r["pruner"]: r["values"] for r in rows},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"{'run':8} {'wall s':>8} {'complete':>8} {'pruned':>7} {'adapter-steps':>13}  best (value)")
    for r in rows:
        b = r["best"]
        print(
            f"{r['pruner']:8} {r['wall_s']:8.0f} {r['complete']:8d} {r['pruned']:7d} {r['adapter_steps']:13d}  "
            f"r{b['params']['rank']} x{b['params']['alpha_multiplier']} lr{b['params']['learning_rate']:.0e} "
            f"b{b['params']['batch_size']} ({b['value']:.4f})"
        )
    print(
        f"ASHA: {summary['speedup_wall']:.2f}x faster, {summary['adapter_steps_saved']:.0%} fewer adapter-steps, "
        f"same best config: {summary['same_best_config']} (ASHA's best ranks #{summary['asha_best_rank_in_full']} "
        "without pruning)"
    )


if __name__ == "__main__":
    main()
