"""The real sweep on one GPU against what users run today, in one call, with a timeline of the sweep.

Three ways to run the same trials (same configs, training data, step budget and evaluation):

* ``sweep``: the real CLI, ``plora-hpo sweep`` (Optuna grid sampler over paper120's space, the
  planner, the packed engine with Triton kernels, batched lm-eval scoring, MLflow sqlite store,
  checkpoints, PEFT export), run as a subprocess exactly as a user runs it;
* ``sequential``: an Optuna study whose objective trains one PEFT LoRA adapter on the Hugging Face
  model with torch AdamW (same schedule, clipping and data order) and scores it with lm-eval's
  ``HFLM(pretrained=<model dir>, peft=<adapter dir>)`` -- one trial at a time;
* ``colocated``: K such trial processes sharing the GPU at once (fractional-GPU schedulers such as
  Ray Tune do this), K chosen to fit the GPU's memory.

Right after the sweep, ``engine_only`` trains the sweep's biggest pack (the composition with the
most adapters: same configs, model, data and trainer options) on the packed engine alone, as
``benchmarks/throughput.py`` times a pack, and compares its step time with the one the sweep kept
for that pack (step start to step start, so the worker's work between steps counts): the
sweep's per-step overhead (checkpoint pacing and copies, MLflow, progress, data) as one ratio.
On a GPU it then profiles a few more of those steps (``torch.profiler``): the share of their span
with a kernel or copy running, and the gaps summed by what the host was doing meanwhile.

After the sweep, ``plora-hpo plan`` predicts the same sweep file's makespan on one device with
the calibration that sweep left on the machine (key ``planner``: the prediction, its row length,
and each sweep's pack span from its pack record).

With ``--again`` the same sweep then runs a second time in a fresh run directory: a user's next
sweep on the machine, which finds Triton's compiled kernels, Python's bytecode and the task data
cached (key ``sweep_again``: its wall time, GPU utilisation and timeline totals).

Where the sweep and a baseline do not fit in one device call together, ``--sweep-from`` takes the
sweep from an earlier call's JSON on the same machine (same options, so the same seeded model and
sweep file) and runs only the baselines against it; key ``sweep_from`` names that call.

The sweep runs with ``plora-hpo``'s CUDA allocator settings (the program's default,
:data:`plora_hpo.allocator.DEFAULT`, unless this environment sets them), the baselines with this
environment's, as a user's own scripts would: key ``allocator`` holds both. Per config, the
baselines' values are compared with the sweep's, and a config whose final training loss is not
finite on either side is named (``*_nonfinite_loss``).

The baselines take longer than one device call allows for 32 configs, so they run a subset of the
sweep's configs (spread over batch sizes and ranks) and the JSON says which numbers are measured
and which are extrapolated to all configs (``measured`` / ``extrapolated`` keys, never mixed).

The sweep runs with ``PLORA_HPO_TIMELINE`` set, so its worker writes every phase (training,
evaluation, export, checkpoint, MLflow, planner, Optuna hand-off, waiting) with wall-clock times;
GPU utilisation is sampled through NVML meanwhile (its mean over the sweep, over the samples
taken inside training steps, and the seconds the GPU sat idle inside each of the worker's phases:
``gpu_idle_s_by_phase``, where the wall time goes without the GPU working). The JSON and a PNG
timeline go under ``$OUT``; a short table is printed last.

Device (from the repository root, wheels from ``benchmarks/gpu_wheels.py`` in ``.whl``, MRPC in a
data folder)::

    python3 benchmarks/sweep_e2e.py --data-dir .device_data --tokenizer .whl/tokenizer 2>&1 | tee $OUT/log.txt

(filter its output only with ``grep --line-buffered``: a block-buffered pipe loses everything if the
call is cut short). Before anything is timed, the script compiles every installed module's
missing bytecode (``--bytecode write``, the default; key ``bytecode`` says what was missing), as a
plain ``pip install`` does: wheels installed with ``--no-compile``, or an image that ships torch
without bytecode and sets ``PYTHONDONTWRITEBYTECODE``, would otherwise make every sweep's start-up
compile them from source again.
The sweep's own log and its phase timeline are written under ``$OUT`` as they happen, so a
cut-short call still returns them.

CPU smoke run (a tiny random model, a few steps, every code path)::

    python benchmarks/sweep_e2e.py --smoke --data-dir ../shared/data --tokenizer .whl/tokenizer
"""

from __future__ import annotations

import argparse
import bisect
import datetime as dt
import gc
import itertools
import json
import math
import os
import platform
import re
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _bootstrap  # noqa: F401  (plora_hpo importable from a bare checkout)

if TYPE_CHECKING:
    from plora_hpo.adapter import AdapterConfig
    from plora_hpo.config import SweepConfig

ROOT = Path(__file__).resolve().parents[1]
T = TypeVar("T")
CLI_SHIM = (
    "import sys; sys.path.insert(0, {bench!r}); import _bootstrap; from plora_hpo.cli import entry; entry(sys.argv[1:])"
)
SEGMENT_KEYS = ("pack_id", "device", "labels", "start", "end", "steps", "measured_step_seconds",
                "predicted_step_seconds", "measured_peak_gib", "predicted_peak_gib", "memory_limit_gib", "solver",
                "plan_seconds")  # fmt: skip
PHASES = ["load-model", "load-data", "compile", "triton-compile", "train", "evaluate", "export", "checkpoint", "join",
          "mlflow", "planner", "calibrate", "optuna", "gather", "finishing", "idle", "gc", "mlflow-live",
          "heartbeat"]  # fmt: skip
COLORS = {
    "load-model": "#e67700",
    "load-data": "#f59f00",
    "compile": "#5f3dc4",
    "triton-compile": "#e03131",
    "train": "#2b8a3e",
    "evaluate": "#1971c2",
    "export": "#f08c00",
    "checkpoint": "#e8590c",
    "checkpoint-write": "#ffa94d",
    "checkpoint-delete": "#ffd8a8",
    "join": "#0ca678",
    "mlflow": "#9c36b5",
    "planner": "#c2255c",
    "calibrate": "#868e96",
    "optuna": "#5c940d",
    "gather": "#adb5bd",
    "finishing": "#74c0fc",
    "idle": "#dee2e6",
    "gc": "#000000",
    "mlflow-live": "#da77f2",
    "heartbeat": "#f06595",
    "leave": "#495057",
    "progress": "#495057",
    "loop": "#ced4da",
    "startup": "#fab005",
    "shutdown": "#fd7e14",
}


# --- environment -------------------------------------------------------------------------------
def versions() -> dict:
    import importlib.metadata as md

    out = {"python": platform.python_version()}
    names = ("torch", "triton", "transformers", "peft", "optuna", "mlflow-skinny", "lm-eval", "highspy", "gurobipy")
    for name in names:
        try:
            out[name] = md.version(name)
        except md.PackageNotFoundError:
            out[name] = None
    return out


def in_own_process(fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)`` in a spawned process of its own. What this process runs before the sweeps it
    times touches the GPU only that way: a CUDA context here (hundreds of MiB), or memory kept by
    its caching allocator, would leave each sweep less room than a user's sweep has, since a sweep
    plans its packs with the memory no other process holds."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(fn, *args).result()


def device_info() -> dict:
    """The first GPU's name and memory as torch reports them (asked in a process of its own)."""
    return in_own_process(_device_info)


def _device_info() -> dict:
    import torch

    if not torch.cuda.is_available():
        return {"device": "cpu", "gpu": None, "gpu_memory_gib": None}
    props = torch.cuda.get_device_properties(0)
    return {"device": "cuda", "gpu": props.name, "gpu_memory_gib": props.total_memory / 2**30}


def gpu_tag(info: dict) -> str:
    """The GPU's model in a results file's name ('h200' for 'NVIDIA H200', 'h100' for 'NVIDIA H100
    80GB HBM3'); 'cpu' without a GPU."""
    if not info.get("gpu"):
        return "cpu"
    found = re.search(r"\b([a-z]+\d+)", info["gpu"].lower())
    return found.group(1) if found else "gpu"


class GpuSampler:
    """Samples NVML's GPU utilisation (share of time a kernel ran) every ``period`` seconds."""

    def __init__(self, period: float = 0.1) -> None:
        self.period, self.samples, self._stop = period, [], threading.Event()
        self.handle = None
        try:
            import pynvml

            pynvml.nvmlInit()
            self.nvml = pynvml
            self.handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        except Exception:  # no GPU or no NVML: no samples, said so in the JSON
            self.nvml = None
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _sample(self) -> None:
        util = self.nvml.nvmlDeviceGetUtilizationRates(self.handle)
        mem = self.nvml.nvmlDeviceGetMemoryInfo(self.handle)
        self.samples.append((time.time(), util.gpu, mem.used / 2**30))

    def _run(self) -> None:
        while not self._stop.wait(self.period):
            self._sample()

    def __enter__(self) -> GpuSampler:
        if self.handle is not None:
            self._sample()  # before anything it times starts
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self.handle is not None:
            self._thread.join()

    def mean_util(self, start: float, end: float) -> float | None:
        vals = [u for t, u, _ in self.samples if start <= t <= end]
        return sum(vals) / len(vals) / 100 if vals else None

    def mean_util_during(self, spans: list[tuple[float, float]]) -> float | None:
        """Mean utilisation over the samples taken inside any of ``spans`` (e.g. the training steps)."""
        merged: list[list[float]] = []
        for start, end in sorted(spans):
            if merged and start <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], end)
            else:
                merged.append([start, end])
        starts = [start for start, _ in merged]
        vals = []
        for t, u, _ in self.samples:
            i = bisect.bisect_right(starts, t) - 1
            if i >= 0 and t <= merged[i][1]:
                vals.append(u)
        return sum(vals) / len(vals) / 100 if vals else None

    def peak_gib(self, start: float, end: float) -> float | None:
        vals = [m for t, _, m in self.samples if start <= t <= end]
        return max(vals) if vals else None

    def used_gib_before(self, start: float) -> float | None:
        """GPU memory in use at the last sample before ``start``: what other processes (and the
        driver) held when a process started at ``start``."""
        vals = [m for t, _, m in self.samples if t <= start]
        return vals[-1] if vals else None


