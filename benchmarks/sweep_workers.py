"""Threads against worker processes: the same trials through the real ``plora-hpo sweep`` on this
machine's GPUs, in one call.

Modes, each a fresh run directory with the same sweep file (paper120's space, the built-in
synthetic task, random weights at a real shape with the embedded model's tokenizer):

* ``threads@1``: one GPU, the training loop in the sweep process (``--workers threads``);
* ``processes@1``: one GPU, one worker process (``--workers processes``);
* ``processes@N`` (N > 1 visible GPUs): one worker process per GPU, sharing the sweep's storage.

An untimed warm-up run comes first (``--no-warmup`` to skip): Triton's compiled kernels and
Python's bytecode are cached on disk, and whichever mode ran first would pay for compiling them.
It reports each mode's wall time, the per-trial final losses and scores next to ``threads@1``'s
(same configs, keyed by params), the scaling of ``processes@N`` over ``processes@1``, and the
planner's predicted makespan for 1 and N devices (``plora-hpo plan``, after the warm-up) against
the span of the packs each run trained. The JSON
goes under ``$OUT``; a short table is printed last.

Device (wheels from ``benchmarks/gpu_wheels.py`` in ``.whl``)::

    python3 benchmarks/sweep_workers.py --tokenizer .whl/tokenizer

CPU smoke run (a tiny random model, a few steps, two CPU "devices" for the N-worker mode)::

    python benchmarks/sweep_workers.py --smoke --tokenizer .whl/tokenizer
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _bootstrap  # noqa: F401  (plora_hpo importable from a bare checkout)
from sweep_e2e import (
    CLI_SHIM,
    device_info,
    gpu_tag,
    make_model_dir,
    planner_prediction,
    read_trials,
    summarize_timeline,
    versions,
    write_sweep_file,
)

ROOT = Path(__file__).resolve().parents[1]


def devices(args) -> list[str]:
    import torch

    if args.smoke or not torch.cuda.is_available():
        return ["cpu", "cpu"]
    return [f"cuda:{i}" for i in range(torch.cuda.device_count())]


def run_mode(args, sweep_file: Path, work: Path, name: str, device: list[str], workers: str) -> dict:
    run_dir = work / name
    argv = ["sweep", str(sweep_file), "--run-dir", str(run_dir), "--device", ",".join(device), "--workers", workers]
    cmd = [sys.executable, "-c", CLI_SHIM.format(bench=str(ROOT / "benchmarks")), *argv]
    stem = name.replace("@", "-").replace("#", "-run")  # file names of plain characters: any tool copies them
    log_path = args.out / f"{stem}.log"
    timeline = args.out / f"{stem}.timeline.jsonl"
    timeline.unlink(missing_ok=True)
    env = {**os.environ, "PLORA_HPO_TIMELINE": str(timeline)}
    print(f"[{name}] plora-hpo {' '.join(shlex.quote(a) for a in argv)}", flush=True)
    start = time.time()
    with open(log_path, "w") as log:
        proc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, timeout=args.timeout_s)
    end = time.time()
    wall = end - start
    print(f"[{name}] rc={proc.returncode} wall {wall:.1f}s", flush=True)
    result = {"command": "plora-hpo " + " ".join(argv), "returncode": proc.returncode, "wall_s": wall}
    if proc.returncode != 0:
        result["log_tail"] = log_path.read_text()[-3000:]
        return result
    result["trials"] = read_trials(run_dir, sweep_file, start)
    record = run_dir / "packs" / "packs.json"
    if record.is_file():  # first pack start to last pack end, on every device: what the planner predicts
        result["packs_makespan_s"] = json.loads(record.read_text())["summary"]["makespan_seconds"]
    if timeline.exists():
        events = [json.loads(line) for line in timeline.read_text().splitlines()]
        result["timeline"] = {k: v for k, v in summarize_timeline(events, start, end).items() if k != "note"}
    return result


def fmt(phases: dict[str, float]) -> str:
    return ", ".join(f"{k} {v:.1f}" for k, v in phases.items())


def compare(reference: dict, other: dict) -> dict:
    """Per-trial agreement with the reference mode, trials matched by their params."""
    key = lambda t: json.dumps(t["params"], sort_keys=True)  # noqa: E731
    ref = {key(t): t for t in reference.get("trials", []) if t["state"] == "COMPLETE"}
    rows = [(ref[key(t)], t) for t in other.get("trials", []) if t["state"] == "COMPLETE" and key(t) in ref]
    if not rows:
        return {"matched": 0}
    rel = [abs(a["final_train_loss"] - b["final_train_loss"]) / abs(a["final_train_loss"]) for a, b in rows]
    return {
        "matched": len(rows),
        "final_loss_max_rel_diff": max(rel),
        "final_loss_median_rel_diff": sorted(rel)[len(rel) // 2],
        "same_value": sum(a["value"] == b["value"] for a, b in rows),
        "value_max_abs_diff": max(abs(a["value"] - b["value"]) for a, b in rows),
    }


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--smoke", action="store_true", help="tiny random model, few steps and configs (CPU)")
    p.add_argument("--tokenizer", type=Path, default=ROOT / ".whl" / "tokenizer")
    p.add_argument("--shape", default="qwen2.5-1.5b")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--configs", type=int, default=16)
    p.add_argument("--pack-size", type=int, default=16)
    p.add_argument("--eval-limit", type=int, default=32)
    p.add_argument("--timeout-s", type=float, default=240.0, help="per mode")
    p.add_argument(
        "--warmup",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="first run the sweep once untimed (threads), so no timed mode pays for cold compile caches",
    )
    p.add_argument(
        "--repeats", type=int, default=1, help="runs per mode, the modes taking turns (the JSON keeps every run)"
    )
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    if args.smoke:
        args.steps, args.configs, args.pack_size, args.eval_limit = 4, 4, 2, 8
    args.out = args.out or Path(os.environ.get("OUT") or ".")
    args.out.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
    gpus = devices(args)
    work = Path(tempfile.mkdtemp(prefix="plora-workers-"))
    device = "cuda" if gpus[0].startswith("cuda") else "cpu"
    model = make_model_dir(args.shape, args.tokenizer, work / "model", device, args.smoke)
    sweep_file = write_sweep_file(
        work / "sweep.yaml", work / "model", "synthetic", args.steps, args.configs, args.pack_size,
        {"limit": args.eval_limit, "batch_size": 64},
    )  # fmt: skip
    warmup = None
    if args.warmup:  # compiled Triton kernels and Python bytecode are cached on disk: the first run pays
        warmup = run_mode(args, sweep_file, work, "warmup", gpus[:1], "threads")
        warmup = {k: v for k, v in warmup.items() if k != "trials"}
    modes = {"threads@1": (gpus[:1], "threads"), "processes@1": (gpus[:1], "processes")}
    if len(gpus) > 1:
        modes[f"processes@{len(gpus)}"] = (gpus, "processes")
    info = device_info()
    plans = {
        n: planner_prediction(sweep_file, n, info, shape=args.shape, smoke=args.smoke)
        for n in sorted({len(dev) for dev, _ in modes.values()})
    }
    repeats: dict[str, list[dict]] = {name: [] for name in modes}
    for i in range(args.repeats):  # taking turns: a drift in the machine's state hits every mode alike
        for name, (dev, how) in modes.items():
            repeats[name].append(run_mode(args, sweep_file, work, name if i == 0 else f"{name}#{i}", dev, how))
    runs = {name: done[0] for name, done in repeats.items()}  # the first of each mode: trials compared
    result = {
        "benchmark": "sweep_workers",
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "command": shlex.join([sys.executable, *(["benchmarks/sweep_workers.py", *argv] if argv else sys.argv)]),
        **info,
        "gpus_visible": len(gpus) if device == "cuda" else 0,
        "versions": versions(),
        "model": model,
        "workload": f"synthetic, {args.configs} paper120 configs x {args.steps} steps, pack {args.pack_size}",
        "warmup": warmup,
        "runs": runs,
        "repeats": {name: done[1:] for name, done in repeats.items()} if args.repeats > 1 else None,
        "wall_s": {name: [r["wall_s"] for r in done] for name, done in repeats.items()},
        "agreement_with_threads@1": {name: compare(runs["threads@1"], run) for name, run in runs.items()},
        "planner": {
            "note": "predicted: plora-hpo plan's makespan for the sweep file on that many devices (training packs "
            "only); ran: each run's pack record, first pack start to last pack end over all devices (its trials' "
            "scoring inside the packs included, start-up and closing not)",
            "predicted": {str(n): plan for n, plan in plans.items()},
            "ran": {name: [r.get("packs_makespan_s") for r in done] for name, done in repeats.items()},
        },
    }
    one, many = runs["processes@1"], runs.get(f"processes@{len(gpus)}")
    if len(gpus) > 1 and many and one.get("returncode") == 0 and many.get("returncode") == 0:
        result["scaling"] = one["wall_s"] / many["wall_s"]
    suffix = "smoke" if args.smoke else f"{gpu_tag(info)}x{len(gpus)}"
    path = args.out / f"sweep-workers-{suffix}.json"
    path.write_text(json.dumps(result, indent=1, default=str) + "\n")

    print(f"\n=== sweep_workers: {result['workload']}, {result.get('gpu') or 'cpu'} x{len(gpus)} ===")
    print(f"{'mode':14s} {'rc':>3s} {'wall s':>16s} {'trials':>7s} {'loss max rel diff':>18s} {'same value':>11s}")
    for name, run in runs.items():
        agree = result["agreement_with_threads@1"][name]
        done = sum(t["state"] == "COMPLETE" for t in run.get("trials", []))
        diff = agree.get("final_loss_max_rel_diff")
        diff_text = "-" if diff is None else f"{diff:.2e}"
        same = f"{agree.get('same_value', 0)}/{agree['matched']}"
        walls = " ".join(f"{w:.1f}" for w in result["wall_s"][name])
        print(f"{name:14s} {run['returncode']:3d} {walls:>16s} {done:7d} {diff_text:>18s} {same:>11s}")
    for name, done in repeats.items():
        for run in done:
            tl = run.get("timeline") or {}
            if "seconds" in tl:
                sec = tl["seconds"]
                exits = " and ".join(f"{x['before_end_s']:.2f}" for x in tl.get("exits", [])) or "-"
                print(f"  {name}: startup {sec.get('startup', 0):.1f} s ({fmt(tl['startup_phases'])}), "
                      f"shutdown {sec.get('shutdown', 0):.1f} s ({fmt(tl['shutdown_phases'])}; "
                      f"processes exit {exits} s before the end), train {sec.get('train', 0):.1f} s")  # fmt: skip
    for name, (dev, _) in modes.items():
        plan, ran = plans[len(dev)], result["planner"]["ran"][name]
        predicted = f"{plan['makespan_s']:.1f} s" if "makespan_s" in plan else f"none ({plan['error']})"
        spans = " ".join("-" if x is None else f"{x:.1f}" for x in ran)
        print(f"planner, {name}: predicted makespan {predicted}; packs ran {spans} s")
    if "scaling" in result:
        print(f"scaling processes@{len(gpus)} over processes@1: {result['scaling']:.2f}x")
    print(f"json: {path}")


if __name__ == "__main__":
    main()
