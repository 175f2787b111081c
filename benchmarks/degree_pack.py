"""One pack split over d GPUs by tensor parallelism against the same pack on one GPU: per-step
loss agreement, step time, memory per GPU, and the cost model's predictions for both.

The pack: K adapters (``--k``) of mixed ranks (8..128) and batch sizes (1, 2), each with its own
seed and learning rate, on every projection of a random-init base at a real shape
(``load_base_model("random:<shape>")``, bf16 on CUDA), trained ``--steps`` steps on fixed-length
sequences of a random Markov chain (learnable, so the losses move); the same base seed, adapters
and data in every run. Runs, each in processes of its own (``torch.multiprocessing``, spawn):

* ``degree 1``: one process, one GPU. It runs even where the cost model predicts that it does not
  fit; an out-of-memory error is recorded as such;
* ``degree d`` (``--degree``, default 2): d processes, one GPU each, grouped and split the way a
  sweep's worker group is: :func:`plora_hpo.pack_group.join_group` (NCCL on CUDA, gloo on the
  CPU), :func:`~plora_hpo.engine.tensor_parallel.shard_model` on the whole base, then
  ``PackedLoraModel`` and ``PackedTrainer`` (the sweep's default optimizer settings). Every rank
  makes the same engine calls itself, as ``tests/engine/test_tensor_parallel.py`` does (a sweep's
  followers receive them from the leader). With fewer visible GPUs than d the run is skipped and
  the JSON says why: NCCL takes one GPU per rank, and two ranks on one GPU measure nothing a
  degree-d pack does.

Per run: every adapter's per-step losses and their largest absolute and relative difference from
degree 1; the mean step time over the steps after ``--warmup`` (synchronised at both ends of that
window); peak memory per GPU (``torch.cuda.max_memory_allocated`` on each rank, from the built
pack on; null on the CPU); and the cost model's peak memory per GPU and step time for the pack at
that degree (:class:`~plora_hpo.planner.cost_model.CostModel` with the device's
:func:`~plora_hpo.resources.device_spec`): the analytic prior, and the prior calibrated on this
call's degree-1 measurement (:func:`~plora_hpo.planner.observations.fit_calibration`, as a sweep
refits from its packs: in-sample at degree 1, a prediction at degree d). Measured runs are also
listed as planner observations. The JSON (device, date, versions, the exact command) is rewritten
after every run; each run must end before its share of ``--budget-s`` or is stopped and recorded
as timed out. A short table is printed last.

Device, 2 GPUs (the GPU image has every package this needs)::

    python3 benchmarks/degree_pack.py

CPU smoke run (a tiny Qwen2 shape in fp32, degree 1 and two gloo processes, about a minute; on a
GPU machine too it runs on the CPU)::

    python benchmarks/degree_pack.py --smoke
"""

from __future__ import annotations

import argparse
import datetime as dt
import gc
import json
import os
import platform
import shlex
import socket
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _bootstrap  # noqa: F401  (plora_hpo importable from a bare checkout)
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from sweep_e2e import versions
from throughput import SMOKE_SHAPES, build_model, markov_examples, shape_of, sync

from plora_hpo.adapter import AdapterConfig
from plora_hpo.errors import first_line
from plora_hpo.shapes import MODEL_SHAPES, TARGET_MODULES, ModelShape

if TYPE_CHECKING:
    from plora_hpo.engine import PackedTrainer
    from plora_hpo.planner import Calibration, GpuSpec
    from plora_hpo.planner.observations import Observation

GIB = 2**30
RANKS = (8, 16, 32, 64, 128)
BATCH_SIZES = (1, 2)
EXAMPLES = 64  # Markov sequences every adapter draws its batches from (its own order)
SMOKE_SHAPE = "tiny-a"  # throughput.py's tiny Qwen2: 4 heads, 2 key-value heads, every degree ≤ 2 divides