# --- bytecode: the environment as pip installs it ------------------------------------------------
BYTECODE_PROBES = ("torch", "transformers", "numpy", "sympy", "optuna", "mlflow", "lm_eval", "plora_hpo")


def has_bytecode(module: str) -> bool | None:
    """Whether ``module``'s ``__init__`` has bytecode for this interpreter (None: not installed)."""
    import importlib.util

    spec = importlib.util.find_spec(module)
    if spec is None or not spec.origin or not spec.origin.endswith(".py"):
        return None
    return Path(importlib.util.cache_from_source(spec.origin)).exists()


def write_bytecode() -> dict:
    """Compile every installed module's bytecode that is missing, before anything is timed.

    ``pip install`` writes bytecode, and without it Python writes it at a module's first import.
    An image that ships packages without it and sets ``PYTHONDONTWRITEBYTECODE`` (the GPU image
    does, for torch, numpy and sympy) makes every process compile them from source again: each
    sweep's start-up would then measure that image, not a user's installation."""
    import site

    before = {m: has_bytecode(m) for m in BYTECODE_PROBES}
    # the interpreter's site-packages, folders on PYTHONPATH (wheels installed with --target) and this package
    dirs = [*site.getsitepackages(), *(p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p)]
    dirs = sorted({str(Path(d).resolve()) for d in dirs if Path(d).is_dir()} | {str(ROOT / "plora_hpo")})
    started = time.time()
    proc = subprocess.run([sys.executable, "-m", "compileall", "-q", "-j", "0", *dirs], capture_output=True, text=True)
    return {
        "before": before,
        "after": {m: has_bytecode(m) for m in BYTECODE_PROBES},
        "dirs": dirs,
        "seconds": round(time.time() - started, 1),
        "compileall_returncode": proc.returncode,  # non-zero when some file (a template, a test) does not compile
        "PYTHONDONTWRITEBYTECODE": os.environ.get("PYTHONDONTWRITEBYTECODE"),
    }


# --- the model: random weights at a real shape, saved with a real tokenizer --------------------------
def make_model_dir(shape_name: str, tokenizer_dir: Path, out: Path, device: str, smoke: bool) -> dict:
    """Random weights at ``shape_name`` with the tokenizer of ``tokenizer_dir``, saved in ``out``;
    made in a process of its own (:func:`in_own_process`: on a GPU, kept here, they would take
    gigabytes of the sweeps' room; each sweep's ``gpu_used_gib_before`` shows what others held)."""
    return in_own_process(_make_model_dir, shape_name, tokenizer_dir, out, device, smoke)


def _make_model_dir(shape_name: str, tokenizer_dir: Path, out: Path, device: str, smoke: bool) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from plora_hpo.models import random_config
    from plora_hpo.shapes import ModelShape, shape_by_name

    started = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    shape = ModelShape("llama", 64, 128, 2, 4, 2, len(tokenizer), True) if smoke else shape_by_name(shape_name)
    if shape.vocab < len(tokenizer):
        raise SystemExit(f"error: {shape_name}'s vocabulary {shape.vocab} < the tokenizer's {len(tokenizer)}")
    config = random_config(shape)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    parameters = sum(p.numel() for p in model.parameters())
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return {
        "shape": "tiny (smoke)" if smoke else shape_name,
        "parameters_b": parameters / 1e9,
        "tokenizer": "SmolLM2-135M (embedded model's)",
        "seconds": time.perf_counter() - started,
    }


def write_sweep_file(path: Path, model_dir: Path, task: str, steps: int, n_trials: int, pack: int, ev: dict) -> Path:
    import yaml

    base = yaml.safe_load((ROOT / "search_spaces" / "paper120.yaml").read_text())
    base.update(
        name=f"e2e-{task}",
        model=str(model_dir),
        tasks=[task],
        budget={"steps": steps},
        n_trials=n_trials,
        pack={"size": pack},
        evaluation=ev,
    )
    path.write_text(yaml.safe_dump(base, sort_keys=False))
    return path


# --- 1. the real sweep --------------------------------------------------------------------------
def run_sweep(
    args, sweep_file: Path, run_dir: Path, sampler: GpuSampler, timeout_s: float, stem: str = "sweep"
) -> dict:
    """The CLI sweep in a process of its own; ``stem`` names its log and timeline under ``$OUT``.
    A sweep still running after ``timeout_s`` is killed: its record then holds the phases it ran
    (``ran_s``, the timeline so far) and no trials or wall time."""
    timeline = args.out / f"{stem}.timeline.jsonl"  # under $OUT: a call cut short still returns the phases so far
    timeline.unlink(missing_ok=True)
    argv = ["sweep", str(sweep_file), "--run-dir", str(run_dir), "--data-dir", str(args.data_dir)]
    argv += ["--workers", args.workers] if args.workers else []
    cmd = [sys.executable, "-c", CLI_SHIM.format(bench=str(ROOT / "benchmarks")), *argv]
    env = {**os.environ, "PLORA_HPO_TIMELINE": str(timeline), "PYTHONUNBUFFERED": "1"}
    log_path = args.out / f"{stem}.log"
    print(f"[{stem}] plora-hpo {' '.join(shlex.quote(a) for a in argv)}", flush=True)
    start = time.time()
    with open(log_path, "w") as log:
        try:
            returncode: int | str = subprocess.run(
                cmd, stdout=log, stderr=subprocess.STDOUT, env=env, timeout=timeout_s
            ).returncode
        except subprocess.TimeoutExpired:
            returncode = "timeout"
    end = time.time()
    tail = log_path.read_text()[-3000:]
    result = {
        "command": "plora-hpo " + " ".join(shlex.quote(a) for a in argv),
        "returncode": returncode,
        "wall_s": end - start if returncode == 0 else None,
        "ran_s": end - start,
        "start": start,
        "end": end,
        "log_tail": tail if returncode else tail[-800:],
        "gpu_util_mean": sampler.mean_util(start, end),
        "gpu_peak_used_gib": sampler.peak_gib(start, end),
        "gpu_used_gib_before": sampler.used_gib_before(start),
    }
    if returncode == "timeout":
        result["error"] = f"still running after {timeout_s:.0f}s"
    print(f"[{stem}] rc={returncode} {'wall' if returncode == 0 else 'ran'} {end - start:.1f}s", flush=True)
    events = [json.loads(line) for line in timeline.read_text().splitlines()] if timeline.exists() else []
    if events:  # a sweep killed or failed part-way still shows where its time went
        result["timeline"] = summarize_timeline(events, start, end, sampler.samples)
        result["events"] = events
        steps = [(e["start"], e["end"]) for e in events if e["phase"] == "train"]
        result["gpu_util_mean_training_steps"] = sampler.mean_util_during(steps)
    if returncode != 0:
        print(tail, flush=True)
        return result
    result["trials"] = read_trials(run_dir, sweep_file, start)
    packs = run_dir / "packs" / "packs.json"
    if packs.exists():
        segs = json.loads(packs.read_text())
        if isinstance(segs, dict):  # first pack start to last pack end: what the planner predicts
            result["packs_makespan_s"] = segs["summary"]["makespan_seconds"]
        segs = segs.get("segments", segs) if isinstance(segs, dict) else segs
        result["pack_segments"] = [
            {k: s.get(k) for k in SEGMENT_KEYS} | {"members": len(s.get("members") or [])} for s in segs
        ]
    return result


def planner_prediction(
    sweep_file: Path, gpus: int, info: dict, *, shape: str, smoke: bool, data_dir: Path | None = None
) -> dict:
    """``plora-hpo plan --json`` for this sweep on ``gpus`` devices, with the calibration this
    machine holds at the time (that of the sweeps run before): the predicted makespan, packs and
    row length; or the error line that says why there is none."""
    if smoke:
        return {"error": "smoke run: a tiny random model, not a shape the planner's cost model knows"}
    memory = f"{info.get('gpu_memory_gib') or 24:.2f}"
    argv = ["plan", str(sweep_file), "--model", shape, "--gpus", str(gpus), "--json", "--no-gantt",
            "--gpu-name", info.get("gpu") or "cpu", "--gpu-memory-gib", memory]  # fmt: skip
    argv += ["--data-dir", str(data_dir)] if data_dir is not None else []
    cmd = [sys.executable, "-c", CLI_SHIM.format(bench=str(ROOT / "benchmarks")), *argv]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    if proc.returncode != 0:
        return {"command": "plora-hpo " + shlex.join(argv), "error": (proc.stderr.strip().splitlines() or ["?"])[-1]}
    plan = json.loads(proc.stdout)
    keys = ("degree", "gpus", "configs", "width", "step_seconds", "start", "end")
    return {
        "command": "plora-hpo " + shlex.join(argv),
        "makespan_s": plan["makespan"],
        "seq_len": plan["seq_len"],
        "seq_len_source": plan["seq_len_source"],
        "solver": plan["solver"],
        "solver_note": plan["solver_note"],
        "calibrated_from": plan["calibrated_from"],
        "packs": [{k: pack[k] for k in keys} for pack in plan["packs"]],
    }


