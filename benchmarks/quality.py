"""Does the search pay? The best config against the common default on real CoLA / MRPC, with seeds.

Runs the real CLI (``plora-hpo sweep``) on the embedded SmolLM2-135M with real GLUE data from a
data folder, on this machine's CPU (a long run, not CI):

1. **search**: a grid over a subset of paper120 that contains the default (r 16, alpha 16,
   lr 2e-4, batch 2) — rank 16 × alpha multiplier {1, 4} × lr {2e-4, 4e-4} × batch {2, 8} —
   trained ``--steps`` steps, each scored on the task's whole dev set;
2. **seeds**: the default and the search's best config again with seeds 1 … n-1 (the sweep's
   ``seed`` sets the adapter init and data order), so each has ``--seeds`` scores; the spread is
   their sample standard deviation;
3. **check**: the best adapter's exported files scored by lm-eval's own ``HFLM`` + PEFT on the
   same documents, against the sweep's score.

Reported per config: the metric, its standard error, the share of each predicted answer (a
classifier that answers one class everywhere shows up), and the training loss at each tenth of
the budget (the learning curve the budget is judged by: a budget is long enough when the
default's loss has stopped falling in the last tenths). Per task: best − default, the seed
spreads, and whether the gain exceeds twice the larger spread.

Usage::

    python benchmarks/quality.py --data-dir ../shared/data --task cola [--task mrpc] [--steps 200]
    python benchmarks/quality.py --smoke --data-dir ../shared/data   # minutes: every code path

The JSON (machine, date, versions, command) goes to ``--out``; a short table prints last.
"""

from __future__ import annotations

import argparse
import datetime as dt
import itertools
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from importlib import metadata
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
DEFAULT = {"rank": 16, "alpha_multiplier": 1.0, "learning_rate": 2e-4, "batch_size": 2}
SPACE = {
    "rank": {"choices": [16]},
    "alpha_multiplier": {"choices": [1, 4]},
    "learning_rate": {"choices": [2.0e-4, 4.0e-4]},
    "batch_size": {"choices": [2, 8]},
}


def sweep_file(path: Path, task: str, args: argparse.Namespace, seed: int, space: dict) -> Path:
    config = {
        "name": f"quality-{task}-s{seed}",
        "model": "smollm2-135m",
        "tasks": [task],
        "seq_len": args.seq_len,
        "seed": seed,
        "budget": {"steps": args.steps},
        "space": space,
        "sampler": "grid",
        "pack": {"size": 8},
        "evaluation": {"batch_size": 32, **({"limit": args.eval_limit} if args.eval_limit else {})},
    }
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def run_sweep(file: Path, run_dir: Path, args: argparse.Namespace, log: Path) -> float:
    """``plora-hpo sweep`` as a user runs it; its wall seconds."""
    started = time.perf_counter()
    command = [sys.executable, "-m", "plora_hpo.cli", "sweep", str(file), "--run-dir", str(run_dir)]
    command += ["--data-dir", str(args.data_dir), "--device", "cpu"]
    print("[sweep]", shlex.join(command[2:]), flush=True)
    with log.open("w") as out:
        subprocess.run(command, stdout=out, stderr=subprocess.STDOUT, check=True)
    return time.perf_counter() - started


def trials_of(run_dir: Path, study_name: str) -> list[dict]:
    """Each complete trial's params, value, metrics, answer shares, stderr and loss curve."""
    import optuna
    from mlflow.tracking import MlflowClient

    from plora_hpo.evaluation.uncertainty import share_keys

    study = optuna.load_study(study_name=study_name, storage=f"sqlite:///{run_dir / 'optuna.db'}")
    client = MlflowClient(f"sqlite:///{run_dir / 'mlflow.db'}")
    rows = []
    for t in study.trials:
        if t.state != optuna.trial.TrialState.COMPLETE:
            continue
        metrics = t.user_attrs.get("metrics") or {}
        history = client.get_metric_history(t.user_attrs["mlflow_run_id"], "train_loss")
        losses = [m.value for m in sorted(history, key=lambda m: m.step)]
        rows.append(
            {
                "params": t.params,
                "value": t.value,
                "metrics": metrics,
                "answer_shares": share_keys(metrics),
                "final_train_loss": t.user_attrs.get("final_train_loss"),
                "loss_by_tenth": tenths(losses),
                "adapter_dir": t.user_attrs.get("adapter_dir"),
            }
        )
    return rows


def tenths(losses: list[float]) -> list[float]:
    """Mean training loss over each tenth of the steps (the learning curve, smoothed)."""
    if not losses:
        return []
    n = len(losses)
    cuts = [round(i * n / 10) for i in range(11)]
    return [statistics.fmean(losses[a:b]) for a, b in itertools.pairwise(cuts) if b > a]


def same(a: dict, b: dict) -> bool:
    return all(abs(float(a[k]) - float(b[k])) <= 1e-12 for k in DEFAULT)