@dataclass(frozen=True)
class RunPlan:
    """What every process of one run needs (spawned processes receive it pickled)."""

    shape: str
    degree: int
    devices: tuple[str, ...]  # one per rank
    dtype: str  # a torch dtype's name
    configs: tuple[AdapterConfig, ...]
    steps: int
    warmup: int
    seq: int
    seed: int
    threads: int  # CPU: intra-op threads of each rank
    port: int
    out_dir: str


# --- the pack -----------------------------------------------------------------------------------
def pack_configs(k: int) -> list[AdapterConfig]:
    """K adapters: ranks and batch sizes in turn, learning rates 1e-4..8e-4, a seed each."""
    return [
        AdapterConfig(
            rank=RANKS[i % len(RANKS)],
            alpha=2.0 * RANKS[i % len(RANKS)],
            learning_rate=1e-4 * 2 ** (i % 4),
            batch_size=BATCH_SIZES[i % len(BATCH_SIZES)],
            seed=1000 + i,
        )
        for i in range(k)
    ]


def adapter_id(index: int, config: AdapterConfig) -> str:
    return f"a{index}-r{config.rank}-b{config.batch_size}"


def build_base(shape: str, dtype: torch.dtype, device: torch.device, seed: int) -> torch.nn.Module:
    """The frozen random-init base: ``random:<shape>`` as the sweep loads it, or the smoke's tiny
    shape built the same way (it is no published shape)."""
    if shape in MODEL_SHAPES:
        from plora_hpo.models import load_base_model

        return load_base_model(f"random:{shape}", dtype=dtype, device=device, seed=seed).model
    return build_model(shape_of(shape), dtype, device, seed)


# --- one rank of a run (a spawned process) -------------------------------------------------------
def rank_main(rank: int, plan: RunPlan) -> None:
    """One process of a run: join the group, train the pack, write ``rank<r>.json``. An error is
    written there too and raised again, so the parent stops the other ranks at once."""
    from plora_hpo.pack_group import group_environment, join_group

    device = torch.device(plan.devices[rank])
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(plan.threads)
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    os.environ.update(group_environment(rank, plan.degree, plan.port))
    join_group(plan.degree, device)  # the sweep's group (None at degree 1); its channel goes unused
    path = Path(plan.out_dir) / f"rank{rank}.json"
    try:
        result = {"rank": rank, **train_pack(plan, device)}
    except Exception as err:
        oom = isinstance(err, torch.OutOfMemoryError)
        path.write_text(json.dumps({"rank": rank, "oom": oom, "error": f"{type(err).__name__}: {first_line(err)}"}))
        raise
    path.write_text(json.dumps(result))
    if dist.is_initialized():
        dist.destroy_process_group()


def train_pack(plan: RunPlan, device: torch.device) -> dict:
    """Build the base (split at degree > 1) and the pack, train it ``plan.steps`` steps: per-step
    losses, the steady steps' mean seconds and peak memory from the built pack on."""
    from plora_hpo.engine import AdapterJob, OptimizerSettings, PackedLoraModel, PackedTrainer
    from plora_hpo.engine.tensor_parallel import shard_model

    started = time.perf_counter()
    model = build_base(plan.shape, getattr(torch, plan.dtype), device, plan.seed)
    if plan.degree > 1:
        shard_model(model)
    packed = PackedLoraModel(model, TARGET_MODULES)
    trainer = PackedTrainer(packed, settings=OptimizerSettings(), pad_id=0, device=device)
    examples = markov_examples(EXAMPLES, plan.seq, shape_of(plan.shape).vocab, plan.seed)
    for i, config in enumerate(plan.configs):
        trainer.add_job(AdapterJob(adapter_id(i, config), config, examples, plan.steps))
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    setup_s = time.perf_counter() - started
    losses: dict[str, list[float]] = {a: [] for a in trainer.jobs}
    failed: dict[str, str] = {}
    warm_s = train_steps(trainer, plan.warmup, losses, failed)
    timed = plan.steps - plan.warmup
    step_s = train_steps(trainer, timed, losses, failed) / timed
    cuda = device.type == "cuda"
    return {
        "device": str(device),
        "setup_s": setup_s,
        "warmup_s": warm_s,
        "step_s": step_s,
        "host_step_s": trainer.stats.step_seconds,  # the trainer's own per-step seconds (unsynchronised)
        "peak_bytes": torch.cuda.max_memory_allocated(device) if cuda else None,
        "peak_reserved_bytes": torch.cuda.max_memory_reserved(device) if cuda else None,
        "losses": losses,
        "failed": failed,
    }


