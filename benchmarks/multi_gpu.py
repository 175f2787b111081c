"""Multi-GPU execution check (issue 3, item 6): degree-1 packs on every GPU at once.

Usage (a machine with ≥ 2 GPUs; the GPU image needs only torch + transformers + triton)::

    python benchmarks/multi_gpu.py --out $OUT/multi-gpu-h200x2.json

The sweep's own :class:`plora_hpo.worker.DeviceWorker` threads (one per GPU, each with its own
base-model replica, fed from one shared queue) train the same 2×K trials twice: on one GPU,
then on all GPUs. A small host object stands in for ``PackedSweep``: it supplies random
qwen2.5-1.5b replicas and data, and replaces lm-eval scoring and MLflow logging by the final
training loss (neither is what this measures). Reported: wall time, tokens/s per run,
scaling over one GPU, which device trained which trial, and the cost model's calibration
observations of each pack. JSON records device, date, versions and the command.
"""

from __future__ import annotations

import argparse
import datetime as dt
import itertools
import json
import platform
import queue
import random
import shlex
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import _bootstrap  # noqa: F401  (makes plora_hpo.kernels importable from a bare checkout)
import torch
import transformers

from plora_hpo.adapter import AdapterConfig
from plora_hpo.engine import OptimizerSettings
from plora_hpo.models import load_base_model
from plora_hpo.planner import GpuSpec
from plora_hpo.trials import PackProgress, TrialOutcome, TrialRequest, TrialTicket
from plora_hpo.worker import DeviceWorker

RANKS = (8, 16, 32, 64, 128)


@dataclass(frozen=True)
class Example:
    input_ids: tuple[int, ...]
    labels: tuple[int, ...]


class _NoCheckpoints:
    def load(self, lineage: int) -> None:
        return None

    def save(self, *args: object) -> None: ...

    def delete(self, lineage: int) -> None: ...


class BenchHost:
    """What DeviceWorker needs from a sweep, without lm-eval, MLflow or Optuna."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.config = SimpleNamespace(
            pack=SimpleNamespace(size=args.pack_size, gather_seconds=1.0),
            seq_len=args.seq_len,
            target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
            train=SimpleNamespace(checkpoint_every=10**9),
            pruning=SimpleNamespace(pruner="none"),
        )
        self.inbox: queue.Queue[TrialTicket | None] = queue.Queue()
        self.progress = PackProgress()
        self.observations: list[dict] = []
        self._pack_ids = itertools.count()
        rng = random.Random(0)
        self.tasks = {
            "bench": SimpleNamespace(
                examples=[
                    Example(ids := tuple(rng.randrange(1, 32_000) for _ in range(args.seq_len)), ids)
                    for _ in range(256)
                ],
                metric="final_loss",
            )
        }

    def base_on(self, device: torch.device, replica: int) -> SimpleNamespace:
        loaded = load_base_model(f"random:{self.args.model}", dtype=torch.bfloat16, device=device, seed=0)
        return SimpleNamespace(
            model=loaded.model, tokenizer=SimpleNamespace(pad_token_id=0), shape=loaded.shape, name=loaded.name
        )

    def eval_tasks_for(self, replica: int) -> dict:
        return {}

    def device_spec(self, device: torch.device) -> GpuSpec:
        if device.type != "cuda":
            return GpuSpec.host()
        props = torch.cuda.get_device_properties(device)
        return GpuSpec(props.name, props.total_memory / 2**30)

    def next_pack_id(self, worker_name: str) -> str:
        return f"pack-{next(self._pack_ids)}@{worker_name}"

    def optimizer_settings(self) -> OptimizerSettings:
        return OptimizerSettings(lr_schedule="constant")

    def checkpoints(self, task: str) -> _NoCheckpoints:
        return _NoCheckpoints()

    def open_trial_run(self, request: TrialRequest, run_id: str | None, pack_id: str) -> str:
        return f"run-{request.number}"

    def total_steps(self, task: str, config: AdapterConfig) -> int:
        return self.args.steps

    def evaluate(self, worker: DeviceWorker, task: str, adapter_ids: list[str]) -> dict[str, dict[str, float]]:
        return {a: {} for a in adapter_ids}

    def completed_outcome(self, worker, slot, pack_id, metrics, stats) -> TrialOutcome:
        return TrialOutcome(
            request=slot.request,
            value=slot.curve[-1][1],
            metrics={"device": str(worker.device)},
            losses=[loss for _, loss, _ in slot.curve],
            run_id=slot.run_id,
            adapter_dir=None,
            pack_id=pack_id,
            tokens_per_second=stats.tokens_per_second,
        )

    def failed_outcome(self, slot, pack_id, reason, stats) -> TrialOutcome:
        raise RuntimeError(reason)

    def abandon(self, run_id: str) -> None: ...

    def calibrate(self, worker, configs, step_seconds, peak_bytes) -> None:
        self.observations.append(
            {
                "device": str(worker.device),
                "adapters": len(configs),
                "step_seconds": step_seconds,
                "peak_gib": None if peak_bytes is None else peak_bytes / 2**30,
                "predicted_step_seconds": worker.cost.step_seconds(configs),
                "predicted_peak_gib": worker.cost.peak_memory(configs) / 2**30,
            }
        )


def trials(n: int) -> list[AdapterConfig]:
    return [AdapterConfig(RANKS[i % 5], 2.0 * RANKS[i % 5], 1e-4, 1 + i % 2, seed=i) for i in range(n)]


def synchronize(devices: list[torch.device]) -> None:
    for d in devices:
        if d.type == "cuda":
            torch.cuda.synchronize(d)


def run_on(devices: list[torch.device], args: argparse.Namespace) -> dict:
    host = BenchHost(args)
    workers = [DeviceWorker(host, d, f"{d}", replica=i) for i, d in enumerate(devices)]
    for w in workers:
        w.start()
    configs = trials(2 * args.pack_size)
    # the same trials once untimed: CUDA contexts, allocator pools and Triton autotuning of
    # these pack layouts on every device
    warm = [TrialTicket(TrialRequest("bench", 1000 + i, c)) for i, c in enumerate(configs)]
    for t in warm:
        host.inbox.put(t)
    for t in warm:
        t.wait()
    synchronize(devices)
    started = time.perf_counter()
    tickets = [TrialTicket(TrialRequest("bench", i, c)) for i, c in enumerate(configs)]
    for t in tickets:
        host.inbox.put(t)
    outcomes = [t.wait() for t in tickets]
    synchronize(devices)
    wall = time.perf_counter() - started
    host.inbox.put(None)
    for w in workers:
        w.join()
    tokens = sum(c.batch_size * args.seq_len * args.steps for c in configs)
    return {
        "devices": [str(d) for d in devices],
        "trials": len(configs),
        "wall_s": wall,
        "tokens_per_second": tokens / wall,
        "trial_devices": {o.request.number: o.metrics["device"] for o in outcomes},
        "packs": sorted({o.pack_id for o in outcomes}),
        "final_losses": {o.request.number: o.value for o in outcomes},
        "observations": host.observations,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen2.5-1.5b", help="random-init shape")
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--pack-size", type=int, default=16)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    n = torch.cuda.device_count()
    devices = [torch.device("cuda", i) for i in range(n)]
    if not devices:  # a CPU smoke run of the script itself: two workers on the host
        n, devices = 2, [torch.device("cpu"), torch.device("cpu")]
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
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu (smoke run)",
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


if __name__ == "__main__":
    main()
