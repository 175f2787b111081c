"""The multi-GPU run in one call: scaling over worker processes and a pack split over the GPUs.

Runs, each in a process of its own with its share of ``--budget-s``:

* ``benchmarks/sweep_workers.py``: the same trials through the real sweep in threads and in one
  worker process on one GPU, and in a worker process per GPU on every GPU (wall times, per-trial
  agreement, the scaling of every GPU over one, and the planner's forecast of each against the
  pack span that ran);
* ``benchmarks/degree_pack.py``: one pack split over ``--degree`` GPUs by tensor parallelism
  against the same pack on one GPU (per-step losses, step time, memory per GPU, and the cost
  model's predictions for both).

and writes ``multi-gpu-<gpu>x<n>.json`` under ``$OUT`` (``multi-gpu-h200x2.json`` on two H200s):
both scripts' JSON, each whole, under ``sweep_workers`` and ``degree_pack``, and a ``summary`` of
the numbers the two-GPU run is judged by. Their own JSON files are written beside it. A part that
fails or runs out of its budget is recorded with its return code and its log's end; the other
still runs. A short table is printed last.

Device, two GPUs (wheels from ``benchmarks/gpu_wheels.py`` in ``.whl``)::

    PYTHONUNBUFFERED=1 python3 benchmarks/multi_gpu.py --tokenizer .whl/tokenizer

CPU smoke run (both scripts' smoke modes: a tiny random model, two CPU "devices" and gloo; under
two minutes on two cores)::

    python benchmarks/multi_gpu.py --smoke --tokenizer .whl/tokenizer
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _bootstrap  # noqa: F401  (plora_hpo importable from a bare checkout)
from sweep_e2e import device_info, gpu_tag, versions

ROOT = Path(__file__).resolve().parents[1]


def run_part(name: str, argv: list[str], timeout_s: float, out: Path) -> dict:
    """One benchmark script in a process of its own; its output goes to ``out/<name>.log``."""
    log_path = out / f"{name}.log"
    cmd = [sys.executable, str(ROOT / "benchmarks" / argv[0]), *argv[1:]]
    print(f"[{name}] {shlex.join(cmd)}", flush=True)
    started = time.monotonic()
    with open(log_path, "w") as log:
        try:
            proc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, timeout=timeout_s, cwd=ROOT)
            code: int | str = proc.returncode
        except subprocess.TimeoutExpired:
            code = "timeout"
    wall = time.monotonic() - started
    print(f"[{name}] rc={code} in {wall:.0f} s", flush=True)
    part = {"command": shlex.join(["python3", *("benchmarks/" + argv[0], *argv[1:])]), "returncode": code}
    if code != 0:
        part["log_tail"] = log_path.read_text()[-3000:]
    return part


def summarize(workers: dict | None, degree: dict | None, n: int) -> dict:
    """The numbers the run is judged by, read from the two scripts' JSON."""
    out: dict = {}
    if workers:
        out["wall_s"] = workers.get("wall_s")
        out["scaling"] = workers.get("scaling")
        out["agreement_with_threads@1"] = workers.get("agreement_with_threads@1")
        planner = workers.get("planner") or {}
        out["planner"] = {
            "predicted_makespan_s": {k: v.get("makespan_s") for k, v in (planner.get("predicted") or {}).items()},
            "ran_packs_makespan_s": planner.get("ran"),
        }
    if degree:
        runs = degree.get("runs") or {}
        split = runs.get(f"degree{n}") or {}
        out["degree_pack"] = {
            name: {
                "status": run.get("status"),
                "reason": run.get("reason"),
                "step_s": run.get("step_s"),
                "peak_gib_per_gpu": run.get("peak_gib_per_gpu"),
                "predicted": run.get("predicted"),
            }
            for name, run in runs.items()
        }
        out["degree_pack_loss_agreement"] = split.get("loss_agreement_with_degree1")
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true", help="both scripts' smoke modes on the CPU")
    p.add_argument("--tokenizer", type=Path, default=ROOT / ".whl" / "tokenizer")
    p.add_argument("--repeats", type=int, default=2, help="sweep_workers runs per mode")
    p.add_argument("--degree", type=int, default=2, help="GPUs the split pack runs on")
    p.add_argument("--budget-s", type=float, default=560.0, help="wall time both parts share")
    p.add_argument("--degree-share", type=float, default=0.45, help="share of the budget degree_pack gets")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    out = args.out or Path(os.environ.get("OUT") or ".")
    out.mkdir(parents=True, exist_ok=True)
    info = device_info()
    n = torch.cuda.device_count() if info["device"] == "cuda" and not args.smoke else 2  # smoke: two CPU devices
    tag = "smoke" if args.smoke else f"{gpu_tag(info)}x{n}"
    began = time.monotonic()
    smoke = ["--smoke"] if args.smoke else []

    degree_budget = args.budget_s * args.degree_share
    degree_json = out / f"degree-pack-{tag}.json"
    degree_argv = ["degree_pack.py", *smoke, "--degree", str(args.degree), "--budget-s", f"{degree_budget - 20:.0f}"]
    degree_part = run_part("degree_pack", [*degree_argv, "--out", str(degree_json)], degree_budget, out)

    left = args.budget_s - (time.monotonic() - began)
    workers_argv = ["sweep_workers.py", *smoke, "--tokenizer", str(args.tokenizer), "--repeats", str(args.repeats)]
    workers_part = run_part("sweep_workers", [*workers_argv, "--out", str(out)], max(left, 1.0), out)
    workers_json = out / f"sweep-workers-{tag}.json"  # the name sweep_workers.py gives its file

    def read(path: Path, part: dict) -> dict | None:
        return json.loads(path.read_text()) if part["returncode"] == 0 and path.is_file() else None

    degree, workers = read(degree_json, degree_part), read(workers_json, workers_part)
    result = {
        "benchmark": "multi_gpu",
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "command": shlex.join(["python3", "benchmarks/multi_gpu.py", *(argv if argv is not None else sys.argv[1:])]),
        **info,
        "gpus_visible": n if info["device"] == "cuda" else 0,
        "versions": versions(),
        "summary": summarize(workers, degree, args.degree),
        "parts": {"degree_pack": degree_part, "sweep_workers": workers_part},
        "degree_pack": degree,
        "sweep_workers": workers,
        "elapsed_s": time.monotonic() - began,
    }
    path = out / f"multi-gpu-{tag}.json"
    path.write_text(json.dumps(result, indent=1, default=str) + "\n")

    s = result["summary"]
    print(f"\n=== multi_gpu: {info.get('gpu') or 'cpu'} x{n} ===")
    for mode, walls in (s.get("wall_s") or {}).items():
        predicted = (s["planner"]["predicted_makespan_s"] or {}).get(mode.rpartition("@")[2].split("#")[0])
        ran = (s["planner"]["ran_packs_makespan_s"] or {}).get(mode) or []
        print(f"{mode:14s} wall {' '.join(f'{w:.1f}' for w in walls)} s; packs ran "
              f"{' '.join('-' if r is None else f'{r:.1f}' for r in ran)} s; planner "
              f"{'-' if predicted is None else f'{predicted:.1f}'} s")  # fmt: skip
    if s.get("scaling") is not None:
        print(f"scaling, processes@{n} over processes@1: {s['scaling']:.2f}x (goal >= 1.9x)")
    for run_name, run in (s.get("degree_pack") or {}).items():
        peak = run.get("peak_gib_per_gpu")
        print(f"{run_name:9s} {run['status']}: step {run.get('step_s') or float('nan'):.3f} s, peak "
              f"{'-' if peak is None else f'{max(peak) if isinstance(peak, list) else peak:.1f}'} GiB/GPU"
              f"{'' if not run.get('reason') else ' (' + run['reason'] + ')'}")  # fmt: skip
    agreement = s.get("degree_pack_loss_agreement") or {}
    if agreement:
        print(f"degree {args.degree} losses against degree 1: max rel diff {agreement.get('max_rel_diff'):.2e}")
    for part_name, part in result["parts"].items():
        if part["returncode"] != 0:
            print(f"{part_name}: rc={part['returncode']}; see {part_name}.log")
    print(f"json: {path}")


if __name__ == "__main__":
    main()