def train_steps(trainer: PackedTrainer, steps: int, losses: dict[str, list[float]], failed: dict[str, str]) -> float:
    """Run ``steps`` packed steps, appending each adapter's loss (an adapter whose loss or gradient
    turns non-finite leaves the pack, its reason in ``failed``); returns their seconds,
    synchronised with the device at both ends."""
    sync(trainer.device)
    started = time.perf_counter()
    for _ in range(steps):
        for report in trainer.step():
            losses[report.adapter_id].append(report.loss)
            if report.failed:
                failed[report.adapter_id] = report.fail_reason
    sync(trainer.device)
    return time.perf_counter() - started


# --- the parent: runs, agreement, predictions ----------------------------------------------------
def launch(plan: RunPlan, deadline: float) -> dict:
    """Start the run's processes, wait until they end or ``deadline`` (``time.monotonic``) passes,
    and gather what their ranks wrote."""
    started = time.monotonic()
    context = mp.start_processes(rank_main, args=(plan,), nprocs=plan.degree, join=False, start_method="spawn")
    status, reason = "ok", None
    try:
        while not context.join(timeout=1.0):
            if time.monotonic() > deadline:
                for process in context.processes:
                    process.kill()
                    process.join()
                status, reason = "timeout", f"stopped at its budget share, {deadline - started:.0f} s after its start"
                break
    except (mp.ProcessRaisedException, mp.ProcessExitedException) as err:  # the others were stopped
        status, reason = "error", first_line(err)
    files = [Path(plan.out_dir) / f"rank{r}.json" for r in range(plan.degree)]
    ranks = [json.loads(f.read_text()) for f in files if f.exists()]
    errors = [r for r in ranks if "error" in r]
    if errors:
        status = "oom" if any(r["oom"] for r in errors) else "error"
        reason = "; ".join(f"rank {r['rank']}: {r['error']}" for r in errors)
    run = {"status": status, "reason": reason, "wall_s": time.monotonic() - started}
    done = [r for r in ranks if "error" not in r]
    if status == "ok" and len(done) == plan.degree:
        run.update(summarise_ranks(done))
    return run


def summarise_ranks(ranks: list[dict]) -> dict:
    """One run's record from its ranks' results: rank 0's losses and step time, every rank's memory."""
    first = ranks[0]
    peaks = [r["peak_bytes"] for r in ranks]
    reserved = [r["peak_reserved_bytes"] for r in ranks]
    return {
        "setup_s": first["setup_s"],
        "warmup_s": first["warmup_s"],
        "step_s": first["step_s"],
        "step_s_per_rank": [r["step_s"] for r in ranks],
        "host_step_s": [round(s, 4) for s in first["host_step_s"]],
        "peak_gib_per_gpu": None if None in peaks else [p / GIB for p in peaks],
        "peak_reserved_gib_per_gpu": None if None in reserved else [p / GIB for p in reserved],
        "losses": first["losses"],
        "failed": first["failed"],
        "ranks_same_losses": all(r["losses"] == first["losses"] for r in ranks),
    }


def agreement(reference: dict[str, list[float]], other: dict[str, list[float]]) -> dict:
    """Per adapter and over the pack: the largest absolute and relative (÷ |reference|) difference
    of ``other``'s per-step losses from ``reference``'s, over the steps both have."""
    per_adapter = {}
    for adapter, want in reference.items():
        pairs = list(zip(want, other.get(adapter, [])))
        if not pairs:
            continue
        per_adapter[adapter] = {
            "steps": len(pairs),
            "max_abs_diff": max(abs(b - a) for a, b in pairs),
            "max_rel_diff": max(abs(b - a) / abs(a) for a, b in pairs),
        }
    worst = {key: max((v[key] for v in per_adapter.values()), default=None) for key in ("max_abs_diff", "max_rel_diff")}
    return {**worst, "adapters": len(per_adapter), "per_adapter": per_adapter}