def hflm_check(task: str, adapter_dir: str, args: argparse.Namespace, metric: str) -> dict:
    """lm-eval's ``HFLM`` + PEFT on the exported adapter, the sweep's documents."""
    from lm_eval.evaluator import evaluate
    from lm_eval.models.huggingface import HFLM

    from plora_hpo.evaluation.runner import FEWSHOT_SEED, lm_eval_tasks
    from plora_hpo.tasks import build_eval_tasks

    base = json.loads((Path(adapter_dir) / "adapter_config.json").read_text())["base_model_name_or_path"]
    lm = HFLM(pretrained=base, peft=adapter_dir, dtype="float32", device="cpu", batch_size=32)
    task_dict = build_eval_tasks(task, data_dir=args.data_dir)
    for t in lm_eval_tasks(task_dict):
        t.set_fewshot_seed(seed=FEWSHOT_SEED)
    started = time.perf_counter()
    out = evaluate(lm=lm, task_dict=task_dict, limit=args.eval_limit, bootstrap_iters=0)
    return {"hflm": out["results"][task][metric], "seconds": time.perf_counter() - started}


def quality(task: str, args: argparse.Namespace, work: Path, entry: dict, save: Callable[[], None]) -> None:
    """Fill ``entry`` stage by stage (search, each seed, the HFLM check), saving after each."""
    from plora_hpo.config import load_sweep
    from plora_hpo.study import study_name

    entry.update(task=task, metric=_primary(task), seconds={})
    file = sweep_file(work / f"{task}-s0.yaml", task, args, 0, SPACE)
    entry["seconds"]["search"] = run_sweep(file, work / f"{task}-search", args, work / f"{task}-search.log")
    search = trials_of(work / f"{task}-search", study_name(load_sweep(file), task))
    default = next(r for r in search if same(r["params"], DEFAULT))
    best = max(search, key=lambda r: r["value"])
    seeds = {"default": [default["value"]], "best": [best["value"]]}
    entry.update(configs=search, best_params=best["params"], seeds=seeds)
    save()
    for seed in range(1, args.seeds):
        pair = {k: {"choices": sorted({DEFAULT[k], best["params"][k]})} for k in DEFAULT}
        file = sweep_file(work / f"{task}-s{seed}.yaml", task, args, seed, pair)
        run_dir = work / f"{task}-seed{seed}"
        entry["seconds"][f"seed{seed}"] = run_sweep(file, run_dir, args, work / f"{task}-seed{seed}.log")
        rows = trials_of(run_dir, study_name(load_sweep(file), task))
        seeds["default"].append(next(r["value"] for r in rows if same(r["params"], DEFAULT)))
        seeds["best"].append(next(r["value"] for r in rows if same(r["params"], best["params"])))
        spread = {k: statistics.stdev(v) for k, v in seeds.items()}
        gain = statistics.fmean(seeds["best"]) - statistics.fmean(seeds["default"])
        entry.update(
            seed_spread=spread,
            gain_mean_best_minus_default=gain,
            gain_exceeds_twice_spread=gain > 2 * max(spread.values()),
        )
        save()
    check = hflm_check(task, best["adapter_dir"], args, entry["metric"])
    check["sweep"] = best["value"]
    check["same_documents"] = args.eval_limit is None  # a limit samples the sweep's documents at random
    entry["hflm_check"] = check
    save()


def _primary(task: str) -> str:
    from plora_hpo.tasks import get_task

    return get_task(task).primary_metric


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data-dir", type=Path, default=ROOT.parent / "shared" / "data")
    p.add_argument("--task", action="append", choices=["cola", "mrpc"], help="repeatable (default: cola)")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--eval-limit", type=int, default=None, help="dev documents (default: all)")
    p.add_argument("--smoke", action="store_true", help="4 steps, 2 seeds, 16 documents: every code path")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    args.task = args.task or ["cola"]
    if args.smoke:
        args.steps, args.seeds, args.eval_limit = 4, 2, 16
    out = args.out or ROOT / "benchmarks" / "results" / f"quality-{'smoke-' if args.smoke else ''}cpu.json"
    began = time.perf_counter()
    result = {
        "benchmark": "quality",
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "python": platform.python_version()},
        "versions": {k: metadata.version(k) for k in ("torch", "transformers", "peft", "optuna", "lm_eval", "mlflow")},
        "command": shlex.join(["python", "benchmarks/quality.py", *(argv if argv is not None else sys.argv[1:])]),
        "settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "default": DEFAULT,
        "space": SPACE,
        "tasks": [],
    }

    def save() -> None:  # after every stage: a run cut short keeps what it measured
        result["elapsed_s"] = time.perf_counter() - began
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=1) + "\n")

    with tempfile.TemporaryDirectory(prefix="plora-quality-") as tmp:
        for task in args.task:
            result["tasks"].append({})
            quality(task, args, Path(tmp), result["tasks"][-1], save)
    print(f"\n=== quality: SmolLM2-135M, {args.steps} steps, seeds {args.seeds}, CPU ===")
    print(f"{'task':6} {'metric':10} {'default':>16} {'best':>16} {'gain':>7} {'> 2x spread':>11}  HFLM check")
    for t in result["tasks"]:
        d, b = t["seeds"]["default"], t["seeds"]["best"]
        fmt = lambda v: f"{statistics.fmean(v):.3f}±{statistics.stdev(v) if len(v) > 1 else 0:.3f}"  # noqa: E731
        c = t["hflm_check"]
        print(
            f"{t['task']:6} {t['metric']:10} {fmt(d):>16} {fmt(b):>16} {t['gain_mean_best_minus_default']:7.3f} "
            f"{t['gain_exceeds_twice_spread']!s:>11}  sweep {c['sweep']:.4f} HFLM {c['hflm']:.4f}"
        )
    print(f"json: {out}")


if __name__ == "__main__":
    main()
