"""Multi-GPU execution check: degree-1 packs on every GPU at once.

Usage (a machine with ≥ 2 GPUs)::

    python benchmarks/multi_gpu.py --out $OUT/multi-gpu-h200x2.json

CPU check of the script itself (two workers on the host, a tiny random Qwen2 in fp32, about a
minute; writes ``$OUT/multi-gpu-smoke.json``, or into the temp folder when ``$OUT`` is unset)::

    python benchmarks/multi_gpu.py --smoke

Needs torch, transformers, numpy, safetensors, pyyaml and pydantic: the sweep settings are a real
:class:`plora_hpo.config.SweepConfig`. No lm-eval, MLflow, Optuna or ILP solver (admission is
arrival order). A GPU image with torch, transformers and triton but no pydantic needs the wheels
of ``pydantic``, ``pydantic-core``, ``annotated-types`` and ``typing-inspection`` (the versions of
the project's venv), e.g. ``pip install --no-deps --no-index --target /tmp/site wheels/*.whl`` and
``PYTHONPATH=/tmp/site``.

What runs is the sweep's own machinery, wired as :class:`plora_hpo.sweep.PackedSweep` wires it:
one :class:`~plora_hpo.worker.DeviceWorker` thread per device, each with its own
:class:`~plora_hpo.resources.DeviceResources` (a random-init base replica on that device, the
shared training data), all serving one :class:`~plora_hpo.trials.TrialPool`, with a
:class:`~plora_hpo.reporting.NullReporter`, FIFO admission and checkpoint stores in a temporary
folder (``train.checkpoint_every`` lies past every trial's steps, so none is written: this times
training, not saves). The same 2×K trials train twice, once untimed first: on one GPU, then on
all GPUs.

The workers are given a scorer and an exporter of this script's own, since neither lm-eval
scoring nor PEFT export is what this measures (and the GPU image has no lm-eval): scoring a
finished adapter returns NaN, and its export writes nothing. A trial's reported value is its
final training loss. The workers refit their cost model from each pack's warm steps as in a
sweep; each run gets a fresh calibration folder (``$PLORA_HPO_CACHE``), so both start from the
same prior and the machine's own calibration cache is left as it was.

Reported: wall time, tokens/s per run, scaling over one GPU, which device trained which trial,
and, for every pack composition that ran long enough to calibrate the cost model on, its
measured step time and peak memory next to the cost model's predictions. JSON records device,
date, versions and the command.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime as dt
import itertools
import json
import math
import os
import platform
import random
import shlex
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import _bootstrap  # noqa: F401  (makes plora_hpo importable from a bare checkout)
import torch
import transformers

from plora_hpo.adapter import AdapterConfig
from plora_hpo.admission import make_admission
from plora_hpo.checkpoints import CheckpointStore
from plora_hpo.config import SweepConfig, parse_sweep
from plora_hpo.models import ATTN_IMPLEMENTATION, LoadedModel, default_dtype, load_base_model, random_config
from plora_hpo.reporting import NullReporter, PackSegment
from plora_hpo.resources import DeviceResources, TaskData, device_spec
from plora_hpo.shapes import TARGET_MODULES, ModelShape
from plora_hpo.tasks import TrainExample
from plora_hpo.trials import PackProgress, TrialOutcome, TrialPool, TrialRequest, TrialTicket
from plora_hpo.worker import CALIBRATION_STEPS, DeviceWorker

RANKS = (8, 16, 32, 64, 128)
TASK = "synthetic"  # a task name the sweep file accepts; the examples are this script's random tokens
METRIC = "not_scored"  # what the scoring stand-in reports (NaN); the benchmark reads training losses
TINY = ModelShape("qwen2", 64, 160, 2, 4, 2, 512, True)  # --smoke: the throughput benchmark's tiny-a
RESULTS = Path(__file__).resolve().parent / "results"


@dataclasses.dataclass(frozen=True)
class PadOnlyTokenizer:
    """What training reads of a tokenizer (random-init bases have none; scoring is stood in for)."""

    pad_token_id: int = 0


def sweep_config(args: argparse.Namespace, model_name: str) -> SweepConfig:
    """The sweep file this benchmark would be: fixed steps, constant lr, FIFO packs, no pruning."""
    data = {
        "name": "multi-gpu-benchmark",
        "model": model_name,
        "tasks": [TASK],
        "target_modules": list(TARGET_MODULES),
        "seq_len": args.seq_len,
        "seed": 0,
        "budget": {"steps": args.steps},
        # what trials() draws from (the workers never sample; a sweep file needs a space)
        "space": {
            "rank": {"choices": list(RANKS)},
            "alpha_multiplier": {"choices": [2.0]},
            "learning_rate": {"choices": [1e-4]},
            "batch_size": {"choices": [1, 2]},
        },
        "sampler": "grid",
        "train": {"lr_schedule": "constant", "checkpoint_every": 10**9},  # never: this times training
        "pack": {"size": args.pack_size, "policy": "fifo", "gather_seconds": 1.0},
        "pruning": {"pruner": "none"},
    }
    return parse_sweep(data, Path("benchmarks/multi_gpu.py"))


def load_base(model: str, device: torch.device) -> LoadedModel:
    """A random-init base replica on ``device``: a named shape, or (``tiny``) a two-layer Qwen2."""
    dtype = default_dtype(device)  # bfloat16 on CUDA, float32 on the CPU
    if model == "tiny":
        with torch.random.fork_rng(devices=[]), torch.device(device):
            torch.manual_seed(0)
            net = transformers.AutoModelForCausalLM.from_config(
                random_config(TINY), dtype=dtype, attn_implementation=ATTN_IMPLEMENTATION
            )
        net.eval().requires_grad_(False)
        loaded = LoadedModel(net, None, "tiny", TINY, "random")
    else:
        loaded = load_base_model(f"random:{model}", dtype=dtype, device=device, seed=0)
    return dataclasses.replace(loaded, tokenizer=PadOnlyTokenizer())


def train_data(seq_len: int, vocab: int) -> dict[str, TaskData]:
    rng = random.Random(0)
    examples = []
    for _ in range(256):
        ids = tuple(rng.randrange(1, min(32_000, vocab)) for _ in range(seq_len))
        examples.append(TrainExample(ids, ids))
    return {TASK: TaskData(examples=examples, metric=METRIC)}


def no_scores(packed: object, adapter_ids: Sequence[str], task: str, limit: int | None) -> dict:
    """The workers' scorer here: no lm-eval (see the module doc); the benchmark reads training losses."""
    return {a: {METRIC: math.nan} for a in adapter_ids}