def observation(plan: RunPlan, run: dict, dtype_bytes: int) -> Observation:
    """A measured run as the planner's calibration sees it (the largest rank's peak)."""
    from plora_hpo.planner.observations import Observation

    peaks = run["peak_gib_per_gpu"]
    return Observation(
        ranks=tuple(c.rank for c in plan.configs),
        batch_sizes=tuple(c.batch_size for c in plan.configs),
        seq_len=plan.seq,
        targets=TARGET_MODULES,
        step_seconds=run["step_s"],
        peak_bytes=max(peaks) * GIB if peaks else None,
        degree=plan.degree,
        dtype_bytes=dtype_bytes,
    )


def predict(
    shape: ModelShape,
    seq: int,
    dtype_bytes: int,
    configs: list[AdapterConfig],
    degree: int,
    gpu: GpuSpec,
    calibration: Calibration | None = None,
) -> dict:
    """The cost model's peak memory per GPU (GiB) and seconds per step of the pack at ``degree``."""
    try:
        from plora_hpo.planner.cost_model import CostModel, Workload

        model = CostModel(Workload(shape, seq, TARGET_MODULES, dtype_bytes), gpu, calibration)
        return {"peak_gib": model.peak_memory(configs, degree) / GIB, "step_s": model.step_seconds(configs, degree)}
    except Exception as err:  # the planner is another engineer's module: report, don't die
        return {"error": f"{type(err).__name__}: {first_line(err)}"}


