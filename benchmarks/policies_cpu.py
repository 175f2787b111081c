"""Admission policies in a real sweep on this CPU: planner vs first-come-first-served.

Usage::

    python benchmarks/policies_cpu.py [--out benchmarks/results/policies-cpu.json]

Both runs train the same 24 configs (rank {8, 16, 32, 64} × lr {1e-4, 4e-4} × batch {1, 2, 4},
alpha = rank) on the embedded SmolLM2-135M and the synthetic task, one epoch of 24 training
examples each (so 24, 12 or 6 steps: mixed batch sizes and step budgets), through the real
``plora-hpo sweep`` command (Optuna grid sampler, packed engine, lm-eval scoring, MLflow sqlite
store) in fresh run directories; only ``pack.policy`` differs. Reported per policy: wall time of
the sweep command, packs and compositions that ran (from the run's pack record), the slowest
admission decision, and every config's value; then whether both found the same best config and
how many configs got the same value (seeds belong to configs, so each config trains the same
data in either run; values may still differ where a pack's float sums differ). The JSON records
date, machine, versions and the command; a short table prints last.
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

import optuna
import yaml

ROOT = Path(__file__).resolve().parents[1]

SPACE = {
    "rank": {"choices": [8, 16, 32, 64]},
    "alpha_multiplier": {"choices": [1]},
    "learning_rate": {"choices": [1.0e-4, 4.0e-4]},
    "batch_size": {"choices": [1, 2, 4]},
}


def sweep_file(work: Path, policy: str, pack_size: int) -> Path:
    data = yaml.safe_load((ROOT / "search_spaces" / "demo.yaml").read_text())
    data.update(
        name=f"policies-{policy}",
        budget={"epochs": 1, "max_train_examples": 24},
        space=SPACE,
        evaluation={"limit": 32, "batch_size": 64},
        pack={"size": pack_size, "gather_seconds": 2, "policy": policy},
    )
    path = work / f"{policy}.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def run(policy: str, args: argparse.Namespace, work: Path) -> dict:
    path, run_dir = sweep_file(work, policy, args.pack_size), work / policy
    env = {**os.environ, "MLFLOW_DISABLE_TELEMETRY": "true", "PLORA_HPO_CACHE": str(work / f"cache-{policy}")}
    started = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "plora_hpo.cli", "sweep", str(path), "--run-dir", str(run_dir), "--device", "cpu"],
        env=env,
        capture_output=True,
        text=True,
    )
    wall = time.perf_counter() - started
    if done.returncode != 0:
        raise SystemExit(f"{policy} sweep failed ({done.returncode}): {done.stderr.strip().splitlines()[-1:]}")
    study = optuna.load_study(study_name=f"policies-{policy}-synthetic", storage=f"sqlite:///{run_dir / 'optuna.db'}")
    complete = [t for t in study.trials if t.state == optuna.trial.TrialState.COMPLETE]
    best = max(complete, key=lambda t: t.value)
    record = json.loads((run_dir / "packs" / "packs.json").read_text())
    return {
        "policy": policy,
        "wall_s": wall,
        "trials": len(study.trials),
        "complete": len(complete),
        "pack_record": record["summary"],
        "best": {"params": best.params, "value": best.value},
        "values": {json.dumps(t.params, sort_keys=True): t.value for t in complete},
        "final_losses": {json.dumps(t.params, sort_keys=True): t.user_attrs["final_train_loss"] for t in complete},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pack-size", type=int, default=8)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "policies-cpu.json")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        rows = [run(policy, args, Path(tmp)) for policy in ("planner", "fifo")]
    planner, fifo = rows
    same_values = sum(planner["values"][k] == fifo["values"].get(k) for k in planner["values"])
    summary = {
        "planner_over_fifo_wall": planner["wall_s"] / fifo["wall_s"],
        "same_best_config": planner["best"]["params"] == fifo["best"]["params"],
        "configs_with_equal_value": same_values,
        "configs": len(planner["values"]),
    }
    result = {
        "benchmark": "admission policies, real CPU sweep",
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "python": platform.python_version()},
        "versions": {p: metadata.version(p) for p in ("torch", "optuna", "transformers", "lm_eval", "mlflow")},
        "command": shlex.join([Path(sys.executable).name, *sys.argv]),
        "settings": {"pack_size": args.pack_size, "space": SPACE, "budget": "1 epoch of 24 examples"},
        "summary": summary,
        "runs": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"{'policy':8} {'wall s':>7} {'packs':>5} {'segments':>8} {'max plan s':>10}  best (value)")
    for r in rows:
        b, rec, p = r["best"], r["pack_record"], r["best"]["params"]
        print(
            f"{r['policy']:8} {r['wall_s']:7.0f} {rec['packs']:5d} {rec['segments']:8d} "
            f"{rec['plan_seconds_max']:10.3f}  r{p['rank']} lr{p['learning_rate']:.0e} b{p['batch_size']} "
            f"({b['value']:.4f})"
        )
    print(
        f"planner ÷ fifo wall {summary['planner_over_fifo_wall']:.2f}; "
        f"same best config: {summary['same_best_config']}; equal values {same_values}/{summary['configs']}"
    )


if __name__ == "__main__":
    main()
