"""MLflow logging beside a busy Python thread: in the caller's process against the sweep's store process.

Usage::

    python benchmarks/mlflow_contention.py [--runs 8] [--steps 900] [--out results.json]

(default ``--out``: ``benchmarks/results/mlflow-contention-cpu.json``).

Each of ``--runs`` runs of a fresh sqlite MLflow store gets a loss curve of ``--steps`` steps (a
``train_loss`` and a ``learning_rate`` row per step, what a sweep logs per trial), one ``log_batch``
per run, through either MLflow's own client in this process (what a user's script does) or
:class:`plora_hpo._mlflow_process.ProcessClient` (what ``plora-hpo sweep`` does for a local store).
Each way is timed alone and beside a thread that spins in Python (a stand-in for a training loop's
host work: it needs the interpreter lock to launch anything), which also counts how many loop turns
it got done meanwhile, against its own rate with nothing beside it. The JSON records date, machine,
versions and the command; a short table prints last.
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
import threading
import time
from importlib import metadata
from pathlib import Path

import _bootstrap  # noqa: F401 - the repository on sys.path

os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")

from mlflow.entities import Metric
from mlflow.tracking import MlflowClient

from plora_hpo._mlflow_process import ProcessClient

SPIN_ALONE_S = 3.0


class Spinner:
    """A thread turning a pure-Python loop until stopped; ``turns`` counts them."""

    def __init__(self) -> None:
        self.turns = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._spin, daemon=True)

    def _spin(self) -> None:
        while not self._stop.is_set():
            for _ in range(1000):
                pass
            self.turns += 1

    def __enter__(self) -> Spinner:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def spin_rate() -> float:
    """Loop turns per second with nothing beside the spinner."""
    with Spinner() as spinner:
        time.sleep(SPIN_ALONE_S)
        turns = spinner.turns
    return turns / SPIN_ALONE_S


def log_curves(client, runs: list[str], steps: int) -> float:
    started = time.perf_counter()
    now = int(time.time() * 1000)
    for run_id in runs:
        rows = [Metric("train_loss", 1.0 / (s + 1), now, s) for s in range(1, steps + 1)]
        rows += [Metric("learning_rate", 2e-4, now, s) for s in range(1, steps + 1)]
        client.log_batch(run_id, metrics=rows)
    return time.perf_counter() - started


def measure(way: str, busy: bool, args: argparse.Namespace, work: Path, alone_rate: float) -> dict:
    store = work / f"{way.replace(' ', '-')}-{'busy' if busy else 'alone'}.db"
    uri = f"sqlite:///{store}"
    client = ProcessClient(uri) if way == "store process" else MlflowClient(uri)
    try:
        experiment = client.create_experiment("contention")
        runs = [client.create_run(experiment).info.run_id for _ in range(args.runs)]
        row = {"way": way, "beside_a_busy_thread": busy}
        if busy:
            with Spinner() as spinner:
                seconds = log_curves(client, runs, args.steps)
                turns = spinner.turns
            row["spinner_share_of_its_rate_alone"] = turns / seconds / alone_rate
        else:
            seconds = log_curves(client, runs, args.steps)
        row["seconds"] = seconds
        logged = MlflowClient(uri).get_metric_history(runs[-1], "train_loss")
        assert len(logged) == args.steps, f"{way}: {len(logged)} of {args.steps} rows logged"
        return row
    finally:
        if isinstance(client, ProcessClient):
            client.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=8)
    p.add_argument("--steps", type=int, default=900)
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/mlflow-contention-cpu.json"))
    args = p.parse_args()
    alone_rate = spin_rate()
    with tempfile.TemporaryDirectory() as tmp:
        rows = [
            measure(way, busy, args, Path(tmp), alone_rate)
            for way in ("in process", "store process")
            for busy in (False, True)
        ]
    result = {
        "device": "cpu",
        "cpu": platform.processor() or platform.machine(),
        "cpus": len(os.sched_getaffinity(0)),
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "versions": {
            "python": platform.python_version(),
            **{name: metadata.version(name) for name in ("mlflow", "sqlalchemy")},
        },
        "command": shlex.join([sys.executable.rsplit("/", 1)[-1], *sys.argv]),
        "runs": args.runs,
        "rows_per_run": 2 * args.steps,
        "spinner_turns_per_s_alone": alone_rate,
        "rows": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"\n{args.runs} curves of {2 * args.steps} rows into a fresh sqlite store ({result['cpus']} CPUs)")
    print(f"{'way':<14} {'beside':<12} {'seconds':>8}  spinner's rate kept")
    for row in rows:
        kept = row.get("spinner_share_of_its_rate_alone")
        beside = "busy thread" if row["beside_a_busy_thread"] else "nothing"
        print(f"{row['way']:<14} {beside:<12} {row['seconds']:8.2f}  {'-' if kept is None else f'{kept:.0%}'}")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