def calibrate(
    observations: list[Observation], shape: ModelShape, gpu: GpuSpec
) -> tuple[Calibration | None, dict | None]:
    """The prior fitted to ``observations`` (this call's degree-1 run) and what to record of it
    (None, None without any)."""
    if not observations:
        return None, None
    try:
        from plora_hpo.planner.observations import fit_calibration

        calibration = fit_calibration(observations, shape, gpu)
        return calibration, calibration.to_dict()
    except Exception as err:  # the planner is another engineer's module: report, don't die
        return None, {"error": f"{type(err).__name__}: {first_line(err)}"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--smoke", action="store_true", help="tiny Qwen2 shape on the CPU in fp32, gloo, few steps")
    p.add_argument("--shape", default=None, help=f"one of {', '.join([*MODEL_SHAPES, *SMOKE_SHAPES])} (qwen2.5-7b)")
    p.add_argument("--degree", type=int, default=2, help="GPUs the split pack runs on")
    p.add_argument("--k", type=int, default=None, help="adapters in the pack (16; smoke 4)")
    p.add_argument("--steps", type=int, default=None, help="optimizer steps per run (20; smoke 6)")
    p.add_argument("--warmup", type=int, default=None, help="steps left out of the step time (3; smoke 2)")
    p.add_argument("--seq", type=int, default=None, help="tokens per sequence (512; smoke 32)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--budget-s", type=float, default=480.0, help="wall time all runs share")
    p.add_argument("--out", type=Path, default=None, help="JSON path (default $OUT/degree-pack-<tag>.json)")
    args = p.parse_args(argv)
    smoke = args.smoke
    args.shape = args.shape or (SMOKE_SHAPE if smoke else "qwen2.5-7b")
    args.k = args.k or (4 if smoke else 16)
    args.steps = args.steps or (6 if smoke else 20)
    args.warmup = (2 if smoke else 3) if args.warmup is None else args.warmup
    args.seq = args.seq or (32 if smoke else 512)
    if args.shape not in MODEL_SHAPES and args.shape not in SMOKE_SHAPES:
        p.error(f"unknown --shape {args.shape!r}")
    if not 0 <= args.warmup < args.steps:
        p.error("--warmup must be smaller than --steps")
    if args.degree < 2:
        p.error("--degree is the split pack's degree: 2 or more")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    from plora_hpo.cpu_threads import available_cores
    from plora_hpo.resources import device_spec

    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # no NVLink multicast: plain all-reduces are all this needs
    kind = "cpu" if args.smoke or not torch.cuda.is_available() else "cuda"
    gpus = torch.cuda.device_count() if kind == "cuda" else 0
    gpu = device_spec(torch.device("cuda:0" if kind == "cuda" else "cpu"))
    cores = available_cores()
    tag = "smoke" if args.smoke else f"{args.shape}-{kind}x{gpus}"
    path = args.out or Path(os.environ.get("OUT") or tempfile.gettempdir()) / f"degree-pack-{tag}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    result = header(args, argv, kind, gpus, gpu, cores)
    plans = make_plans(args, kind, gpus, cores, Path(tempfile.mkdtemp(prefix="degree-pack-")), result)
    started = time.monotonic()
    for i, (name, plan) in enumerate(plans.items()):
        print(f"[{name}] {args.shape} K {args.k} on {', '.join(plan.devices)} ...", flush=True)
        deadline = started + args.budget_s * (i + 1) / len(plans)  # what a run leaves unused goes to the next
        run = {"devices": list(plan.devices), **launch(plan, deadline)}
        result["runs"][name] = run
        print(f"[{name}] {run['status']} in {run['wall_s']:.0f} s {run['reason'] or ''}", flush=True)
        save(result, path)
    add_predictions(result, plans, args, gpu)
    save(result, path)
    print_table(result)
    print(f"json: {path}")


def header(args: argparse.Namespace, argv: list[str] | None, kind: str, gpus: int, gpu: GpuSpec, cores: int) -> dict:
    """The JSON's description of the call: device, date, versions, command, settings, the pack."""
    configs = pack_configs(args.k)
    command = ["python", *sys.argv] if argv is None else ["python", "benchmarks/degree_pack.py", *argv]
    notes = []
    if kind == "cpu":
        notes.append(f"CPU run: peak memory is not measured (null); times are CPU times, {cores} free cores per run")
    return {
        "benchmark": "degree_pack",
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "command": shlex.join(command),
        "device": kind,
        "gpu": gpu.name if kind == "cuda" else None,
        "gpu_memory_gib": gpu.memory_gib if kind == "cuda" else None,
        "gpus_visible": gpus,
        "host": {"cpu": platform.processor() or platform.machine(), "cores_free": cores},
        "versions": versions(),
        "smoke": args.smoke,
        "settings": {
            "shape": args.shape,
            "shape_dims": asdict(shape_of(args.shape)),
            "k": args.k,
            "steps": args.steps,
            "warmup": args.warmup,
            "seq": args.seq,
            "seed": args.seed,
            "dtype": dtype_name(kind),
            "backend": "nccl" if kind == "cuda" else "gloo",
            "degree": args.degree,
            "budget_s": args.budget_s,
            "data": f"{EXAMPLES} Markov sequences of {args.seq} tokens (every position trained)",
            "optimizer": "the sweep's defaults: AdamW, linear schedule over the steps, clip 1.0",
        },
        "pack": {
            "ids": [adapter_id(i, c) for i, c in enumerate(configs)],
            "configs": [asdict(c) for c in configs],
            "tokens_per_step": sum(c.batch_size for c in configs) * args.seq,
        },
        "runs": {},
        "notes": notes,
    }


def dtype_name(kind: str) -> str:
    """The base's dtype: bf16 on CUDA (what the kernels are tuned for), fp32 on the CPU."""
    return "bfloat16" if kind == "cuda" else "float32"


def make_plans(
    args: argparse.Namespace, kind: str, gpus: int, cores: int, work: Path, result: dict
) -> dict[str, RunPlan]:
    """The runs this machine can make, by name, each with a folder under ``work`` for its ranks'
    results; a degree it lacks the GPUs for is recorded in ``result`` as skipped."""
    plans = {}
    for degree in (1, args.degree):
        name = f"degree{degree}"
        if kind == "cuda" and degree > gpus:
            reason = f"needs {degree} GPUs, {gpus} visible (NCCL takes one GPU per rank)"
            result["runs"][name] = {"status": "skipped", "reason": reason}
            continue
        (work / name).mkdir(parents=True)
        plans[name] = RunPlan(
            shape=args.shape,
            degree=degree,
            devices=tuple(f"cuda:{i}" for i in range(degree)) if kind == "cuda" else ("cpu",) * degree,
            dtype=dtype_name(kind),
            configs=tuple(pack_configs(args.k)),
            steps=args.steps,
            warmup=args.warmup,
            seq=args.seq,
            seed=args.seed,
            threads=max(1, cores // degree),
            port=free_port(),
            out_dir=str(work / name),
        )
    return plans


def add_predictions(result: dict, plans: dict[str, RunPlan], args: argparse.Namespace, gpu: GpuSpec) -> None:
    """Every run's cost-model predictions (skipped ones too), the degree-1 calibration, the
    measured runs as planner observations, and the split runs' loss agreement with degree 1."""
    shape, configs = shape_of(args.shape), pack_configs(args.k)
    dtype_bytes = getattr(torch, result["settings"]["dtype"]).itemsize
    runs = result["runs"]
    measured = [
        observation(plan, runs[name], dtype_bytes) for name, plan in plans.items() if runs[name]["status"] == "ok"
    ]
    result["observations"] = [asdict(o) for o in measured]
    fitted, result["calibration_on_degree1"] = calibrate([o for o in measured if o.degree == 1], shape, gpu)
    one = runs["degree1"]
    for name, run in runs.items():
        degree = int(name.removeprefix("degree"))
        run["predicted"] = {"prior": predict(shape, args.seq, dtype_bytes, configs, degree, gpu)}
        if fitted is not None:
            run["predicted"]["calibrated_on_degree1"] = predict(
                shape, args.seq, dtype_bytes, configs, degree, gpu, fitted
            )
        if degree == 1 and "peak_gib" in run["predicted"]["prior"]:
            run["predicted"]["prior_fits"] = run["predicted"]["prior"]["peak_gib"] <= gpu.memory_gib
        if degree > 1 and "losses" in run and "losses" in one:
            run["loss_agreement_with_degree1"] = agreement(one["losses"], run["losses"])


def save(result: dict, path: Path) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(result, indent=1, default=str) + "\n")
    tmp.replace(path)


def print_table(result: dict) -> None:
    s = result["settings"]
    where = result["gpu"] or "cpu"
    print(f"\n=== degree_pack: {s['shape']}, K {s['k']}, seq {s['seq']}, {s['steps']} steps ({s['warmup']} warm-up), "
          f"{s['dtype']}, {where} ===")  # fmt: skip
    print(f"{'run':9s} {'status':8s} {'step s':>7s} {'prior':>7s} {'calib':>7s} {'peak GiB/GPU':>14s} {'prior':>7s} "
          f"{'calib':>7s} {'loss vs d1: abs':>16s} {'rel':>8s}")  # fmt: skip

    def num(value: float | None, fmt: str) -> str:
        return format("-", ">" + fmt.split(".")[0]) if value is None else format(value, fmt)

    for name, run in result["runs"].items():
        pred = run.get("predicted", {})
        prior, calib = pred.get("prior", {}), pred.get("calibrated_on_degree1", {})
        peaks = run.get("peak_gib_per_gpu")
        agree = run.get("loss_agreement_with_degree1", {})
        print(
            f"{name:9s} {run['status']:8s} {num(run.get('step_s'), '7.3f')} {num(prior.get('step_s'), '7.3f')} "
            f"{num(calib.get('step_s'), '7.3f')} {'/'.join(f'{p:.1f}' for p in peaks) if peaks else '-':>14s} "
            f"{num(prior.get('peak_gib'), '7.1f')} {num(calib.get('peak_gib'), '7.1f')} "
            f"{num(agree.get('max_abs_diff'), '16.2e')} {num(agree.get('max_rel_diff'), '8.2e')}"
        )
        if run["status"] != "ok":
            print(f"          {run['reason']}")


if __name__ == "__main__":
    main()