def read_trials(run_dir: Path, sweep_file: Path, start: float) -> list[dict]:
    import optuna

    from plora_hpo.config import load_sweep

    config = load_sweep(sweep_file)
    storage = f"sqlite:///{run_dir / 'optuna.db'}"
    names = optuna.get_all_study_names(storage)
    name = next(n for n in names if n.endswith(config.tasks[0]))
    study = optuna.load_study(study_name=name, storage=storage)
    out = []
    for t in study.trials:
        done = t.datetime_complete.timestamp() if t.datetime_complete else None
        out.append(
            {
                "number": t.number,
                "state": t.state.name,
                "params": t.params,
                "value": t.value,
                "final_train_loss": t.user_attrs.get("final_train_loss"),
                "pack_id": t.user_attrs.get("pack_id"),
                "completed_at_s": None if done is None else done - start,
            }
        )
    return out


def worker_spans(events: list[dict], start: float, end: float) -> list[tuple[float, float, str]]:
    """The sweep's wall time cut into ``(from, to, phase)`` pieces by the worker threads' innermost
    phase: 'startup' before their first phase, 'loop' inside a pack with no phase, 'shutdown' after
    their last. ``events``: the worker threads' phases only."""
    bounds = sorted({e["start"] for e in events} | {e["end"] for e in events})
    spans = [(start, bounds[0], "startup")]
    for a, b in itertools.pairwise(bounds):
        mid = (a + b) / 2
        active = [e for e in events if e["start"] <= mid < e["end"]]
        spans.append((a, b, min(active, key=lambda e: e["end"] - e["start"])["phase"] if active else "loop"))
    spans.append((bounds[-1], end, "shutdown"))
    return spans


def gpu_idle_by_phase(spans: list[tuple[float, float, str]], samples: list[tuple]) -> dict[str, float]:
    """Seconds the GPU sat idle inside each phase of ``spans`` (:func:`worker_spans`), largest first:
    each NVML sample's idle share (1 − utilisation) held until the next sample, integrated over the
    phase's pieces. Where the sweep's wall time goes without the GPU working; empty without samples."""
    start, end = spans[0][0], spans[-1][1]
    points = [(t, 1 - u / 100) for t, u, *_ in samples if start <= t <= end]
    if len(points) < 2:
        return {}
    times = [t for t, _ in points]
    idle: dict[str, float] = {}
    for a, b, name in spans:
        i = max(0, bisect.bisect_right(times, a) - 1)  # the sample holding at ``a``
        seconds = 0.0
        while i < len(points) and points[i][0] < b:
            lo, hi = max(a, points[i][0]), min(b, points[i + 1][0] if i + 1 < len(points) else b)
            seconds += max(0.0, hi - lo) * points[i][1]
            i += 1
        idle[name] = idle.get(name, 0.0) + seconds
    return {k: round(v, 2) for k, v in sorted(idle.items(), key=lambda kv: -kv[1])}


def is_worker_thread(name: str) -> bool:
    """A device's training loop (``plora-<device>``), not one of its background threads."""
    background = name.endswith("-checkpoints") or is_finishing(name) or is_deleter(name)
    return name.startswith("plora-") and not background


def is_finishing(name: str) -> bool:
    """One of a device's two threads recording finished trials: their files (``plora-<device>-exports``),
    then their MLflow runs and results (``plora-<device>-finishing``)."""
    return name.endswith(("-exports", "-finishing"))


def is_deleter(name: str) -> bool:
    """One of a device's checkpoint-removal threads (``plora-<device>-checkpoint-deletes_<i>``)."""
    return "-checkpoint-deletes_" in name


TAIL_THREADS = (  # (who, whether a thread name is theirs), in the order the tail is printed
    ("worker", is_worker_thread),
    ("export thread", lambda name: name.endswith("-exports")),
    ("finishing thread", lambda name: name.endswith("-finishing")),
    ("checkpoint writer", lambda name: name.endswith("-checkpoints")),
    ("checkpoint deletes", is_deleter),
    ("live curves", lambda name: name == "mlflow-live-curves"),
    ("main", lambda name: name == "MainThread"),
)


def summarize_tail(events: list[dict], end: float) -> dict:
    """From the end of the last training step to the sweep's end: when each thread's last phase
    ended and the seconds it spent in each phase meanwhile (its share after the step only). The
    thread that ends last before the exit is the tail's critical path."""
    steps = [e["end"] for e in events if e["phase"] == "train"]
    if not steps:
        return {}
    last = max(steps)
    threads = {}
    for who, theirs in TAIL_THREADS:
        after = [e for e in events if theirs(e["thread"]) and e["end"] > last]
        if not after:
            continue
        phases: dict[str, float] = {}
        for e in after:
            phases[e["phase"]] = phases.get(e["phase"], 0.0) + e["end"] - max(e["start"], last)
        threads[who] = {
            "ends_s": round(max(e["end"] for e in after) - last, 3),
            "phases_s": {k: round(v, 3) for k, v in sorted(phases.items(), key=lambda kv: -kv[1])},
        }
    return {"after_last_step_s": round(end - last, 3), "threads": threads}


