"""The garbage collector in a sweep process: start-up and collections with it paused and frozen, or as Python runs it.

Runs the real CLI sweep (``plora-hpo sweep``, the quick start's demo file with ``--steps`` steps,
embedded SmolLM2-135M, CPU) ``--repeats`` times in each of two modes, alternating, each in a fresh
process and run directory with the phase timeline on:

* ``paused``: as the CLI runs it: the collector is paused during start-up, and what start-up
  loaded is frozen (``gc.freeze``) before the first pack;
* ``collector-on``: the same command with ``gc.disable`` and ``gc.freeze`` made no-ops in that
  process, i.e. the collector as Python runs it by default.

Per run: seconds from the process's start to the point where the sweep freezes what it loaded (the
``freeze`` phase, recorded in both modes), the full collections before and after the first training
step (count, seconds, longest; the timeline's ``gc`` phases), the wall time and the process's peak
resident memory. The JSON records date, machine, versions and the command; a short table prints last.

Usage::

    python benchmarks/collector.py [--steps 10] [--repeats 2] [--out benchmarks/results/collector-cpu.json]
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from importlib import metadata
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
MODES = ("collector-on", "paused")
# the CLI, in a process that says when it started; in collector-on mode pausing and freezing do nothing
SHIM = """import time
started = time.time()
import gc, os, sys
if os.environ.get("PLORA_BENCH_COLLECTOR_ON"):
    gc.disable = gc.freeze = lambda: None
print("process-start", started, flush=True)
from plora_hpo.cli import entry
entry(sys.argv[1:])
"""


def run_once(mode: str, sweep_file: Path, work: Path, index: int) -> dict:
    timeline = work / f"{mode}-{index}.jsonl"
    env = {**os.environ, "PLORA_HPO_TIMELINE": str(timeline), "MLFLOW_DISABLE_TELEMETRY": "true"}
    env.pop("PLORA_BENCH_COLLECTOR_ON", None)
    if mode == "collector-on":
        env["PLORA_BENCH_COLLECTOR_ON"] = "1"
    cmd = [sys.executable, "-c", SHIM, "sweep", str(sweep_file), "--run-dir", str(work / f"runs-{mode}-{index}")]
    began = time.time()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, cwd=ROOT, text=True)
    assert proc.stdout is not None
    output = proc.stdout.read()
    _, status, usage = os.wait4(proc.pid, 0)  # its own resource usage: the peak memory of that process alone
    proc.returncode = os.waitstatus_to_exitcode(status)
    wall = time.time() - began
    if proc.returncode != 0:
        raise SystemExit(f"error: the {mode} sweep failed (exit {proc.returncode}):\n{output[-2000:]}")
    started = float(next(line.split()[1] for line in output.splitlines() if line.startswith("process-start")))
    events = [json.loads(line) for line in timeline.read_text().splitlines()]
    freeze = next(e for e in events if e["phase"] == "freeze")
    first_step = min(e["start"] for e in events if e["phase"] == "train")
    collections = [e for e in events if e["phase"] == "gc" and e["generation"] == 2]

    def summary(spans: list[dict]) -> dict:
        seconds = [e["end"] - e["start"] for e in spans]
        return {
            "count": len(seconds),
            "seconds": round(sum(seconds), 3),
            "longest_s": round(max(seconds, default=0.0), 4),
            "threads": sorted({e["thread"] for e in spans}),
        }

    return {
        "mode": mode,
        "start_to_freeze_s": round(freeze["start"] - started, 3),
        "full_collections_before_first_step": summary([e for e in collections if e["start"] < first_step]),
        "full_collections_after_first_step": summary([e for e in collections if e["start"] >= first_step]),
        "wall_s": round(wall, 2),
        "peak_rss_mib": round(usage.ru_maxrss / 1024, 1),  # Linux: KiB
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=10, help="training steps per trial (the demo file has 30)")
    p.add_argument("--repeats", type=int, default=2, help="runs per mode, alternating")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "collector-cpu.json")
    args = p.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="plora-collector-"))
    demo = yaml.safe_load((ROOT / "search_spaces" / "demo.yaml").read_text())
    demo["budget"] = {"steps": args.steps}
    sweep_file = work / "demo.yaml"
    sweep_file.write_text(yaml.safe_dump(demo, sort_keys=False))
    runs = []
    for index in range(args.repeats):
        for mode in MODES:
            runs.append(run_once(mode, sweep_file, work, index))
            print(f"[{mode} {index}] {json.dumps(runs[-1])}", flush=True)
    summary = {}
    for mode in MODES:
        mine = [r for r in runs if r["mode"] == mode]
        after = [r["full_collections_after_first_step"] for r in mine]
        summary[mode] = {
            "start_to_freeze_s_median": statistics.median(r["start_to_freeze_s"] for r in mine),
            "full_collections_before_first_step_s_median": statistics.median(
                r["full_collections_before_first_step"]["seconds"] for r in mine
            ),
            "full_collections_after_first_step": sum(a["count"] for a in after),
            "longest_full_collection_after_first_step_s": max(a["longest_s"] for a in after),
            "wall_s_median": statistics.median(r["wall_s"] for r in mine),
            "peak_rss_mib_max": max(r["peak_rss_mib"] for r in mine),
        }
    result = {
        "benchmark": "collector",
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "python": platform.python_version()},
        "versions": {name: metadata.version(name) for name in ("torch", "transformers", "optuna", "mlflow-skinny")},
        "command": "python benchmarks/collector.py " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:])),
        "workload": f"search_spaces/demo.yaml (8 trials, packs of 4), {args.steps} steps, embedded SmolLM2-135M, CPU",
        "summary": summary,
        "runs": runs,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"\n=== collector: {result['workload']} ===")
    print(f"{'mode':14s} {'start->freeze s':>16s} {'gc before s':>12s} {'gc after n':>11s} {'longest s':>10s} "
          f"{'wall s':>8s} {'peak MiB':>9s}")  # fmt: skip
    for mode, s in summary.items():
        before = s["full_collections_before_first_step_s_median"]
        print(f"{mode:14s} {s['start_to_freeze_s_median']:16.2f} {before:12.2f} "
              f"{s['full_collections_after_first_step']:11d} {s['longest_full_collection_after_first_step_s']:10.4f} "
              f"{s['wall_s_median']:8.1f} {s['peak_rss_mib_max']:9.0f}")  # fmt: skip
    print(f"json: {args.out}")


if __name__ == "__main__":
    main()