def no_export(packed: object, adapter_id: str, directory: Path) -> Callable[[], Path]:
    """The workers' exporter here: nothing is read or written (see the module doc)."""
    return lambda: directory


@contextlib.contextmanager
def calibration_cache(root: Path) -> Iterator[None]:
    """Calibrations kept under ``root`` (``$PLORA_HPO_CACHE``) for the duration, so every run
    starts from the same prior and the machine's own cache is left as it was."""
    saved = os.environ.get("PLORA_HPO_CACHE")
    os.environ["PLORA_HPO_CACHE"] = str(root)
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop("PLORA_HPO_CACHE", None)
        else:
            os.environ["PLORA_HPO_CACHE"] = saved


def trials(n: int) -> list[AdapterConfig]:
    return [AdapterConfig(RANKS[i % 5], 2.0 * RANKS[i % 5], 1e-4, 1 + i % 2, seed=i) for i in range(n)]


def synchronize(devices: list[torch.device]) -> None:
    for d in devices:
        if d.type == "cuda":
            torch.cuda.synchronize(d)


def observation(seg: PackSegment) -> dict:
    """A calibrated composition as the old host recorded it: measured vs predicted per step."""
    return {
        "device": seg.device,
        "adapters": len(seg.members),
        "step_seconds": seg.measured_step_seconds,
        "peak_gib": seg.measured_peak_gib,
        "predicted_step_seconds": seg.predicted_step_seconds,
        "predicted_peak_gib": seg.predicted_peak_gib,
    }


def run_tickets(pool: TrialPool, configs: list[AdapterConfig], first_number: int) -> list[TrialOutcome]:
    tickets = [TrialTicket(TrialRequest(TASK, first_number + i, c)) for i, c in enumerate(configs)]
    for t in tickets:
        pool.put(t)
    outcomes = [t.wait() for t in tickets]  # a trial that met an error raises it here
    failed = [o for o in outcomes if o.failed]
    if failed:
        raise RuntimeError(f"{len(failed)} trials failed, the first: {failed[0].fail_reason}")
    return outcomes