def summarize_timeline(events: list[dict], start: float, end: float, samples: list[tuple] = ()) -> dict:
    """Exclusive seconds per phase (innermost phase wins), in-pack loop time, start-up and shutdown;
    with the GPU sampler's ``samples``, the GPU's idle seconds in each (:func:`gpu_idle_by_phase`)."""
    from plora_hpo.timeline import EXIT_PHASE

    tail = summarize_tail(events, end)
    collections = [e for e in events if e["phase"] == "gc"]  # on any thread: a collection holds them all
    live = [e for e in events if e["phase"] == "mlflow-live"]  # live loss curves, logged by a thread of their own
    beats = [e for e in events if e["phase"] == "heartbeat"]  # Optuna's heartbeat threads, one per trial in flight
    background = [e for e in events if e["thread"].endswith("-checkpoints")]
    deletes = [e for e in events if is_deleter(e["thread"]) and e["phase"] == "checkpoint-delete"]
    finishing = [e for e in events if is_finishing(e["thread"])]
    exits = [e for e in events if e["phase"] == EXIT_PHASE]
    loading = [e for e in events if e["thread"] == "MainThread" and e["phase"] != EXIT_PHASE]  # processes' own
    events = [e for e in events if is_worker_thread(e["thread"])]
    if not events:
        return {"note": "no timeline events (PLORA_HPO_TIMELINE not honoured?)"}
    seconds: dict[str, float] = {}
    spans = worker_spans(events, start, end)
    for a, b, name in spans:
        seconds[name] = seconds.get(name, 0.0) + (b - a)
    first = spans[0][1]
    wall = end - start

    def totals(spans: list[dict]) -> dict[str, float]:
        return {
            name: round(sum(e["end"] - e["start"] for e in spans if e["phase"] == name), 3)
            for name in sorted({e["phase"] for e in spans})
        }

    startup_phases = totals([e for e in loading if e["start"] < first])
    shutdown_phases = totals([e for e in loading if e["start"] >= first])
    trains = [e for e in events if e["phase"] == "train"]
    steps = [e["end"] - e["start"] for e in trains]
    warm = sorted(steps[2:]) if len(steps) > 3 else sorted(steps)
    median = warm[len(warm) // 2] if warm else None
    compiles = []  # kernels compiled one by one on the worker's thread, and the training step they were in
    for e in events:
        if e["phase"] == "triton-compile":
            step = next((i for i, t in enumerate(trains) if t["start"] <= e["start"] <= t["end"]), None)
            compiles.append({"kernel": e.get("kernel"), "at_s": round(e["start"] - start, 3),
                             "seconds": round(e["end"] - e["start"], 3), "train_step": step})  # fmt: skip

    def inside(step: dict, phases: list[dict]) -> float:  # seconds inside a step with any of ``phases`` running
        cuts = sorted((max(e["start"], step["start"]), min(e["end"], step["end"])) for e in phases)
        seconds, reached = 0.0, step["start"]
        for a, b in cuts:  # overlapping spans (threads at once) count once
            seconds += max(0.0, b - max(a, reached))
            reached = max(reached, b)
        return seconds

    most = 0  # whether a step computed more tokens than every step before it (memory and shapes never met before)
    biggest = []
    for t in trains:
        biggest.append(t.get("padded_tokens", 0) > most)
        most = max(most, t.get("padded_tokens", 0))
    slow = [  # what made a step take more than twice the median: kernels compiled, allocator retries, and what
        # held the GIL from other threads meanwhile: collections, live loss curves going to MLflow, Optuna's heartbeats
        {"train_step": i, "seconds": round(d, 3), "alloc_retries": trains[i].get("alloc_retries"),
         "padded_tokens": trains[i].get("padded_tokens"), "most_tokens_yet": biggest[i],
         "compiled": [c["kernel"] for c in compiles if c["train_step"] == i],
         "gc_s": round(inside(trains[i], collections), 3), "mlflow_live_s": round(inside(trains[i], live), 3),
         "heartbeat_s": round(inside(trains[i], beats), 3)}
        for i, d in enumerate(steps) if median is not None and d > 2 * median
    ]  # fmt: skip
    return {
        "wall_s": wall,
        "seconds": {k: round(v, 3) for k, v in sorted(seconds.items(), key=lambda kv: -kv[1])},
        "fraction": {k: round(v / wall, 4) for k, v in seconds.items()},
        "startup_phases": startup_phases,
        "shutdown_phases": shutdown_phases,
        "gpu_idle_s_by_phase": gpu_idle_by_phase(spans, samples),
        "background_checkpoint_write_s": round(sum(e["end"] - e["start"] for e in background), 3),
        "background_checkpoint_writes": len(background),
        "background_checkpoint_delete_s": round(sum(e["end"] - e["start"] for e in deletes), 3),
        "background_checkpoint_deletes": len(deletes),
        "background_finishing": totals(finishing),
        "triton_compiles": compiles,
        "slow_steps": slow,
        "exits": [
            {
                "pid": e.get("pid"),
                "before_end_s": round(end - e["start"], 3),
                "teardown": e.get("teardown"),
                "waits_for": e.get("waits_for"),
            }
            for e in exits
        ],
        "tail": tail,
        "train_steps": len(steps),
        "step_seconds_median": median,
        "step_seconds_first": steps[0] if steps else None,
        "note": "exclusive wall seconds of the worker thread by innermost phase; 'loop' = in a pack, no phase; "
        "'startup' = process start to the worker's first phase (imports, input checks, model and data, "
        "stores), with startup_phases the parts of it the sweep's processes timed (summed over processes: they "
        "overlap; check-* and check-resume are parts of check-inputs); shutdown_phases: the same after the "
        "worker's first phase (closing); "
        "'shutdown' = the worker's last phase to process exit; gpu_idle_s_by_phase: the GPU's idle seconds inside "
        "each of those (NVML samples, each held until the next); background_checkpoint_write_s: the checkpoint "
        "writer thread's torch.save time, overlapping the worker's phases; background_checkpoint_delete_s: the "
        "removals of finished trials' checkpoints, summed over the threads that run them side by side; "
        "background_finishing: the phases of the threads recording finished trials (their files on one, their "
        "MLflow runs and results on the other), overlapping the worker's; 'finishing' "
        "on the worker: waiting for them at a pack's end; triton_compiles: Triton kernel variants compiled on the "
        "worker's thread (not those of the compile pass, compiled on a pool), with the training step (0-based) they "
        "were in; slow_steps: training steps over twice the median, with the kernels compiled in them and the "
        "caching allocator's retries during them (alloc_retries, CUDA only), the tokens the step computed "
        "(padded_tokens) and whether no earlier step computed as many (most_tokens_yet), and the seconds of them "
        "during which a full collection (gc_s), a live loss curve's MLflow write (mlflow_live_s) or an Optuna "
        "heartbeat (heartbeat_s) ran on any thread; exits: each plora-hpo process about to "
        "exit, how long before the sweep's end, whether it took Python's teardown and which threads that waited for; "
        "tail: from the end of the last training step to the sweep's end, when each thread's last phase ended "
        "(ends_s, seconds after that step) and its seconds in each phase meanwhile",
    }


# --- 1b. the sweep's biggest pack on the engine alone ---------------------------------------------
ENGINE_WARMUP_STEPS = 3  # kernel compilation, allocator growth and library heuristics happen here
ENGINE_SETUP_S = 30.0  # a guess (not measured) at loading model, data and eval tasks: only to skip under --budget-s


def biggest_segment(segments: list[dict]) -> int | None:
    """Index of the pack composition with the most adapters (then the most steps) among those of
    three steps or more (the first step is warm-up; two more starts make one warm interval)."""
    long_enough = [i for i, s in enumerate(segments) if s["steps"] >= 3]
    return max(long_enough, key=lambda i: (segments[i]["members"], segments[i]["steps"]), default=None)


def segment_step_starts(segments: list[dict], events: list[dict], index: int) -> list[float] | None:
    """Wall-clock starts of segment ``index``'s training steps, from the timeline.

    A worker runs its steps one at a time and its segments (recorded in the order they closed) tile
    them, so a segment's steps are its slice of its worker thread's ``train`` phases. None when the
    counts disagree (a step that ran out of memory has a phase but counts as no step).
    """
    device = segments[index]["device"]
    mine = [i for i, s in enumerate(segments) if s["device"] == device]
    thread = f"plora-{device.partition('@')[0]}"  # a worker process's devices are <device>@<process>
    starts = sorted(e["start"] for e in events if e["phase"] == "train" and e["thread"] == thread)
    if sum(segments[i]["steps"] for i in mine) != len(starts):
        return None
    first = sum(segments[i]["steps"] for i in mine if i < index)
    return starts[first : first + segments[index]["steps"]]


def pack_configs(segment: dict, trials: list[dict], config: SweepConfig) -> list[AdapterConfig]:
    """The segment's adapter configs, rebuilt from its trials' parameters as the sweep builds them
    (the seed too: it sets an adapter's initialisation and data order), matched by pack and label."""
    from plora_hpo.space import SearchSpace

    space = SearchSpace(config.space, seed=config.seed, use_rslora=config.train.use_rslora)
    by_label = {}
    for t in trials:
        if t["pack_id"] == segment["pack_id"]:
            adapter = space.to_config(t["params"], seed=space.config_seed(t["params"]))
            by_label[adapter.label()] = adapter
    missing = [label for label in segment["labels"] if label not in by_label]
    if missing:
        raise LookupError(f"no trial of {segment['pack_id']} has the config {', '.join(missing)}")
    return [by_label[label] for label in segment["labels"]]


def engine_step_seconds(config: SweepConfig, configs: list[AdapterConfig], setup: dict, steps: int, work: Path) -> dict:
    """``configs`` as one pack on the packed engine alone, timed as ``throughput.py`` times a pack.

    Model, dtype, device, task data, optimizer settings and trainer options come from the sweep's
    own code (a :class:`PackedSweep` that never starts its worker, and the trainer its packs
    build); what the sweep adds between steps (checkpoints, MLflow, progress, admission) is left
    out. Each adapter keeps the sweep's step budget, or enough for the timed steps.
    """
    import torch
    from throughput import timed

    from plora_hpo.engine import AdapterJob, PackedTrainer
    from plora_hpo.sweep import PackedSweep

    device = "cpu" if setup["device"] == "cpu" else "cuda:0"
    with PackedSweep(
        config, tracker=None, run_dir=work / "engine-only", data_dir=setup["data_dir"], device=device
    ) as sweep:
        worker = sweep.workers[0]
        trainer = PackedTrainer(
            worker.packed,
            settings=worker.optimizer_settings(),
            pad_id=sweep.base.tokenizer.pad_token_id,
            device=worker.device,
            micro_batch_tokens=config.pack.micro_batch_tokens,
            activation_checkpointing=config.pack.activation_checkpointing,
        )
        examples = sweep.tasks[setup["task"]].examples
        for i, adapter in enumerate(configs):
            budget = max(sweep.total_steps(setup["task"], adapter), ENGINE_WARMUP_STEPS + steps)
            trainer.add_job(AdapterJob(f"engine-{i}", adapter, examples, budget))
        step_s, warmup_s = timed(trainer.step, ENGINE_WARMUP_STEPS, steps, worker.device)
        per_step = trainer.stats.step_seconds[-steps:]
        gaps = None
        if worker.device.type == "cuda":
            try:
                gaps = kernel_gaps(trainer.step, GAP_PROFILE_STEPS)
            except Exception as exc:  # a diagnosis only: the timing above stands
                gaps = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
    return {
        "engine_step_s": step_s,
        "engine_step_s_median": statistics.median(per_step),
        "engine_warmup_s": warmup_s,
        "engine_tokens_per_step": trainer.stats.tokens / trainer.stats.steps,
        "torch_threads": torch.get_num_threads(),  # on the CPU: as a sweep sizes it, the cores free at its start
        "kernel_gaps": gaps,
    }


GAP_PROFILE_STEPS = 5


def kernel_gaps(step, n: int, min_gap_us: float = 100.0) -> dict:
    """Where the GPU waits inside training steps: ``n`` steps under torch.profiler, the share of their
    span with a kernel or copy on the GPU, and the gaps (at least ``min_gap_us``) summed by what the
    host was doing meanwhile (the outermost and innermost CPU op open at the gap's middle; "python"
    when none was)."""
    import torch
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            step()
        torch.cuda.synchronize()
    events = list(prof.events())
    spans = sorted((e.time_range.start, e.time_range.end) for e in events if e.device_type == DeviceType.CUDA)
    cpu = [e for e in events if e.device_type == DeviceType.CPU]
    if not spans:
        return {"note": "the profiler saw no GPU activity"}
    merged = [list(spans[0])]
    for a, b in spans[1:]:
        if a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    span = merged[-1][1] - merged[0][0]
    busy = sum(b - a for a, b in merged)
    by_cause: dict[str, list[float]] = {}
    gaps = [(a[1], b[0]) for a, b in itertools.pairwise(merged) if b[0] - a[1] >= min_gap_us]
    for start, end in gaps:
        mid = (start + end) / 2
        open_ops = [e for e in cpu if e.time_range.start <= mid <= e.time_range.end]
        if open_ops:
            outer = max(open_ops, key=lambda e: e.time_range.end - e.time_range.start).name
            inner = min(open_ops, key=lambda e: e.time_range.end - e.time_range.start).name
            cause = outer if outer == inner else f"{outer} > {inner}"
        else:
            cause = "python"
        by_cause.setdefault(cause, []).append(end - start)
    top = sorted(by_cause.items(), key=lambda kv: -sum(kv[1]))[:12]
    return {
        "steps": n,
        "span_ms": span / 1e3,
        "gpu_busy_share": busy / span,
        "gaps": len(gaps),
        "gap_ms": sum(b - a for a, b in gaps) / 1e3,
        "gap_ms_by_host_op": {k: {"ms": round(sum(v) / 1e3, 3), "gaps": len(v)} for k, v in top},
        "min_gap_us": min_gap_us,
    }


def engine_only_cost(segments: list[dict], steps: int) -> float:
    """Seconds the stage should take: loading, then its steps at twice the sweep's slowest warm step
    time (the warm-up steps compile kernels)."""
    step_s = max((s["measured_step_seconds"] or 0.0 for s in segments), default=0.0)
    return ENGINE_SETUP_S + 2 * (ENGINE_WARMUP_STEPS + steps) * step_s


def run_engine_only(sweep: dict, config: SweepConfig, setup: dict, steps: int, sampler: GpuSampler, work: Path) -> dict:
    """The sweep's biggest pack on the engine alone against the sweep's own step time for it.

    The sweep's step time is step start to next step start over the pack's warm steps (the first
    left out, as in its ``measured_step_seconds``), so the worker's work between steps counts;
    ``sweep_trainer_step_s`` is the training step alone as the sweep's trainer timed it.
    """
    import torch

    segments = sweep.get("pack_segments") or []
    index = biggest_segment(segments)
    if index is None:
        return {"error": "no pack composition of the sweep ran 3 steps or more"}
    seg = segments[index]
    starts = segment_step_starts(segments, sweep.get("events", []), index)
    warm = [b - a for a, b in itertools.pairwise(starts)][1:] if starts else []
    out = {
        "pack_id": seg["pack_id"],
        "configs": seg["members"],
        "labels": seg["labels"],
        "warmup_steps": ENGINE_WARMUP_STEPS,
        "steps_timed": steps,
        "sweep_steps": seg["steps"],
        "sweep_step_s": statistics.mean(warm) if warm else None,
        "sweep_step_s_median": statistics.median(warm) if warm else None,
        "sweep_trainer_step_s": seg["measured_step_seconds"],
    }
    threads = torch.get_num_threads()  # a sweep on the CPU sizes torch's thread pool to the free cores
    start = time.time()
    try:
        out |= engine_step_seconds(config, pack_configs(seg, sweep["trials"], config), setup, steps, work)
    except Exception as exc:  # recorded; the baselines still run
        traceback.print_exc()
        out["error"] = f"{type(exc).__name__}: {str(exc)[:400]}"
    end = time.time()
    torch.set_num_threads(threads)
    gc.collect()  # the model and the pack's optimizer state, before the baselines load theirs
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    ratio = out["sweep_step_s"] / out["engine_step_s"] if out["sweep_step_s"] and "engine_step_s" in out else None
    out.update(sweep_over_engine=ratio, seconds=end - start, gpu_util_mean=sampler.mean_util(start, end))
    out["note"] = (
        "engine_step_s: wall seconds per step over steps_timed back-to-back steps after warmup_steps, synchronised "
        "at both ends (throughput.py's timing); engine_step_s_median: the trainer's own per-step seconds; "
        "sweep_step_s: the sweep's step-start-to-step-start seconds in that pack (its first step left out), "
        "so the sweep's work between steps counts; sweep_trainer_step_s: the sweep's training steps alone"
    )
    print(f"[engine_only] {seg['pack_id']} ({seg['members']} configs), {steps} steps: "
          f"engine {out.get('engine_step_s', math.nan):.4f} s/step, sweep {out['sweep_step_s'] or math.nan:.4f} "
          f"(training step alone {seg['measured_step_seconds'] or math.nan:.4f}), sweep/engine {ratio or math.nan:.2f}"
          f"{'; ' + out['error'] if 'error' in out else ''}", flush=True)  # fmt: skip
    return out


# --- 2./3. the PEFT baselines ---------------------------------------------------------------------
def peft_trial(params: dict, setup: dict) -> dict:
    """One trial as a user runs it: HF model + PEFT LoRA + torch AdamW, then lm-eval HFLM with the adapter."""
    import torch
    from lm_eval.evaluator import evaluate
    from lm_eval.models.huggingface import HFLM
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, get_linear_schedule_with_warmup

    from plora_hpo.engine.batching import DataStream
    from plora_hpo.evaluation.runner import FEWSHOT_SEED, lm_eval_tasks
    from plora_hpo.evaluation.sampling import document_sample
    from plora_hpo.study import FINAL_LOSS_STEPS
    from plora_hpo.tasks import build_eval_tasks, get_task, load_train_examples

    device = setup["device"]
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    timings = {}
    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(setup["model_dir"], dtype=dtype).to(device)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(setup["model_dir"])
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    examples = load_train_examples(setup["task"], tokenizer, seq_len=setup["seq_len"], data_dir=setup["data_dir"])
    rank = int(params["rank"])
    alpha = rank * float(params["alpha_multiplier"])
    lora = LoraConfig(r=rank, lora_alpha=alpha, target_modules=setup["targets"], lora_dropout=0.0, bias="none")
    model = get_peft_model(model, lora)
    for p in model.parameters():  # PEFT keeps the adapter in the base dtype; the sweep trains fp32 masters
        if p.requires_grad:
            p.data = p.data.float()
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=float(params["learning_rate"]), weight_decay=0.0, fused=device == "cuda")
    steps = setup["steps"]
    sched = get_linear_schedule_with_warmup(opt, 0, steps)
    stream = DataStream(examples, seed=setup.get("seed", 0))
    timings["setup_s"] = time.perf_counter() - t0
    t1 = time.perf_counter()
    losses = []
    model.train()
    for _ in range(steps):
        batch = stream.take(int(params["batch_size"]))
        width = max(len(e.input_ids) for e in batch)
        ids = torch.full((len(batch), width), pad, dtype=torch.long)
        labels = torch.full((len(batch), width), -100, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for i, e in enumerate(batch):
            ids[i, : len(e.input_ids)] = torch.tensor(e.input_ids)
            labels[i, : len(e.labels)] = torch.tensor(e.labels)
            mask[i, : len(e.input_ids)] = 1
        with torch.autocast(device_type=device, dtype=dtype, enabled=device == "cuda"):
            out = model(input_ids=ids.to(device), attention_mask=mask.to(device), labels=labels.to(device))
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(trainable, 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        losses.append(out.loss.item())
    timings["train_s"] = time.perf_counter() - t1
    t2 = time.perf_counter()
    adapter_dir = Path(tempfile.mkdtemp(prefix="peft-adapter-"))
    model.save_pretrained(adapter_dir)
    del model, opt
    if device == "cuda":
        torch.cuda.empty_cache()
    timings["save_s"] = time.perf_counter() - t2
    t3 = time.perf_counter()
    lm = HFLM(
        pretrained=setup["model_dir"],
        peft=str(adapter_dir),
        dtype="bfloat16" if device == "cuda" else "float32",
        device=device,
        batch_size=setup["eval_batch_size"],
    )
    task_dict = build_eval_tasks(setup["task"], data_dir=setup["data_dir"])
    for task in lm_eval_tasks(task_dict):
        task.set_fewshot_seed(seed=FEWSHOT_SEED)
    samples = None  # the same seeded, stratified documents the sweep's scorer uses
    if setup["eval_limit"]:
        picked = {
            t.config.task: document_sample(t, setup["eval_limit"], seed=setup["seed"]) for t in lm_eval_tasks(task_dict)
        }
        samples = {name: idx for name, idx in picked.items() if idx is not None} or None
    res = evaluate(lm=lm, task_dict=task_dict, samples=samples, bootstrap_iters=0)
    spec = get_task(setup["task"])
    value = res["results"][spec.lm_eval_task][spec.primary_metric]
    del lm
    if device == "cuda":
        torch.cuda.empty_cache()
    timings["eval_s"] = time.perf_counter() - t3
    timings["total_s"] = time.perf_counter() - t0
    last = losses[-FINAL_LOSS_STEPS:]  # as the sweep records it
    return {"params": params, "value": value, "final_train_loss": sum(last) / len(last), **timings}


class OutOfBudget(BaseException):
    """The call's ``--budget-s`` ran out while a baseline was still running (a BaseException, so that
    no ``except Exception`` inside the trial's libraries takes it for the trial's own error)."""


def out_of_budget_note(seconds: float) -> str:
    return (f"stopped after {seconds:.0f}s: the call's --budget-s ran out before it ended; run it in a call of "
            "its own against this sweep with --sweep-from")  # fmt: skip


def run_sequential(configs: list[dict], setup: dict, sampler: GpuSampler, deadline_s: float) -> dict:
    """Sequential Optuna trials: the configs enqueued, one PEFT trial at a time. A trial still running
    after ``deadline_s`` is stopped: the trials done before it are the measurement."""
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(direction="maximize", sampler=optuna.samplers.RandomSampler(seed=0))
    for c in configs:
        study.enqueue_trial(c)
    rows = []

    def objective(trial: optuna.Trial) -> float:
        params = {
            "rank": trial.suggest_categorical("rank", [8, 16, 32, 64, 128]),
            "alpha_multiplier": trial.suggest_categorical("alpha_multiplier", [0.25, 1, 4]),
            "learning_rate": trial.suggest_categorical("learning_rate", [2.0e-5, 1.0e-4, 2.0e-4, 4.0e-4]),
            "batch_size": trial.suggest_categorical("batch_size", [2, 8]),
        }
        row = peft_trial(params, setup)
        rows.append(row)
        ended.append(time.time())
        print(f"[sequential] {params} value={row['value']:.4f} total {row['total_s']:.1f}s", flush=True)
        return row["value"]

    def stop(*_) -> None:
        raise OutOfBudget

    start = end = time.time()
    errors, ended = [], []
    previous = signal.signal(signal.SIGALRM, stop)
    signal.setitimer(signal.ITIMER_REAL, max(deadline_s, 0.001))
    try:
        study.optimize(objective, n_trials=len(configs))
        end = time.time()
    except OutOfBudget:
        errors.append(out_of_budget_note(time.time() - start))
        end = ended[-1] if ended else start  # the trials that ended
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    print(f"[sequential] {len(rows)} of {len(configs)} configs: {end - start:.1f}s, errors: {errors}", flush=True)
    return {
        "measured": {"trials": rows, "wall_s": end - start, "configs": len(rows)},
        "errors": errors,
        "gpu_util_mean": sampler.mean_util(start, end),
    }


def colocated_worker(args) -> None:
    """One co-located trial process: runs its configs one after another, writes their rows."""
    spec = json.loads(Path(args.worker_spec).read_text())
    rows = []
    for params in spec["configs"]:
        try:
            rows.append(peft_trial(params, spec["setup"]))
        except Exception as exc:
            rows.append({"params": params, "error": f"{type(exc).__name__}: {str(exc)[:400]}"})
    Path(spec["out"]).write_text(json.dumps({"rows": rows, "end": time.time()}))


def run_colocated(configs: list[dict], k: int, setup: dict, sampler: GpuSampler, work: Path, deadline_s: float) -> dict:
    """K processes at once, configs dealt round-robin; makespan = launch to the last exit. Processes
    still running after ``deadline_s`` are killed: a wave cut short measures nothing."""
    procs = []
    start = time.time()
    for i in range(k):
        spec = {"configs": configs[i::k], "setup": setup, "out": str(work / f"coloc-{i}.json")}
        (work / f"coloc-spec-{i}.json").write_text(json.dumps(spec))
        log = open(work / f"coloc-{i}.log", "w")  # noqa: SIM115 - closed below
        cmd = [sys.executable, str(Path(__file__).resolve()), "--colocated-worker", str(work / f"coloc-spec-{i}.json")]
        procs.append((subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT), log))
    rows, errors = [], []
    try:
        for p, _ in procs:
            p.wait(timeout=max(start + deadline_s - time.time(), 0.001))
        finished = range(k)
    except subprocess.TimeoutExpired:
        for p, _ in procs:
            p.kill()
            p.wait()
        errors.append(out_of_budget_note(time.time() - start))
        finished = range(0)  # a wave cut short: no process's rows
    for _, log in procs:
        log.close()
    end = time.time()
    for i in finished:
        path = work / f"coloc-{i}.json"
        if path.exists():
            rows += json.loads(path.read_text())["rows"]
        else:
            errors.append(f"process {i}: {(work / f'coloc-{i}.log').read_text()[-600:]}")
    errors += [r["error"] for r in rows if "error" in r]
    print(f"[colocated] K={k} {len(configs)} configs: {end - start:.1f}s, errors: {errors}", flush=True)
    return {
        "K": k,
        "measured": {"trials": rows, "wall_s": end - start, "configs": len(configs)},
        "errors": errors,
        "gpu_util_mean": sampler.mean_util(start, end),
        "gpu_peak_used_gib": sampler.peak_gib(start, end),
    }


def sweep_key(result: dict) -> tuple[str, list[str]]:
    """A result's workload and sweep file without the model's folder (each call saves the seeded
    model in a temporary folder of its own)."""
    return result["workload"], [line for line in result["sweep_file"].splitlines() if not line.startswith("model:")]


def spread(trials: list[dict], n: int) -> list[dict]:
    """``n`` of the sweep's configs spread over (batch size, rank), so their mean time is representative
    (one: the middle config, neither the cheapest nor the dearest)."""
    done = sorted(
        (t for t in trials if t["state"] == "COMPLETE"),
        key=lambda t: (t["params"]["batch_size"], t["params"]["rank"], t["number"]),
    )
    if n >= len(done):
        return [t["params"] for t in done]
    if n == 1:
        return [done[(len(done) - 1) // 2]["params"]]
    idx = [round(i * (len(done) - 1) / (n - 1)) for i in range(n)]
    return [done[i]["params"] for i in idx]


# --- report -------------------------------------------------------------------------------------
def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sweep = result["sweep"]
    start, events = sweep["start"], sweep.get("events", [])
    fig, (ax, ax2) = plt.subplots(2, 1, figsize=(13, 6), sharex=True, gridspec_kw={"height_ratios": [3, 1]})
    own_row = " (finishing threads)"

    def row(e: dict) -> str:  # the phases of the threads recording finished trials get rows of their own
        return e["phase"] + (own_row if is_finishing(e["thread"]) else "")

    rows = {row(e) for e in events}
    names = [p for p in [*PHASES, "checkpoint-write", "checkpoint-delete", "leave", "progress"] if p in rows]
    names += [p + own_row for p in PHASES if p + own_row in rows]
    for i, name in enumerate(names):
        spans = [(e["start"] - start, e["end"] - e["start"]) for e in events if row(e) == name]
        ax.broken_barh(spans, (i - 0.4, 0.8), color=COLORS.get(name.removesuffix(own_row), "k"))
    first = min((e["start"] for e in events), default=start) - start
    ax.broken_barh([(0, first)], (len(names) - 0.4, 0.8), color=COLORS["startup"])
    ax.set_yticks(range(len(names) + 1), [*names, "startup"])
    for t in sweep.get("trials", []):
        if t.get("completed_at_s") is not None:
            ax.axvline(t["completed_at_s"], color="k", alpha=0.15, lw=0.8)
    ax.set_title(f"plora-hpo sweep timeline ({result['workload']}); thin lines: trials completed")
    samples = result.get("gpu_samples") or []
    if samples:
        ax2.plot([s[0] - start for s in samples], [s[1] for s in samples], lw=0.8)
    ax2.set_ylabel("GPU util %")
    ax2.set_xlabel("seconds since the sweep command started")
    ax2.set_xlim(0, sweep["ran_s"])
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def summarize(result: dict, n_configs: int) -> dict:
    sweep = result["sweep"]
    out: dict = {"sweep_makespan_s": sweep.get("wall_s")}
    trials = {json.dumps(t["params"], sort_keys=True): t for t in sweep.get("trials", [])}
    for kind in ("sequential", "colocated"):
        b = result.get(kind)
        if not b or not b["measured"]["trials"]:
            out[f"{kind}_vs_sweep"] = None
            continue
        ok = [r for r in b["measured"]["trials"] if "error" not in r]
        measured_wall = b["measured"]["wall_s"]
        if kind == "sequential":
            per = measured_wall / len(ok) if ok else math.nan
            extrapolated = per * n_configs
            how = f"measured {len(ok)} configs back to back ({measured_wall:.1f}s); x {n_configs}/{len(ok)}"
        else:
            waves = math.ceil(n_configs / b["K"])
            measured_waves = math.ceil(b["measured"]["configs"] / b["K"])
            extrapolated = measured_wall / measured_waves * waves
            how = f"measured {measured_waves} wave(s) of K={b['K']} ({measured_wall:.1f}s); x {waves} waves"
        b["extrapolated"] = {"makespan_s": extrapolated, "configs": n_configs, "how": how}
        out[f"{kind}_makespan_s_extrapolated"] = extrapolated
        out[f"{kind}_vs_sweep"] = extrapolated / sweep["wall_s"] if sweep.get("wall_s") else None
        pairs = []
        for r in ok:
            t = trials.get(json.dumps(r["params"], sort_keys=True))
            if t is not None and t["value"] is not None:
                pairs.append(
                    {"params": r["params"], "sweep": t["value"], kind: r["value"],
                     "sweep_loss": t.get("final_train_loss"), f"{kind}_loss": r.get("final_train_loss")}
                )  # fmt: skip
        b["per_trial"] = pairs
        if pairs:
            out[f"{kind}_value_abs_diff_max"] = max(abs(p["sweep"] - p[kind]) for p in pairs)
            out[f"{kind}_nonfinite_loss"] = nonfinite_losses(pairs, kind)
    tl = sweep.get("timeline", {})
    frac = tl.get("fraction", {})
    out["gpu_util_mean_sweep"] = sweep.get("gpu_util_mean")
    out["gpu_util_mean_training_steps"] = sweep.get("gpu_util_mean_training_steps")
    out["gpu_used_gib_before_sweep"] = sweep.get("gpu_used_gib_before")
    out["gpu_idle_s_by_phase"] = dict(list((tl.get("gpu_idle_s_by_phase") or {}).items())[:8])
    out["timeline_train_fraction"] = frac.get("train")
    out["timeline_eval_fraction"] = frac.get("evaluate")
    out["step_seconds_median"] = tl.get("step_seconds_median")
    out["sweep_over_engine"] = (result.get("engine_only") or {}).get("sweep_over_engine")
    again = result.get("sweep_again")
    if again:
        out["sweep_again_makespan_s"] = again.get("wall_s")
        out["gpu_util_mean_sweep_again"] = again.get("gpu_util_mean")
    return out


def nonfinite_losses(pairs: list[dict], kind: str) -> list[dict]:
    """The configs whose final training loss is not finite on either side, and which: a value scored
    from a diverged adapter says nothing about agreement."""
    out = []
    for p in pairs:
        sides = [side for side, key in (("sweep", "sweep_loss"), (kind, f"{kind}_loss"))
                 if p.get(key) is not None and not math.isfinite(p[key])]  # fmt: skip
        if sides:
            out.append({"params": p["params"], "sides": sides})
    return out


def print_table(result: dict) -> None:
    s = result["summary"]
    sweep = result["sweep"]
    print("\n=== sweep_e2e", result["workload"], "===")
    print(f"{'what':34s} {'makespan s':>11s} {'vs sweep':>9s}  note")
    ran = "" if sweep["returncode"] == 0 else f" after {sweep['ran_s']:.0f}s"
    earlier = result.get("sweep_from")
    label = f"plora-hpo sweep ({earlier['file']})" if earlier else "plora-hpo sweep (measured)"
    print(f"{label:34s} {s['sweep_makespan_s'] or float('nan'):11.1f} {1.0:9.2f}  "
          f"rc={sweep['returncode']}{ran}, GPU util {s.get('gpu_util_mean_sweep') or float('nan'):.2f} "
          f"({s.get('gpu_util_mean_training_steps') or float('nan'):.2f} in training steps); GPU memory in use "
          f"before it {s.get('gpu_used_gib_before_sweep') or float('nan'):.2f} GiB")  # fmt: skip
    for kind in ("sequential", "colocated"):
        b = result.get(kind)
        if not b:
            print(f"{kind:34s} {'-':>11s} {'-':>9s}  not run")
            continue
        e = b.get("extrapolated", {})
        label = f"{kind} (extrapolated)" if b["measured"]["configs"] < e.get("configs", 0) else f"{kind} (measured)"
        ratio = s.get(f"{kind}_vs_sweep")
        how = "; ".join([e.get("how", ""), *b.get("errors", [])[:1]]).strip("; ")
        print(f"{label:34s} {e.get('makespan_s', float('nan')):11.1f} {ratio or float('nan'):9.2f}  {how}")
        if b.get("per_trial"):
            diverged = "".join(f"; final loss not finite ({', '.join(d['sides'])}): {d['params']}"
                               for d in s.get(f"{kind}_nonfinite_loss", []))  # fmt: skip
            print(f"{'':34s} values within {s[f'{kind}_value_abs_diff_max']:.3f} of the sweep's over "
                  f"{len(b['per_trial'])} configs{diverged}")  # fmt: skip
    engine = result.get("engine_only")
    if engine:
        how = (f"{engine['pack_id']}, {engine['configs']} configs: sweep {engine['sweep_step_s'] or math.nan:.4f} s, "
               f"engine {engine.get('engine_step_s', math.nan):.4f} s")  # fmt: skip
        print(f"sweep step / engine step: {s['sweep_over_engine'] or math.nan:.2f} (goal <= 1.10)  {how}"
              f"{'; ' + engine['error'] if 'error' in engine else ''}")  # fmt: skip
        gaps = engine.get("kernel_gaps") or {}
        if "gpu_busy_share" in gaps:
            causes = ", ".join(f"{k} {v['ms']:.0f} ms" for k, v in list(gaps["gap_ms_by_host_op"].items())[:4])
            print(f"engine under the profiler: GPU busy {gaps['gpu_busy_share']:.3f} of {gaps['span_ms']:.0f} ms; "
                  f"gaps {gaps['gap_ms']:.0f} ms: {causes}")  # fmt: skip
    tl = sweep.get("timeline", {})
    if "seconds" in tl:
        print("timeline (s):", ", ".join(f"{k} {v:.1f}" for k, v in tl["seconds"].items()))
        print("of the startup (s):", ", ".join(f"{k} {v:.1f}" for k, v in tl.get("startup_phases", {}).items()))
        print("of the shutdown (s):", ", ".join(f"{k} {v:.1f}" for k, v in tl.get("shutdown_phases", {}).items()))
        idle = tl.get("gpu_idle_s_by_phase") or {}
        print(f"GPU idle (s, {sum(idle.values()):.1f} in all):", ", ".join(f"{k} {v:.1f}" for k, v in idle.items()))
        mid = [c for c in tl.get("triton_compiles", []) if c["train_step"] is not None]
        where = "".join(f"; {c['kernel']} {c['seconds']:.2f} s at step {c['train_step']}" for c in mid[:6])
        print(f"Triton compiles inside training steps: {len(mid)}{where}")
        slow = [f"{x['train_step']} ({x['seconds']:.2f} s, compiled {len(x['compiled'])}, "
                f"allocator retries {x['alloc_retries']}, {x.get('padded_tokens')} tokens"
                f"{' (most yet)' if x.get('most_tokens_yet') else ''}, collecting {x.get('gc_s', 0):.2f} s, "
                f"live curves {x.get('mlflow_live_s', 0):.2f} s, heartbeats {x.get('heartbeat_s', 0):.2f} s)"
                for x in tl.get("slow_steps", [])[:8]]  # fmt: skip
        print("steps over twice the median:", "; ".join(slow) or "none")
        exits = [f"pid {x['pid']} {x['before_end_s']:.2f} s before the end"
                 f"{', teardown waiting for ' + ', '.join(x['waits_for']) if x['teardown'] else ''}"
                 for x in tl.get("exits", [])]  # fmt: skip
        print("process exits:", "; ".join(exits) or "not recorded")
        tail = tl.get("tail") or {}
        if tail:
            ends = []
            for who, t in tail["threads"].items():
                phases = ", ".join(f"{k} {v:.1f}" for k, v in list(t["phases_s"].items())[:4])
                ends.append(f"{who} ends {t['ends_s']:.1f} ({phases})")
            print(f"after the last step (s, {tail['after_last_step_s']:.1f} to the end):", "; ".join(ends))
    again = result.get("sweep_again")
    if again:
        seconds = (again.get("timeline") or {}).get("seconds", {})
        parts = ", ".join(f"{k} {seconds[k]:.1f}" for k in ("startup", "compile", "train", "evaluate") if k in seconds)
        print(f"the same sweep again (warm caches): rc={again['returncode']}, {again.get('wall_s') or math.nan:.1f} s, "
              f"GPU util {s.get('gpu_util_mean_sweep_again') or math.nan:.2f}; {parts}")  # fmt: skip
    planner = result.get("planner")
    if planner:
        plan = planner["predicted"]
        predicted = (f"{plan['makespan_s']:.1f} s (rows of {plan['seq_len']} tokens)" if "makespan_s" in plan
                     else f"none ({plan['error']})")  # fmt: skip
        ran = ", ".join(f"{k} {v:.1f} s" for k, v in planner.get("ran", {}).items() if v is not None) or "-"
        print(f"planner: predicted makespan {predicted}; packs ran {ran}")
    if result.get("tests"):
        print("pytest -m gpu:", result["tests"].get("summary"))


GPU_TEST_DIRS = ("tests/gpu", "tests/engine")  # the sweep's CUDA path; the engine's device-specific cases


def run_tests(timeout_s: float, data_dir: Path) -> dict:
    """``pytest -m gpu`` on the benchmark's task data (without it the tests that read MRPC skip)."""
    start = time.time()
    env = {**os.environ, "PLORA_HPO_TEST_DATA": str(data_dir.resolve())}
    cmd = [sys.executable, "-m", "pytest", "-m", "gpu", *GPU_TEST_DIRS, "-v", "-p", "no:cacheprovider", "--tb=short"]
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout_s)
        out, rc = proc.stdout + proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as exc:
        raw = exc.stdout or b""
        out, rc = raw.decode(errors="replace") if isinstance(raw, bytes) else raw, "timeout"
    lines = [ln for ln in out.splitlines() if ln.strip()]
    outcomes = {}
    for ln in lines:  # -v: "tests/gpu/test_x.py::test_y PASSED [ 25%]"
        for word in ("PASSED", "FAILED", "SKIPPED", "ERROR"):
            if "::" in ln and f" {word}" in ln:
                outcomes[ln.split(" ")[0].split("::")[-1]] = word
    summary = lines[-1] if lines and rc != "timeout" else f"timed out after {timeout_s:.0f}s: {outcomes}"
    return {"command": f"python -m pytest -m gpu {' '.join(GPU_TEST_DIRS)} -v", "returncode": rc,
            "seconds": time.time() - start, "outcomes": outcomes, "summary": summary, "tail": out[-3000:]}  # fmt: skip


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--smoke", action="store_true", help="tiny random model, few steps and configs (CPU)")
    p.add_argument("--data-dir", type=Path, default=ROOT.parent / "shared" / "data")
    p.add_argument("--tokenizer", type=Path, default=ROOT / ".whl" / "tokenizer")
    p.add_argument("--shape", default="qwen2.5-1.5b")
    p.add_argument("--task", default="mrpc")
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--configs", type=int, default=32)
    p.add_argument("--pack-size", type=int, default=32)
    p.add_argument("--eval-limit", type=int, default=None, help="eval documents per adapter (default: all)")
    p.add_argument("--eval-batch-size", type=int, default=64, help="HFLM's batch size (rows of one adapter)")
    p.add_argument(
        "--sweep-eval-rows",
        type=int,
        default=None,
        help="the sweep's evaluation.batch_size, rows shared by all adapters (default: HFLM's batch × adapters)",
    )
    p.add_argument(
        "--engine-steps", type=int, default=20, help="timed steps of the sweep's biggest pack alone (0: skip)"
    )
    p.add_argument("--sequential", type=int, default=3, help="configs the sequential baseline measures (0: skip)")
    p.add_argument("--colocated-k", type=int, default=8, help="co-located processes (0: skip)")
    p.add_argument("--colocated-configs", type=int, default=8, help="configs the co-located baseline measures")
    p.add_argument(
        "--workers",
        choices=["threads", "processes"],
        default=None,
        help="the sweep's --workers (default: the sweep's own choice for the device count)",
    )
    p.add_argument(
        "--again",
        action="store_true",
        help="run the same sweep a second time in a fresh run directory, as a user's next sweep on this "
        "machine finds it (Triton's compiled kernels, bytecode and files cached): key sweep_again",
    )
    p.add_argument(
        "--bytecode",
        choices=["write", "as-is"],
        default="write",
        help="write: compile installed modules' missing bytecode first, as pip install does (key bytecode); "
        "as-is: measure the environment as found",
    )
    p.add_argument("--tests", action="store_true", help="also run pytest -m gpu first and record its result")
    p.add_argument("--tests-timeout-s", type=float, default=240.0)
    p.add_argument(
        "--budget-s",
        type=float,
        default=560.0,
        help="the call's seconds: later stages are skipped past them, and a baseline still running at them is stopped",
    )
    p.add_argument("--sweep-timeout-s", type=float, default=400.0)
    p.add_argument(
        "--sweep-from",
        type=Path,
        default=None,
        help="an earlier call's results JSON on the same machine: its sweep (record, planner forecast) stands in "
        "for running one, and only the baselines run (for a baseline that does not fit in the sweep's call)",
    )
    p.add_argument("--out", type=Path, default=None)
    p.add_argument(
        "--name", default=None, help="results file stem (default: sweep-e2e-<task>-<gpu> such as -h200, or -smoke)"
    )
    p.add_argument("--colocated-worker", default=None, dest="worker_spec", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.smoke:
        args.steps, args.configs, args.pack_size = min(args.steps, 4), min(args.configs, 4), min(args.pack_size, 4)
        args.eval_limit = args.eval_limit or 8
        args.engine_steps = min(args.engine_steps, 5)
        args.sequential, args.colocated_k, args.colocated_configs = min(args.sequential, 1), min(args.colocated_k, 2), 2
    if args.out is None:
        args.out = Path(os.environ.get("OUT") or ".")
    return args


def allocator_record() -> dict:
    """torch's CUDA allocator settings: the sweep's (the ``plora-hpo`` program's default unless this
    environment sets one) and the baselines' (this environment's; empty: torch's default)."""
    from plora_hpo.allocator import allocator_settings, use_default_allocator

    sweep_env = dict(os.environ)
    use_default_allocator(sweep_env)
    return {"sweep": allocator_settings(sweep_env), "baselines": allocator_settings(os.environ)}


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.worker_spec:
        colocated_worker(args)
        return
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    args.out.mkdir(parents=True, exist_ok=True)
    began = time.time()
    info = device_info()
    device = "cpu" if args.smoke else info["device"]
    work = Path(tempfile.mkdtemp(prefix="plora-e2e-"))
    result = {
        **info,
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "versions": versions(),
        "command": "python3 benchmarks/sweep_e2e.py " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:])),
        "smoke": args.smoke,
        "allocator": allocator_record(),
        "workload": f"{args.task}, {args.configs} paper120 configs x {args.steps} steps, "
        f"{'tiny' if args.smoke else args.shape} random weights, pack {args.pack_size}",
    }
    model_dir = work / "model"
    # lm-eval's batch size counts one model's rows; the sweep's counts rows shared by every adapter
    # scored together, so the same rows per adapter per forward is the baselines' batch × adapters
    sweep_eval_rows = args.sweep_eval_rows or args.eval_batch_size * min(args.configs, args.pack_size)
    result["eval_rows_per_forward"] = {"sweep": sweep_eval_rows, "HFLM, one adapter": args.eval_batch_size}
    ev = {"batch_size": sweep_eval_rows, **({"limit": args.eval_limit} if args.eval_limit else {})}
    sweep_file = write_sweep_file(
        work / "sweep.yaml", model_dir, args.task, args.steps, args.configs, args.pack_size, ev
    )
    result["sweep_file"] = sweep_file.read_text()
    earlier = json.loads(args.sweep_from.read_text()) if args.sweep_from else None
    if earlier and sweep_key(earlier) != sweep_key(result):
        raise SystemExit(f"error: {args.sweep_from} ran another workload or sweep file; pass that call's options")
    if args.bytecode == "write":
        result["bytecode"] = write_bytecode()
        print(f"[bytecode] written in {result['bytecode']['seconds']:.0f}s; before: {result['bytecode']['before']}")
    else:
        result["bytecode"] = {"before": {m: has_bytecode(m) for m in BYTECODE_PROBES}, "written": False}
    result["model"] = make_model_dir(args.shape, args.tokenizer, model_dir, device, args.smoke)
    print(f"[model] saved {result['model']['shape']} in {result['model']['seconds']:.1f}s", flush=True)
    from plora_hpo.config import load_sweep

    config = load_sweep(sweep_file)
    setup = {
        "model_dir": str(model_dir),
        "task": args.task,
        "seq_len": config.seq_len,
        "data_dir": str(args.data_dir),
        "targets": list(config.target_modules),
        "steps": args.steps,
        "eval_limit": args.eval_limit,
        "eval_batch_size": args.eval_batch_size,
        "device": device,
        "seed": config.seed,
    }
    name = args.name or ("sweep-e2e-smoke" if args.smoke else f"sweep-e2e-{args.task}-{gpu_tag(info)}")
    skipped = result.setdefault("skipped", [])

    def left() -> float:
        return args.budget_s - (time.time() - began)

    def save() -> None:  # after every stage: a call cut short still returns what it measured
        if "planner" in result:
            result["planner"]["ran"] = {
                k: result[k].get("packs_makespan_s") for k in ("sweep", "sweep_again") if k in result
            }
        result["gpu_samples"] = [(round(t, 2), u, round(m, 2)) for t, u, m in sampler.samples]
        result["summary"] = summarize(result, args.configs)
        result["elapsed_s"] = time.time() - began
        if result["sweep"].get("events") and "sweep_from" not in result:  # its plot is that call's
            plot(result, args.out / f"{name}.png")
        (args.out / f"{name}.json").write_text(json.dumps(result, indent=1, default=str) + "\n")

    with GpuSampler() as sampler:
        if device == "cpu":
            os.environ["CUDA_VISIBLE_DEVICES"] = ""
        if earlier:  # the same seeded model and sweep file as that call's: its trials are this call's configs
            result["sweep_from"] = {"file": args.sweep_from.name, "date": earlier["date"],
                                    "command": earlier["command"], "device": earlier["device"]}  # fmt: skip
            result["sweep"] = earlier["sweep"]
            result["allocator"]["sweep"] = earlier.get("allocator", {}).get("sweep")  # None: not recorded then
            if "planner" in earlier:
                result["planner"] = earlier["planner"]
        else:
            result["sweep"] = run_sweep(args, sweep_file, work / "runs", sampler, min(args.sweep_timeout_s, left()))
        save()
        trials = result["sweep"].get("trials", [])
        if not trials:
            rc = result["sweep"]["returncode"]
            skipped.append(f"the stages that compare with its trials: the sweep recorded none (rc={rc})")
        if trials and not earlier:  # with the calibration the sweep just recorded: a forecast for the next one
            result["planner"] = {
                "note": "predicted: plora-hpo plan's makespan for the sweep file on one device (training packs "
                "only), after the first sweep; ran: each sweep's pack record, first pack start to last pack end "
                "(its trials' scoring inside the packs included, start-up and closing not)",
                "predicted": planner_prediction(
                    sweep_file, 1, info, shape=args.shape, smoke=args.smoke, data_dir=args.data_dir
                ),
            }
            save()  # kept should a later stage run past the call's limit
        if args.again and trials:
            wall = result["sweep"]["wall_s"]
            if left() > wall + 30:
                again = run_sweep(
                    args, sweep_file, work / "runs-again", sampler, min(args.sweep_timeout_s, left()), "sweep-again"
                )
                again.pop("events", None)  # its phases are in sweep-again.timeline.jsonl
                result["sweep_again"] = again
                save()
            else:
                skipped.append(f"sweep_again: {left():.0f}s of the budget left, ~{wall:.0f}s needed")
        if args.engine_steps and trials:
            cost = engine_only_cost(result["sweep"].get("pack_segments") or [], args.engine_steps)
            if left() > cost:
                result["engine_only"] = run_engine_only(
                    result["sweep"], config, setup, args.engine_steps, sampler, work
                )
                save()
            else:
                skipped.append(f"engine_only: {left():.0f}s of the budget left, ~{cost:.0f}s needed")
        if args.sequential and trials:
            if left() > 50 * args.sequential:
                result["sequential"] = run_sequential(spread(trials, args.sequential), setup, sampler, left())
                save()
            else:
                skipped.append(f"sequential: {left():.0f}s of the budget left")
        if args.colocated_k and trials:
            if left() > 100:
                configs = spread(trials, args.colocated_configs)
                result["colocated"] = run_colocated(configs, args.colocated_k, setup, sampler, work, left())
                save()
            else:
                skipped.append(f"colocated: {left():.0f}s of the budget left")
        if args.tests:
            if left() > 60:
                result["tests"] = run_tests(min(args.tests_timeout_s, left() - 10), args.data_dir)
                print(f"[tests] {result['tests']['summary']} ({result['tests']['seconds']:.0f}s)", flush=True)
            else:
                skipped.append(f"tests: {left():.0f}s of the budget left")
    save()
    print_table(result)


if __name__ == "__main__":
    main()
