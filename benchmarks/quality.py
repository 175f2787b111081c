"""Does the search pay? The best config against the common default on real CoLA / MRPC, with seeds.

Runs the real CLI (``plora-hpo sweep``) on the embedded SmolLM2-135M with real GLUE data from a
data folder, on the CPU (a long run, not CI) or a GPU (``--device cuda``):

1. **search** (or, with ``--search-from``, the search of an earlier results file made with the
   same settings, so a device call too short for every stage continues in the next): a grid that
   contains the default (r 16, alpha 16, lr 2e-4, batch 2), trained ``--steps`` steps, each config
   scored on the task's whole dev set. ``--space subset`` is rank 16 × alpha multiplier {1, 4} ×
   lr {2e-4, 4e-4} × batch {2, 8} (8 configs, for the CPU); ``--space paper120`` is
   ``search_spaces/paper120.yaml``'s whole 120-config grid;
2. **seeds**: the default and the search's best config (the top one under seed 0) again under
   seeds 1 … n-1 (the sweep's ``seed`` sets the adapter inits and data order), ``--jobs``
   sweeps at once, so each has ``--seeds`` scores: per seed one sweep of the two configs' 2^4
   grid (one pack, about the cost of two adapters on a GPU), or with ``--seed-sweeps each`` one
   sweep of each config alone (on a CPU, where every adapter costs in full). The best config's seed-0
   score is the maximum of the grid, biased upwards, so the gain over the default is also given
   over the fresh seeds alone, against their sample standard deviations;
3. **check**: the best config's newest exported adapter (of the last seed run, else of the
   search) scored by lm-eval's own ``HFLM`` + PEFT on the same documents (same device and dtype
   as the sweep), against the sweep's score. On a GPU the sweep runs in bf16, whose rounding
   differs between any two kernels (``--dtype bfloat16`` gives the same on a CPU), so there the
   same adapter is also scored by ``HFLM`` in fp32
   (how many documents change answer with the dtype alone), and the best config is trained once
   more in fp32 beside the seed sweeps: its sweep score must equal ``HFLM``'s fp32 score.

Reported per config: the metric, its standard error, the share of each predicted answer (a
classifier that answers one class everywhere shows up), and the training loss at each tenth of
the budget (the learning curve the budget is judged by: a budget is long enough when the
default's loss has stopped falling in the last tenths). Per task: best − default, the seed
spreads, and whether the gain exceeds twice the larger spread.

Usage::

    python benchmarks/quality.py --data-dir ../shared/data --task cola [--task mrpc] [--steps 200]
    python benchmarks/quality.py --smoke --data-dir ../shared/data   # minutes: every code path
    python3 benchmarks/quality.py --device cuda --space paper120 --steps 1000 --pack-size 120 \
        --eval-batch-size 2048 --jobs 3 --seeds 4 --data-dir .device_data --out $OUT/quality-h200.json   # a GPU
    python3 benchmarks/quality.py ... --search-from benchmarks/results/quality-h200.json   # the later stages
    python benchmarks/quality.py --search-from benchmarks/results/quality-h200.json --space paper120 \
        --steps 1000 --seeds 2 --seed-sweeps each   # the GPU's best config and the default, on this CPU

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
from pathlib import Path

import yaml
from sweep_e2e import versions

ROOT = Path(__file__).resolve().parents[1]
os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
DEFAULT = {"rank": 16, "alpha_multiplier": 1.0, "learning_rate": 2e-4, "batch_size": 2}
SUBSET = {
    "rank": {"choices": [16]},
    "alpha_multiplier": {"choices": [1, 4]},
    "learning_rate": {"choices": [2.0e-4, 4.0e-4]},
    "batch_size": {"choices": [2, 8]},
}


def paper120_space() -> dict:
    """The 120-config grid of the shipped ``paper120`` sweep file."""
    return yaml.safe_load((ROOT / "search_spaces" / "paper120.yaml").read_text())["space"]


def sweep_file(
    path: Path, task: str, args: argparse.Namespace, seed: int, space: dict, dtype: str | None = None
) -> Path:
    """Write the sweep file of one stage: the embedded model on ``task``, a grid over ``space``,
    in ``dtype`` (default: ``--dtype``)."""
    dtype = dtype or args.dtype
    config = {
        "name": f"quality-{task}-s{seed}" + ("" if dtype == "auto" else f"-{dtype}"),
        "model": "smollm2-135m",
        "tasks": [task],
        "seq_len": args.seq_len,
        "seed": seed,
        "budget": {"steps": args.steps},
        "space": space,
        "sampler": "grid",
        "pack": {"size": args.pack_size},
        "evaluation": {"batch_size": args.eval_batch_size, **({"limit": args.eval_limit} if args.eval_limit else {})},
        "dtype": dtype,
    }
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def run_sweeps(files: list[Path], run_dirs: list[Path], args: argparse.Namespace) -> list[float]:
    """``plora-hpo sweep`` as a user runs it, once per file, ``--jobs`` at a time; wall seconds each.

    Concurrent sweeps share the device like independent users' jobs; a sweep that fails stops the
    benchmark with the end of its log.
    """
    seconds: list[float] = [0.0] * len(files)
    pending = list(range(len(files)))
    running: dict[int, tuple[subprocess.Popen, float]] = {}
    while pending or running:
        while pending and len(running) < args.jobs:
            i = pending.pop(0)
            command = [sys.executable, "-m", "plora_hpo.cli", "sweep", str(files[i]), "--run-dir", str(run_dirs[i])]
            command += ["--data-dir", str(args.data_dir), "--device", args.device]
            print("[sweep]", shlex.join(command[2:]), flush=True)
            with run_dirs[i].with_suffix(".log").open("w") as log:  # the child keeps its own handle
                running[i] = (subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT), time.perf_counter())
        time.sleep(1.0)
        for i, (process, started) in list(running.items()):
            if process.poll() is None:
                continue
            del running[i]
            seconds[i] = time.perf_counter() - started
            if process.returncode:
                tail = run_dirs[i].with_suffix(".log").read_text().splitlines()[-20:]
                raise SystemExit(f"sweep {files[i].name} failed (exit {process.returncode}):\n" + "\n".join(tail))
    return seconds


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
                "loss_curve": curve(losses),
                "pack": t.user_attrs.get("pack_id"),
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


def curve(losses: list[float], points: int = 50) -> list[list[float]]:
    """``[last step, mean loss]`` of ``points`` equal chunks of the steps (a plot's worth)."""
    n = len(losses)
    cuts = sorted({round(i * n / points) for i in range(points + 1)})
    return [[b, statistics.fmean(losses[a:b])] for a, b in itertools.pairwise(cuts) if b > a]


def same(a: dict, b: dict) -> bool:
    return all(abs(float(a[k]) - float(b[k])) <= 1e-12 for k in DEFAULT)


def sweep_dtype(args: argparse.Namespace) -> str:
    """The dtype the sweeps compute in: ``--dtype``, where "auto" is fp32 on a CPU and bf16 on a GPU."""
    if args.dtype != "auto":
        return args.dtype
    return "float32" if args.device == "cpu" else "bfloat16"


def hflm_score(
    task: str, adapter_dir: str, args: argparse.Namespace, metric: str, dtype: str, seed: int
) -> tuple[float, list[int]]:
    """lm-eval's ``HFLM`` + PEFT on the exported adapter, on the documents its sweep (of ``seed``)
    scored (all, or its seeded sample of ``--eval-limit``): the metric and each document's chosen
    answer (by doc id)."""
    import torch
    from lm_eval.evaluator import evaluate
    from lm_eval.models.huggingface import HFLM

    from plora_hpo.evaluation.runner import FEWSHOT_SEED, lm_eval_tasks
    from plora_hpo.evaluation.sampling import document_sample
    from plora_hpo.tasks import build_eval_tasks

    base = json.loads((Path(adapter_dir) / "adapter_config.json").read_text())["base_model_name_or_path"]
    lm = HFLM(pretrained=base, peft=adapter_dir, dtype=dtype, device=args.device, batch_size=32)
    task_dict = build_eval_tasks(task, data_dir=args.data_dir)
    samples = {}
    for t in lm_eval_tasks(task_dict):
        t.set_fewshot_seed(seed=FEWSHOT_SEED)
        picked = document_sample(t, args.eval_limit, seed=seed) if args.eval_limit else None
        if picked is not None:
            samples[t.config.task] = picked
    out = evaluate(lm=lm, task_dict=task_dict, samples=samples or None, bootstrap_iters=0, log_samples=True)
    docs = sorted(out["samples"][task], key=lambda d: d["doc_id"])
    choices = [max(range(len(d["filtered_resps"])), key=lambda i: d["filtered_resps"][i][0]) for d in docs]
    del lm
    if args.device != "cpu":
        torch.cuda.empty_cache()
    return out["results"][task][metric], choices


def hflm_check(task: str, adapter_dir: str, args: argparse.Namespace, metric: str, seed: int) -> dict:
    """The sweep's adapter scored by ``HFLM`` + PEFT in the sweep's dtype and, when that is not
    fp32, in fp32 too: how many documents change answer with the dtype's rounding alone."""
    started = time.perf_counter()
    dtype = sweep_dtype(args)
    value, choices = hflm_score(task, adapter_dir, args, metric, dtype, seed)
    check = {"hflm": value, "dtype": dtype}
    if dtype != "float32":
        exact, exact_choices = hflm_score(task, adapter_dir, args, metric, "float32", seed)
        flipped = sum(a != b for a, b in zip(choices, exact_choices, strict=True))
        check.update(hflm_float32=exact, docs_flipped_by_dtype=flipped, docs=len(choices))
    check["seconds"] = time.perf_counter() - started
    return check


def quality(task: str, args: argparse.Namespace, work: Path, entry: dict, save: Callable[[], None]) -> None:
    """Fill ``entry`` stage by stage: the search (or an earlier run's), then within ``--budget-s``
    the seeds and the HFLM check of the best config's newest exported adapter."""
    from plora_hpo.config import load_sweep
    from plora_hpo.study import study_name

    entry.update(task=task, metric=_primary(task), skipped=[], seconds={})
    if args.search_from:
        configs = earlier_search(args, task)
        entry["search_from"] = {"file": str(args.search_from), **earlier_run(args.search_from)}
    else:
        space = paper120_space() if args.space == "paper120" else SUBSET
        file = sweep_file(work / f"{task}-s0.yaml", task, args, 0, space)
        entry["seconds"]["search"] = run_sweeps([file], [work / f"{task}-search"], args)[0]
        configs = trials_of(work / f"{task}-search", study_name(load_sweep(file), task))
    default = next(r for r in configs if same(r["params"], DEFAULT))
    best = max(configs, key=lambda r: r["value"])  # what one search picks
    seeds = {"default": [default["value"]], "best": [best["value"]]}
    entry.update(configs=configs, best_params=best["params"], seeds=seeds)
    save()
    checked = best if Path(best.get("adapter_dir") or "").is_dir() else None  # an earlier run's is gone
    checked_seed = 0  # the seed of the sweep that trained it
    fresh = list(range(1, args.seeds))
    twin = None  # the best config once more in fp32, where its score must equal HFLM's exactly
    if fresh and within_budget(args, "seeds", entry):
        pair = {k: {"choices": sorted({DEFAULT[k], best["params"][k]})} for k in DEFAULT}
        spaces = [pair] if args.seed_sweeps == "grid" else [alone(DEFAULT), alone(best["params"])]
        files, run_dirs = [], []
        for seed in fresh:
            for j, space in enumerate(spaces):
                part = "" if len(spaces) == 1 else f"-{j}"
                files.append(sweep_file(work / f"{task}-s{seed}{part}.yaml", task, args, seed, space))
                run_dirs.append(work / f"{task}-seed{seed}{part}")
        twin_index = len(files)  # the fp32 twin, if any, comes after the seed sweeps
        if sweep_dtype(args) != "float32":
            files.append(sweep_file(work / f"{task}-fp32.yaml", task, args, fresh[0], alone(best["params"]), "float32"))
            run_dirs.append(work / f"{task}-fp32")
        walls = run_sweeps(files, run_dirs, args)
        for i, seed in enumerate(fresh):
            mine = slice(i * len(spaces), (i + 1) * len(spaces))  # this seed's sweeps
            entry["seconds"][f"seed{seed}"] = sum(walls[mine])
            rows = [
                row
                for f, d in zip(files[mine], run_dirs[mine], strict=True)
                for row in trials_of(d, study_name(load_sweep(f), task))
            ]
            seeds["default"].append(next(r["value"] for r in rows if same(r["params"], DEFAULT)))
            checked, checked_seed = next(r for r in rows if same(r["params"], best["params"])), seed
            seeds["best"].append(checked["value"])
        if sweep_dtype(args) != "float32":
            entry["seconds"]["fp32"] = walls[-1]
            twin = trials_of(run_dirs[twin_index], study_name(load_sweep(files[twin_index]), task))[0]
        entry.update(gains(seeds))
        save()
    if checked is not None and within_budget(args, "hflm_check", entry):
        check = hflm_check(task, checked["adapter_dir"], args, entry["metric"], checked_seed)
        check["sweep"] = checked["value"]
        entry["hflm_check"] = check
        save()
    if twin is not None and within_budget(args, "fp32_check", entry):
        value, _ = hflm_score(task, twin["adapter_dir"], args, entry["metric"], "float32", fresh[0])
        entry["fp32_check"] = {"params": twin["params"], "seed": fresh[0], "sweep": twin["value"], "hflm": value}
        save()


def alone(params: dict) -> dict:
    """A grid of the one config ``params``."""
    return {k: {"choices": [v]} for k, v in params.items()}


def earlier_run(path: Path) -> dict:
    """Where an earlier results file came from (its date, machine and command)."""
    data = json.loads(path.read_text())
    return {k: data[k] for k in ("date", "machine", "command")}


def earlier_search(args: argparse.Namespace, task: str) -> list[dict]:
    """The search rows of ``task`` in an earlier results file made with the same settings."""
    data = json.loads(args.search_from.read_text())
    for key in ("steps", "seq_len", "space", "eval_limit"):
        if data["settings"].get(key) != getattr(args, key):
            raise SystemExit(
                f"--search-from {args.search_from}: its {key} is {data['settings'].get(key)!r}, this run's "
                f"{getattr(args, key)!r}; give the same settings"
            )
    entry = next((t for t in data["tasks"] if t.get("task") == task and t.get("configs")), None)
    if entry is None:
        raise SystemExit(f"--search-from {args.search_from}: no finished search of {task}; run the search")
    return entry["configs"]


def gains(seeds: dict[str, list[float]]) -> dict:
    """Best − default over all seeds and over the fresh seeds (1 …), against the seed spreads."""
    spread = {k: statistics.stdev(v) for k, v in seeds.items()}
    gain = statistics.fmean(seeds["best"]) - statistics.fmean(seeds["default"])
    out = {
        "seed_spread": spread,
        "gain_mean_best_minus_default": gain,
        "gain_exceeds_twice_spread": gain > 2 * max(spread.values()),
    }
    fresh = {k: v[1:] for k, v in seeds.items()}
    if len(fresh["best"]) >= 2:
        fresh_spread = max(statistics.stdev(v) for v in fresh.values())
        fresh_gain = statistics.fmean(fresh["best"]) - statistics.fmean(fresh["default"])
        out.update(gain_fresh_seeds=fresh_gain, gain_fresh_exceeds_twice_spread=fresh_gain > 2 * fresh_spread)
    return out


def within_budget(args: argparse.Namespace, stage: str, entry: dict) -> bool:
    """Whether ``stage`` may start; if not, it is recorded under the task's ``skipped``."""
    if time.perf_counter() - args.began < args.budget_s:
        return True
    entry["skipped"].append(stage)
    return False


def _primary(task: str) -> str:
    from plora_hpo.tasks import get_task

    return get_task(task).primary_metric


def machine(device: str) -> dict:
    """Where it ran: platform, CPUs, Python and, on a GPU, its name and memory."""
    out = {"platform": platform.platform(), "cpus": os.cpu_count(), "python": platform.python_version()}
    if device != "cpu":
        import torch

        props = torch.cuda.get_device_properties(0)
        out.update(gpu=props.name, gpu_memory_gib=round(props.total_memory / 2**30, 1))
    return out


def print_table(result: dict, args: argparse.Namespace) -> None:
    """The short summary: per task default and best (mean ± sd over seeds), gains, the HFLM check."""
    where = result["machine"].get("gpu", "CPU")
    print(f"\n=== quality: SmolLM2-135M, {args.space}, {args.steps} steps, seeds {args.seeds}, {where} ===")
    print(f"{'task':6} {'metric':10} {'default':>14} {'best':>14} {'gain':>7} {'fresh':>7} {'> 2x sd':>7}  HFLM check")

    def fmt(v: list[float]) -> str:
        return f"{statistics.fmean(v):.3f}±{statistics.stdev(v) if len(v) > 1 else 0:.3f}"

    def num(v: float | None) -> str:
        return "-" if v is None else f"{v:.3f}"

    for t in result["tasks"]:
        if "seeds" not in t:
            print(f"{t['task']:6} search did not finish")
            continue
        c = t.get("hflm_check")
        check = f"sweep {c['sweep']:.4f} HFLM {c['hflm']:.4f}" if c else "skipped"
        print(
            f"{t['task']:6} {t['metric']:10} {fmt(t['seeds']['default']):>14} {fmt(t['seeds']['best']):>14} "
            f"{num(t.get('gain_mean_best_minus_default')):>7} {num(t.get('gain_fresh_seeds')):>7} "
            f"{t.get('gain_fresh_exceeds_twice_spread', t.get('gain_exceeds_twice_spread', '-'))!s:>7}  {check}"
        )
        if "hflm_float32" in (c or {}):
            print(
                f"       same adapter, HFLM fp32 {c['hflm_float32']:.4f}: "
                f"{c['docs_flipped_by_dtype']}/{c['docs']} documents change answer with bf16 alone"
            )
        if "fp32_check" in t:
            f = t["fp32_check"]
            print(f"       best config trained and scored in fp32: sweep {f['sweep']:.4f} HFLM {f['hflm']:.4f}")
        if t["skipped"]:
            print(f"       skipped (time budget): {', '.join(t['skipped'])}")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data-dir", type=Path, default=ROOT.parent / "shared" / "data")
    p.add_argument("--task", action="append", choices=["cola", "mrpc"], help="repeatable (default: cola)")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--eval-limit", type=int, default=None, help="dev documents (default: all)")
    p.add_argument("--space", choices=["subset", "paper120"], default="subset", help="the search's grid")
    p.add_argument("--device", default="cpu", help="the sweep's --device (cpu, cuda)")
    p.add_argument("--pack-size", type=int, default=8, help="the sweep's pack.size")
    p.add_argument("--eval-batch-size", type=int, default=32, help="rows per forward, shared by a pack's adapters")
    p.add_argument(
        "--search-from",
        type=Path,
        default=None,
        help="take the search of this earlier results file (same settings) and run only the later stages",
    )
    p.add_argument(
        "--seed-sweeps",
        choices=["grid", "each"],
        default="grid",
        help="per fresh seed, one sweep of the default's and the best's 2^4 grid (one pack: on a GPU about "
        "the cost of two adapters), or one sweep of each config alone (on a CPU every adapter costs in full)",
    )
    p.add_argument("--jobs", type=int, default=1, help="seed sweeps running at once (a GPU has room for several)")
    p.add_argument("--budget-s", type=float, default=float("inf"), help="start no stage after the search past this")
    p.add_argument(
        "--dtype",
        choices=["auto", "bfloat16", "float32"],
        default="auto",
        help="the sweeps' dtype (auto: fp32 on a CPU, bf16 on a GPU)",
    )
    p.add_argument("--smoke", action="store_true", help="4 steps, 3 seeds, 16 documents: every code path")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    args.task = args.task or ["cola"]
    args.began = time.perf_counter()
    if args.smoke:
        args.steps, args.seeds, args.eval_limit = 4, 3, 16
    out = args.out or ROOT / "benchmarks" / "results" / f"quality-{'smoke-' if args.smoke else ''}cpu.json"
    result = {
        "benchmark": "quality",
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine(args.device),
        "versions": versions(),
        "command": shlex.join(["python", "benchmarks/quality.py", *(argv if argv is not None else sys.argv[1:])]),
        "settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items() if k != "began"},
        "default": DEFAULT,
        "space": paper120_space() if args.space == "paper120" else SUBSET,
        "tasks": [],
    }

    def save() -> None:  # after every stage: a run cut short keeps what it measured
        result["elapsed_s"] = time.perf_counter() - args.began
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=1) + "\n")

    with tempfile.TemporaryDirectory(prefix="plora-quality-") as tmp:
        for task in args.task:
            result["tasks"].append({})
            quality(task, args, Path(tmp), result["tasks"][-1], save)
    print_table(result, args)
    print(f"json: {out}")


if __name__ == "__main__":
    main()