def run_on(devices: list[torch.device], args: argparse.Namespace) -> dict:
    names = [f"{d}" if devices.count(d) == 1 else f"{d}#{i}" for i, d in enumerate(devices)]
    bases = [load_base(args.model, d) for d in devices]
    config = sweep_config(args, bases[0].name)
    tasks = train_data(args.seq_len, bases[0].shape.vocab)
    pool, reporter = TrialPool(), NullReporter()
    pack_numbers, pack_lock = itertools.count(), threading.Lock()
    origin = time.monotonic()

    def pack_id(worker_name: str) -> str:
        with pack_lock:
            return f"pack-{next(pack_numbers)}@{worker_name}"

    with tempfile.TemporaryDirectory(prefix="plora-multi-gpu-") as tmp, calibration_cache(Path(tmp) / "cache"):
        workers = [
            DeviceWorker(
                DeviceResources(device=d, name=name, base=base, eval_tasks={TASK: {}}, tasks=tasks, gpu=device_spec(d)),
                config=config,
                pool=pool,
                admission=make_admission(config.pack.policy, solver=config.pack.solver),
                reporter=reporter,
                checkpoints=lambda task: CheckpointStore(Path(tmp) / "checkpoints" / task),
                adapter_root=Path(tmp) / "adapters",
                progress=PackProgress(),
                pack_id=pack_id,
                clock=lambda: time.monotonic() - origin,
                scorer=no_scores,
                exporter=no_export,
            )
            for d, name, base in zip(devices, names, bases)
        ]
        for w in workers:
            w.start()
        try:
            configs = trials(2 * args.pack_size)
            # the same trials once untimed: CUDA contexts, allocator pools and Triton autotuning of
            # these pack layouts on every device
            run_tickets(pool, configs, 1000)
            synchronize(devices)
            started = time.perf_counter()
            outcomes = run_tickets(pool, configs, 0)
            synchronize(devices)
            wall = time.perf_counter() - started
        finally:
            pool.close()
            for w in workers:
                w.join()
    segments = list(reporter.segments)
    pack_device = {s.pack_id: s.device for s in segments}
    tokens = sum(c.batch_size * args.seq_len * args.steps for c in configs)
    return {
        "devices": [str(d) for d in devices],
        "trials": len(configs),
        "wall_s": wall,
        "tokens_per_second": tokens / wall,
        "trial_devices": {o.request.number: pack_device[o.pack_id] for o in outcomes},
        "packs": sorted({o.pack_id for o in outcomes}),
        "final_losses": {o.request.number: o.losses[-1] for o in outcomes},
        "observations": [observation(s) for s in segments if s.steps >= CALIBRATION_STEPS + 1],
    }


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen2.5-1.5b", help="random-init shape")
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--pack-size", type=int, default=16)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--out", type=Path, help="JSON path (default: $OUT, else the temp folder)")
    parser.add_argument(
        "--smoke", action="store_true", help="CPU check of the script: two workers, tiny model, 2×4 trials"
    )
    args = parser.parse_args()
    if args.smoke:
        # the fewest steps after which a composition calibrates the cost model (and is reported)
        args.model, args.seq_len, args.pack_size, args.steps = "tiny", 32, 4, CALIBRATION_STEPS + 1
    if args.out is None:
        folder = Path(os.environ.get("OUT") or tempfile.gettempdir())
        args.out = folder / ("multi-gpu-smoke.json" if args.smoke else "multi-gpu.json")
    if args.smoke and args.out.resolve().is_relative_to(RESULTS):
        parser.error(f"--smoke writes no committed result; pass an --out outside {RESULTS}")
    return args


def main() -> None:
    args = parse_args()
    if args.smoke:  # the CPU check: two workers on the host
        n, devices = 2, [torch.device("cpu"), torch.device("cpu")]
    else:
        n = torch.cuda.device_count()
        devices = [torch.device("cuda", i) for i in range(n)]
        if not devices:
            sys.exit("multi_gpu.py: no CUDA device is visible; --smoke checks the script on the CPU")
    rows = [run_on(devices[:1], args)]
    if n > 1:
        rows.append(run_on(devices, args))
    one = rows[0]
    summary = {
        "gpus": n,
        "scaling": rows[-1]["tokens_per_second"] / one["tokens_per_second"] if n > 1 else None,
        "efficiency": rows[-1]["tokens_per_second"] / one["tokens_per_second"] / n if n > 1 else None,
        "same_losses": all(
            abs(rows[-1]["final_losses"][k] - v) <= 1e-2 * abs(v) for k, v in one["final_losses"].items()
        ),
    }
    result = {
        "benchmark": "multi_gpu",
        "gpu": torch.cuda.get_device_name(0) if not args.smoke else "cpu (smoke run)",
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "command": shlex.join(["python", *sys.argv]),
        "settings": {k: str(v) for k, v in vars(args).items()},
        "summary": summary,
        "runs": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"{'GPUs':>4} {'trials':>6} {'packs':>5} {'wall s':>7} {'tokens/s':>10}")
    for r in rows:
        print(
            f"{len(r['devices']):4d} {r['trials']:6d} {len(r['packs']):5d} {r['wall_s']:7.1f} "
            f"{r['tokens_per_second']:10.0f}"
        )
    print(f"scaling {summary['scaling']}, efficiency {summary['efficiency']}, same losses {summary['same_losses']}")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
