"""Packed multi-LoRA training vs what users run today, side by side on one GPU.

Usage (GPU)::

    python benchmarks/throughput.py --out $OUT/throughput-h200.json [--budget-s 280]

CPU check of every code path (tiny shapes, fp32/bf16 on the CPU, two co-located workers)::

    python benchmarks/throughput.py --smoke --out /tmp/throughput-smoke.json

Rows, all on random-init models at real Qwen2.5 shapes, LoRA on all seven projections, AdamW,
bf16 base, fixed-length random token sequences where every position is trained (same tokens for
every contender):

* ``peft``: transformers + PEFT, one adapter (r 16), batch 1 and 4 — the sequential baseline;
* ``colocated``: 4 separate PEFT processes (batch 4 each) sharing the GPU — "Min GPU" on one card;
* ``packed``: this engine, K ∈ {1, 8, 32} adapters of mixed ranks (8..128) and batch sizes, plus
  one-knob-off variants of K = 32 (what each engine change buys), mixed-length data (padded vs
  length-bucketed vs padding-free), activation checkpointing and micro-batching;
* a quality check: N packed bf16 steps (Triton kernels, fused ops) against the fp32 reference
  path (PyTorch reference kernels, fp32 base) on a small model that learns, per adapter.

Every row prints tokens/s, MFU (4 × decoder linear params × tokens/s ÷ the bf16 matmul rate
measured in this run), peak memory and the cost model's (uncalibrated prior) predicted peak
memory and step time. Rows run in priority order under ``--budget-s``; what does not fit is
listed under ``skipped``. The JSON is rewritten after every row, so a run cut short still
leaves its rows.
"""

from __future__ import annotations

import argparse
import datetime as dt
import gc
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import _bootstrap  # noqa: F401  (makes plora_hpo importable from a bare checkout)
import torch

from plora_hpo.adapter import AdapterConfig
from plora_hpo.shapes import MODEL_SHAPES, TARGET_MODULES, ModelShape

GIB = 2**30
RANK_CYCLE = (8, 16, 32, 64, 128)
# A packed row's knobs are recorded in the results under these names (the planner's
# Observation.modelled reads them back); two are PackedTrainer arguments under other names.
TRAINER_ARG_OF_KNOB = {"packing": "row_layout", "packed_storage": "flat_storage"}
SMOKE_SHAPES = {
    "tiny-a": ModelShape("qwen2", 64, 160, 2, 4, 2, 512, True),
    "tiny-b": ModelShape("qwen2", 96, 224, 2, 4, 2, 640, False),
}
QUALITY_SHAPE = ModelShape("qwen2", 512, 1408, 4, 8, 2, 2048, True)


# --- small helpers ------------------------------------------------------------------------------
@dataclass(frozen=True)
class Example:
    input_ids: torch.Tensor
    labels: torch.Tensor


def shape_of(name: str) -> ModelShape:
    return SMOKE_SHAPES.get(name) or MODEL_SHAPES[name]


def build_model(shape: ModelShape, dtype: torch.dtype, device: torch.device, seed: int = 0) -> torch.nn.Module:
    """A random-init transformers model at ``shape`` (what ``load_base_model("random:…")`` builds)."""
    from transformers import AutoModelForCausalLM

    from plora_hpo.models import ATTN_IMPLEMENTATION, random_config

    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices), torch.device(device):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(
            random_config(shape), dtype=dtype, attn_implementation=ATTN_IMPLEMENTATION
        )
    model.eval().requires_grad_(False)
    return model


def random_examples(n: int, seq: int, vocab: int, seed: int, min_len: int | None = None) -> list[Example]:
    """Random token sequences, every position trained; lengths uniform in [min_len, seq] if given."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        length = seq if min_len is None else int(torch.randint(min_len, seq + 1, (1,), generator=g))
        ids = torch.randint(1, vocab, (length,), generator=g)
        out.append(Example(ids, ids))
    return out


def idle_gaps(prof, min_us: float = 20.0, top: int = 12) -> dict:
    """Where the GPU waits during a profiled step: its idle gaps between kernels, each with the
    host ops running when it began (innermost last), and the idle before the first and after
    the last kernel."""
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "trace.json"
        prof.export_chrome_trace(str(path))
        events = json.loads(path.read_text())["traceEvents"]
    complete = [e for e in events if e.get("ph") == "X" and "dur" in e]
    device_work = ("kernel", "gpu_memcpy", "gpu_memset")
    named = sorted((e["ts"], e["ts"] + e["dur"], e["name"]) for e in complete if e.get("cat") in device_work)
    kernels = [(start, stop) for start, stop, _ in named]
    host = [e for e in complete if e.get("cat") in ("cpu_op", "user_annotation", "cuda_runtime", "python_function")]
    if not kernels:
        return {}
    start = min(e["ts"] for e in host) if host else kernels[0][0]
    end = max(e["ts"] + e["dur"] for e in host) if host else kernels[-1][1]
    gaps, busy_until = [], kernels[0][1]
    for k_start, k_end in kernels[1:]:
        if k_start - busy_until >= min_us:
            gaps.append((busy_until, k_start))
        busy_until = max(busy_until, k_end)

    def host_ops_at(t: float) -> list[str]:
        active = sorted((e for e in host if e["ts"] <= t < e["ts"] + e["dur"]), key=lambda e: (e["ts"], -e["dur"]))
        return [e["name"][:50] for e in active][-4:]

    by_op: dict[str, float] = {}
    listed = []
    for g_start, g_end in sorted(gaps, key=lambda g: g[0] - g[1]):
        ops = host_ops_at(g_start)
        key = " > ".join(ops[-2:]) or "(no host op)"
        by_op[key] = by_op.get(key, 0.0) + (g_end - g_start) / 1e6
        if len(listed) < top:
            at_ms, ms = round((g_start - start) / 1e3, 2), round((g_end - g_start) / 1e3, 3)
            listed.append({"at_ms": at_ms, "ms": ms, "host": ops})
    return {
        **_small_gaps(named),
        "before_first_kernel_ms": round((kernels[0][0] - start) / 1e3, 2),
        "after_last_kernel_ms": round(max(0.0, end - busy_until) / 1e3, 2),
        "between_kernels_ms": round(sum(b - a for a, b in gaps) / 1e3, 2),
        "gaps": len(gaps),
        "largest": listed,
        "by_host_op_s": {k: round(v, 4) for k, v in sorted(by_op.items(), key=lambda x: -x[1])[:12]},
    }


def _small_gaps(named: list[tuple[float, float, str]], top: int = 12) -> dict:
    """Every gap between consecutive device ops, however short: their total, a histogram, and the
    kernel pairs (before → after) that add up to most of it (where a step loses time to launch
    latency rather than to one stall)."""
    buckets = {"<2us": 0.0, "2-5us": 0.0, "5-10us": 0.0, "10-20us": 0.0, ">=20us": 0.0}
    pairs: dict[str, list[float]] = {}
    busy_until, before = named[0][1], named[0][2]
    for k_start, k_end, name in named[1:]:
        gap = k_start - busy_until
        if gap > 0:
            buckets[next(b for b, bound in zip(buckets, (2, 5, 10, 20, float("inf"))) if gap < bound)] += gap
            key = f"{before[:40]} -> {name[:40]}"
            total = pairs.setdefault(key, [0.0, 0])
            total[0] += gap
            total[1] += 1
        if k_end >= busy_until:
            busy_until, before = k_end, name
    ranked = sorted(pairs.items(), key=lambda kv: -kv[1][0])[:top]
    return {
        "all_gaps_ms": round(sum(buckets.values()) / 1e3, 2),
        "device_span_ms": round((named[-1][1] - named[0][0]) / 1e3, 2),
        "gap_ms_by_size": {k: round(v / 1e3, 2) for k, v in buckets.items()},
        "gap_pairs": [{"pair": k, "ms": round(v[0] / 1e3, 2), "count": v[1]} for k, v in ranked],
    }


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def peak_bytes(device: torch.device) -> int:
    return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0


def reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def free_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def measure_matmul_tflops(device: torch.device, smoke: bool) -> float:
    """bf16 n³ matrix product rate (random data), median of timed repeats."""
    n = 1024 if smoke else 8192
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    times = []
    for i in range(13 if not smoke else 4):
        sync(device)
        t = time.perf_counter()
        a @ b
        sync(device)
        if i >= 3 or smoke:
            times.append(time.perf_counter() - t)
    if device.type == "cuda":  # events are more precise for one product
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        times = []
        for _ in range(10):
            start.record()
            a @ b
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
    return 2 * n**3 / statistics.median(times) / 1e12


# --- PEFT baseline -----------------------------------------------------------------------------
def peft_setup(model, rank: int = 16):
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(
        r=rank, lora_alpha=rank, lora_dropout=0.0, target_modules=list(TARGET_MODULES), task_type="CAUSAL_LM"
    )
    peft_model = get_peft_model(model, config)
    params = [p for p in peft_model.parameters() if p.requires_grad]
    device = params[0].device
    optimizer = torch.optim.AdamW(params, lr=1e-4, fused=device.type == "cuda" or None)
    return peft_model, optimizer


def peft_step_fn(peft_model, optimizer, batch: int, seq: int, vocab: int, device: torch.device, seed: int):
    g = torch.Generator().manual_seed(seed)
    pool = [torch.randint(1, vocab, (batch, seq), generator=g).to(device) for _ in range(4)]
    mask = torch.ones(batch, seq, dtype=torch.long, device=device)
    state = {"i": 0}

    def step() -> None:
        ids = pool[state["i"] % len(pool)]
        state["i"] += 1
        out = peft_model(input_ids=ids, attention_mask=mask, labels=ids)
        out.loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def timed(step, warmup: int, steps: int, device: torch.device) -> tuple[float, float]:
    """Seconds per step over ``steps`` back-to-back steps (one synchronisation at the end, as a
    training loop runs them), after ``warmup`` steps; and the warm-up's seconds."""
    first = time.perf_counter()
    for _ in range(warmup):
        step()
    sync(device)
    warm_s = time.perf_counter() - first
    reset_peak(device)
    started = time.perf_counter()
    for _ in range(steps):
        step()
    sync(device)
    return (time.perf_counter() - started) / steps, warm_s


def write_start_signal(path: Path, start_at: float) -> None:
    """Publish the common start time so that a process polling for ``path`` never reads it empty.

    ``Path.write_text`` creates the file and then writes it: a worker that polls in between finds the
    file, reads ``''`` and fails (``could not convert string to float: ''``), and the co-located row
    is lost. Writing a temporary file and renaming it into place makes the signal appear whole.
    """
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(repr(start_at))
    os.replace(tmp, path)


def read_start_signal(path: Path, deadline: float, poll_s: float = 0.005) -> float:
    """Wait for the start signal and return its time; a file caught mid-write is read again."""
    while True:
        try:
            return float(path.read_text())
        except (FileNotFoundError, ValueError):
            if time.time() > deadline:
                raise TimeoutError(f"no start signal in {path}") from None
            time.sleep(poll_s)


def worker_main(args: argparse.Namespace) -> None:
    """One co-located PEFT process: build, warm up, wait for the common start, train for a window."""
    device = torch.device(args.device)
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    shape = shape_of(args.shape)
    sync_dir = Path(args.sync_dir)
    result = {"id": args.worker_id, "pid": os.getpid()}
    try:
        model = build_model(shape, dtype, device, seed=args.worker_id)
        peft_model, optimizer = peft_setup(model)
        step = peft_step_fn(peft_model, optimizer, args.batch, args.seq, shape.vocab, device, seed=args.worker_id)
        for _ in range(args.warmup):
            step()
        sync(device)
        reset_peak(device)
        (sync_dir / f"ready-{args.worker_id}").write_text("1")
        go_at = read_start_signal(sync_dir / "go", deadline=time.time() + args.wait_s)
        time.sleep(max(0.0, go_at - time.time()))
        steps = 0
        while time.time() < go_at + args.window_s:  # back to back, as a training loop runs
            step()
            steps += 1
        sync(device)  # every launched step has finished inside the measured time
        end = time.time()
        result.update(
            steps=steps,
            tokens=steps * args.batch * args.seq,
            seconds=end - go_at,
            tokens_per_s=steps * args.batch * args.seq / (end - go_at),
            peak_bytes=peak_bytes(device),
        )
    except Exception as exc:  # reported by the parent
        result["error"] = f"{type(exc).__name__}: {exc}"
    (sync_dir / f"result-{args.worker_id}.json").write_text(json.dumps(result))


class Colocated:
    """K separate PEFT processes on one GPU, started early so their start-up overlaps other work."""

    def __init__(self, args, shape_name: str, seq: int, batch: int, count: int, window_s: float) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="plora-coloc-"))
        self.count, self.batch, self.seq, self.shape_name = count, batch, seq, shape_name
        self.window_s = window_s
        self.started = time.perf_counter()
        script = Path(__file__).resolve()
        self.procs = []
        for i in range(count):
            cmd = [
                sys.executable, str(script), "--worker", "--worker-id", str(i), "--sync-dir", str(self.dir),
                "--shape", shape_name, "--seq", str(seq), "--batch", str(batch), "--device", args.device,
                "--dtype", args.dtype, "--window-s", str(window_s), "--warmup", str(2 if not args.smoke else 1),
            ]  # fmt: skip
            log = open(self.dir / f"log-{i}.txt", "w")  # noqa: SIM115 - closed in collect
            self.procs.append((subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT), log))

    def ready(self) -> bool:
        return all((self.dir / f"ready-{i}").exists() for i in range(self.count)) or any(
            p.poll() is not None for p, _ in self.procs
        )

    def run(self, wait_s: float) -> dict:
        deadline = time.perf_counter() + wait_s
        while not self.ready() and time.perf_counter() < deadline:
            time.sleep(0.05)
        startup_s = time.perf_counter() - self.started
        write_start_signal(self.dir / "go", time.time() + 0.3)
        for p, log in self.procs:
            try:
                p.wait(timeout=self.window_s + 60)
            except subprocess.TimeoutExpired:
                p.kill()
            log.close()
        results = []
        for i in range(self.count):
            path = self.dir / f"result-{i}.json"
            if path.exists():
                results.append(json.loads(path.read_text()))
            else:
                tail = (self.dir / f"log-{i}.txt").read_text()[-1500:]
                results.append({"id": i, "error": f"no result; log tail: {tail}"})
        errors = [r["error"] for r in results if "error" in r]
        total = sum(r.get("tokens_per_s", 0.0) for r in results)
        return {
            "processes": results,
            "tokens_per_s": total if not errors else None,
            "error": "; ".join(errors) or None,
            "startup_s": startup_s,
            "peak_gib_each": [r.get("peak_bytes", 0) / GIB for r in results],
        }


# --- cost model ---------------------------------------------------------------------------------
class Predictor:
    """The planner's cost model for a row: the uncalibrated analytic prior, and (in the summary) the
    model calibrated on packed rows measured earlier in the run, predicting the K = 32 rows."""

    def __init__(self, gpu_name: str, memory_gib: float, matmul_tflops: float) -> None:
        from plora_hpo.planner.cost_model import GpuSpec

        self.gpu = GpuSpec(gpu_name, memory_gib, matmul_tflops=matmul_tflops)
        self.error: str | None = None

    def __call__(
        self,
        shape: ModelShape,
        seq: int,
        configs: list[AdapterConfig],
        *,
        checkpointing: bool = False,
        logits_chunk_tokens: int | None = 4096,
        micro_batch_tokens: int | None = None,
    ) -> dict:
        try:
            from plora_hpo.planner.cost_model import CostModel, Workload

            engine = "peft" if logits_chunk_tokens is None else "packed"  # PEFT rows keep all logits
            workload = Workload(
                shape, seq, TARGET_MODULES, 2, checkpointing, logits_chunk_tokens, micro_batch_tokens, engine
            )
            model = CostModel(workload, self.gpu)
            return {"pred_peak_gib": model.peak_memory(configs) / GIB, "pred_step_s": model.step_seconds(configs)}
        except Exception as exc:  # the planner is another engineer's module: report, don't die
            self.error = f"{type(exc).__name__}: {exc}"
            return {"pred_error": self.error}

    def calibrated(self, rows: list[dict], observations: list[dict]) -> list[dict]:
        """Held-out check of calibration: for every K32 packed row, fit the calibration on the
        packed rows of the same model measured before it or not K32 (the small packs a sweep
        calibrates from first), then predict it. Only rows whose engine settings the cost model
        describes (``Observation.modelled``) take part on either side."""
        try:
            from plora_hpo.planner.observations import Observation, held_out_errors

            order = {r["name"]: i for i, r in enumerate(rows)}
            usable = [(o, Observation.from_dict(o)) for o in observations]
            usable = [(o, obs) for o, obs in usable if obs.modelled and o.get("name") in order]
            out = []
            large = {o["name"] for o, _ in usable if " K32" in o["name"]}  # the smoke run keeps these names
            for data, obs in usable:
                if data["name"] not in large:
                    continue
                names = [
                    d["name"]
                    for d, _ in usable
                    if d["model"] == data["model"]
                    and d["name"] != data["name"]
                    and (order[d["name"]] < order[data["name"]] or d["name"] not in large)
                ]
                fit = [x for d, x in usable if d["name"] in names]
                if not fit:
                    out.append({"name": data["name"], "fit_on": []})
                    continue
                result = held_out_errors(fit, [obs], shape_of(data["model"]), self.gpu)
                row = result["rows"][0]
                out.append(
                    {
                        "name": data["name"],
                        "fit_on": names,
                        "memory_error": row.get("memory_error"),
                        "step_error": row.get("step_error"),
                        "memory_prior_error": row.get("memory_prior_error"),
                        "step_prior_error": row.get("step_prior_error"),
                        "calibration": {k: round(v, 4) for k, v in result["calibration"].items()},
                    }
                )
            return out
        except Exception as exc:  # report, don't die
            self.error = f"{type(exc).__name__}: {exc}"
            return [{"error": self.error}]


# --- the benchmark ------------------------------------------------------------------------------
class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.smoke = args.smoke
        self.device = torch.device(args.device)
        self.dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
        self.t0 = time.perf_counter()
        self.rows: list[dict] = []
        self.skipped: list[dict] = []
        self.quality: dict | None = None
        self.varlen: dict | None = None
        self.profile: dict | None = None
        self.fused_ok = True
        self.checks: dict = {}
        self.notes: list[str] = []
        self.matmul_tflops = float("nan")
        self.predict: Predictor | None = None
        self.out = Path(args.out)
        self.meta = self._meta()

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def fits(self, name: str, estimate_s: float) -> bool:
        if self.elapsed() + estimate_s <= self.args.budget_s:
            return True
        self.skipped.append({"row": name, "reason": f"budget: {self.elapsed():.0f}s used, ~{estimate_s:.0f}s needed"})
        print(f"[skip] {name}: budget", flush=True)
        return False

    def _meta(self) -> dict:
        import transformers

        try:
            import peft

            peft_version = peft.__version__
        except ImportError:
            peft_version = None
        try:
            import triton

            triton_version = triton.__version__
        except ImportError:
            triton_version = None
        gpu = torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else platform.processor() or "cpu"
        memory_gib = (
            torch.cuda.get_device_properties(self.device).total_memory / GIB if self.device.type == "cuda" else 16.0
        )
        return {
            "gpu": gpu,
            "gpu_memory_gib": memory_gib,
            "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "triton": triton_version,
            "transformers": transformers.__version__,
            "peft": peft_version,
            "command": "python " + " ".join(shlex.quote(a) for a in sys.argv),
            "smoke": self.smoke,
        }

    def save(self) -> None:
        data = {
            **self.meta,
            "matmul_tflops": self.matmul_tflops,
            "budget_s": self.args.budget_s,
            "elapsed_s": round(self.elapsed(), 1),
            "summary": self.summary(),
            "rows": self.rows,
            "skipped": self.skipped,
            "quality": self.quality,
            "varlen_check": self.varlen,
            "profile": self.profile,
            "self_check": self.checks,
            "observations": self.observations(),
            "notes": self.notes,
        }
        self.out.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.out.with_suffix(".tmp")
        tmp.write_text(json.dumps(data, indent=1, default=str))
        tmp.replace(self.out)

    # ---- rows ----
    def add_row(self, row: dict) -> dict:
        row["elapsed_s"] = round(self.elapsed(), 1)
        self.rows.append(row)
        self.save()
        print(format_row(row), flush=True)
        return row

    def foreign_bytes(self, model: torch.nn.Module, packed=None, adapter_ids=()) -> int:
        """Device memory held by things other than this row's model and adapters (the other model
        kept resident between rows, adapters of other rows): subtracted from the row's peak so
        that it compares with the cost model's prediction for this row alone."""
        if self.device.type != "cuda":
            return 0
        free_memory(self.device)
        lora = set()
        if packed is not None:
            lora = {id(p) for a in packed.configs for p in packed.parameters_of(a)}
        mine = {
            id(p) for a in adapter_ids if packed is not None and a in packed.configs for p in packed.parameters_of(a)
        }
        own = sum(p.numel() * p.element_size() for p in model.parameters() if id(p) not in lora or id(p) in mine)
        own += sum(b.numel() * b.element_size() for b in model.buffers())
        return max(0, torch.cuda.memory_allocated(self.device) - own)

    def mfu(self, shape: ModelShape, tokens_per_s: float) -> float:
        return 4 * shape.decoder_linear_params() * tokens_per_s / (self.matmul_tflops * 1e12)

    def peft_row(self, model, shape_name: str, seq: int, batch: int, warmup: int, steps: int) -> dict:
        shape = shape_of(shape_name)
        row = {"name": f"{shape_name} s{seq} peft b{batch}", "kind": "peft", "model": shape_name, "seq_len": seq,
               "K": 1, "ranks": [16], "batch_sizes": [batch]}  # fmt: skip
        try:
            foreign = self.foreign_bytes(model)
            peft_model, optimizer = peft_setup(model)
            step = peft_step_fn(peft_model, optimizer, batch, seq, shape.vocab, self.device, seed=batch)
            step_s, warm_s = timed(step, warmup, steps, self.device)
            tokens = batch * seq
            row.update(
                tokens_per_step=tokens,
                step_s=step_s,
                warmup_s=warm_s,
                tokens_per_s=tokens / step_s,
                mfu=self.mfu(shape, tokens / step_s),
                peak_gib=(peak_bytes(self.device) - foreign) / GIB,
                other_resident_gib=foreign / GIB,
            )
            row.update(self.predict(shape, seq, [AdapterConfig(16, 16, 1e-4, batch)], logits_chunk_tokens=None))
            del step, optimizer
            peft_model.unload()  # the base model again, LoRA layers removed
        except torch.OutOfMemoryError as exc:
            row["error"] = f"OOM: {str(exc)[:200]}"
        finally:
            free_memory(self.device)
        return self.add_row(row)

    def packed_row(
        self,
        packed,
        shape_name: str,
        seq: int,
        *,
        name: str,
        k: int,
        batch_cycle: tuple[int, ...] = (1, 2),
        rank_cycle: tuple[int, ...] = RANK_CYCLE,
        knobs: dict | None = None,
        min_len: int | None = None,
        warmup: int = 2,
        steps: int = 4,
        cast_adapters: bool = True,
        env: dict | None = None,
    ) -> dict:
        from plora_hpo.engine import AdapterJob, OptimizerSettings, PackedTrainer

        knobs = dict(knobs or {})
        shape = shape_of(shape_name)
        configs = [
            AdapterConfig(
                rank=rank_cycle[i % len(rank_cycle)],
                alpha=2.0 * rank_cycle[i % len(rank_cycle)],
                learning_rate=1e-4 * (1 + i % 4),
                batch_size=batch_cycle[i % len(batch_cycle)],
                seed=1000 + i,
            )
            for i in range(k)
        ]
        row = {"name": name, "kind": "packed", "model": shape_name, "seq_len": seq, "K": k,
               "ranks": [c.rank for c in configs], "batch_sizes": [c.batch_size for c in configs],
               "knobs": {**knobs, "cast_adapters": cast_adapters, **(env or {})}, "min_len": min_len}  # fmt: skip
        trainer = None
        saved_env = {key: os.environ.get(key) for key in env or {}}
        os.environ.update(env or {})
        # adapters are kept in the model between rows (same id = same rank and alpha): creating
        # them (Kaiming init on the host) is not what a row measures
        ids = [f"a{i}-r{c.rank}-alpha{c.alpha:g}" for i, c in enumerate(configs)]
        packed.router.cast_adapters = cast_adapters
        try:
            examples = random_examples(64, seq, shape.vocab, seed=7, min_len=min_len)
            settings = OptimizerSettings(lr_schedule="constant", max_grad_norm=1.0)
            if not self.fused_ok:
                knobs.setdefault("fused_elementwise", False)
            foreign = self.foreign_bytes(packed.model, packed, ids)
            trainer_args = {TRAINER_ARG_OF_KNOB.get(key, key): value for key, value in knobs.items()}
            trainer = PackedTrainer(packed, settings=settings, pad_id=0, device=self.device, **trainer_args)
            for adapter_id, config in zip(ids, configs):
                trainer.add_job(AdapterJob(adapter_id, config, examples, 10**9))
            step_s, warm_s = timed(trainer.step, warmup, steps, self.device)
            stats = trainer.stats
            timed_steps = stats.step_seconds[-steps:]
            real = stats.tokens / stats.steps
            padded = stats.padded_tokens / stats.steps
            tokens_per_s = real / step_s
            row.update(
                tokens_per_step=real,
                padded_tokens_per_step=padded,
                micro_batches_per_step=stats.micro_batches / stats.steps,
                step_s=step_s,
                step_s_all=[round(t, 4) for t in timed_steps],
                warmup_s=warm_s,
                tokens_per_s=tokens_per_s,
                mfu=self.mfu(shape, tokens_per_s),
                peak_gib=(peak_bytes(self.device) - foreign) / GIB,
                other_resident_gib=foreign / GIB,
            )
            row.update(
                self.predict(
                    shape,
                    seq,
                    configs,
                    checkpointing=bool(knobs.get("activation_checkpointing")),
                    logits_chunk_tokens=knobs.get("loss_chunk_tokens", 4096),
                    micro_batch_tokens=knobs.get("micro_batch_tokens"),
                )
            )
        except torch.OutOfMemoryError as exc:
            row["error"] = f"OOM: {str(exc)[:200]}"
        except Exception as exc:
            row["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
            import traceback

            traceback.print_exc()
        finally:
            if trainer is not None:
                for adapter_id in list(trainer.jobs):
                    trainer.remove_job(adapter_id)
                trainer.optimizer = None
            packed.release_storage()
            packed.router.cast_adapters = True
            for key, value in saved_env.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value
            del trainer
            free_memory(self.device)
        return self.add_row(row)

    def varlen_check(self, packed, shape_name: str, seq: int) -> dict:
        """First-step losses of one pack with padded vs padding-free batches (lr 0): equal up to bf16."""
        from plora_hpo.engine import AdapterJob, OptimizerSettings, PackedTrainer

        shape = shape_of(shape_name)
        examples = random_examples(32, seq, shape.vocab, seed=11, min_len=seq // 8)
        losses = {}
        try:
            for row_layout in ("padded", "varlen"):
                settings = OptimizerSettings(lr_schedule="constant", max_grad_norm=1.0)
                trainer = PackedTrainer(packed, settings=settings, pad_id=0, device=self.device, row_layout=row_layout)
                for i, rank in enumerate(RANK_CYCLE[:4]):
                    config = AdapterConfig(
                        rank=rank, alpha=2.0 * rank, learning_rate=1e-30, batch_size=2, seed=1000 + i
                    )
                    trainer.add_job(AdapterJob(f"a{i}-r{rank}-alpha{2.0 * rank:g}", config, examples, 10**9))
                losses[row_layout] = [r.loss for r in trainer.step()]
                for adapter_id in list(trainer.jobs):
                    trainer.remove_job(adapter_id)
                packed.release_storage()
                del trainer
            rel = max(abs(a - b) / abs(b) for a, b in zip(losses["varlen"], losses["padded"]))
            return {"losses": losses, "max_rel_diff": rel, "ok": rel < 0.02}
        except Exception as exc:
            import traceback

            traceback.print_exc()
            return {"losses": losses, "error": f"{type(exc).__name__}: {str(exc)[:300]}", "ok": False}
        finally:
            free_memory(self.device)

    def self_check(self) -> dict:
        """The engine's GPU-only kernels against eager PyTorch on random bf16 data; a kernel that
        disagrees is switched off for the rest of the run (and said so)."""
        from plora_hpo.engine import loss
        from plora_hpo.engine.fused import silu_mul
        from plora_hpo.engine.rotary import rotary

        out: dict = {}
        if self.device.type != "cuda":
            return out
        g = torch.Generator(device=self.device).manual_seed(0)

        def rel(a, b):
            return float((a.float() - b.float()).norm() / b.float().norm())

        logits = torch.randn(512, 151936, device=self.device, generator=g).mul_(3).to(torch.bfloat16)
        targets = torch.randint(0, 151936, (512,), device=self.device, generator=g)
        full = logits.float()
        want = torch.nn.functional.cross_entropy(full, targets, reduction="none")
        want_grad = torch.softmax(full, -1)
        want_grad[torch.arange(512, device=self.device), targets] -= 1
        work = logits.clone()
        got = loss.cross_entropy_rows(work, targets, write_grad=True)
        out["cross_entropy"] = {"loss": rel(got, want), "grad": rel(work, want_grad)}
        if not (out["cross_entropy"]["loss"] < 1e-4 and out["cross_entropy"]["grad"] < 1e-2):
            os.environ["PLORA_FUSED_CE"] = "0"
            self.notes.append(f"fused cross-entropy kernel disagreed ({out['cross_entropy']}): switched off")
        gate = torch.randn(4096, 8960, device=self.device, generator=g, dtype=torch.bfloat16).requires_grad_()
        up = torch.randn(4096, 8960, device=self.device, generator=g, dtype=torch.bfloat16).requires_grad_()
        d = torch.randn(4096, 8960, device=self.device, generator=g, dtype=torch.bfloat16)
        got = silu_mul(gate, up)
        gg, gu = torch.autograd.grad(got, (gate, up), d)
        gate32, up32 = gate.detach().float().requires_grad_(), up.detach().float().requires_grad_()
        ref = torch.nn.functional.silu(gate32) * up32
        rg, ru = torch.autograd.grad(ref, (gate32, up32), d.float())
        out["silu_mul"] = {"out": rel(got, ref), "d_gate": rel(gg, rg), "d_up": rel(gu, ru)}
        weight = (1.0 + 0.1 * torch.randn(1536, device=self.device, generator=g)).to(torch.bfloat16)
        x = torch.randn(8192, 1536, device=self.device, dtype=torch.bfloat16, generator=g)
        ref = weight.float() * (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6))
        got = torch.nn.functional.rms_norm(x, (1536,), weight, 1e-6)
        out["rms_norm"] = {"out": rel(got, ref)}
        # rotary embedding of (B, H, S, D) q/k laid out as the projections leave them, vs HF in fp64
        from transformers.models.qwen2.modeling_qwen2 import apply_rotary_pos_emb

        q = torch.randn(4, 512, 12, 128, device=self.device, generator=g, dtype=torch.bfloat16).transpose(1, 2)
        k = torch.randn(4, 512, 2, 128, device=self.device, generator=g, dtype=torch.bfloat16).transpose(1, 2)
        angles = torch.rand(4, 512, 64, device=self.device, generator=g) * 100
        cos, sin = (torch.cat([f(angles)] * 2, -1).to(torch.bfloat16) for f in (torch.cos, torch.sin))
        dq, dk = torch.randn_like(q), torch.randn_like(k)
        q, k = q.requires_grad_(), k.requires_grad_()
        got = rotary(q, k, cos, sin)
        got_grads = torch.autograd.grad(got, (q, k), (dq, dk))
        ref64 = [t.detach().double().requires_grad_() for t in (q, k)]
        want = apply_rotary_pos_emb(*ref64, cos.double(), sin.double())
        want_grads = torch.autograd.grad(want, ref64, (dq.double(), dk.double()))
        out["rotary"] = {
            name: rel(a, b) for name, a, b in zip(("q", "k", "dq", "dk"), (*got, *got_grads), (*want, *want_grads))
        }
        if max(out["rotary"].values()) >= 1e-2:
            os.environ["PLORA_FUSED_ROTARY"] = "0"
            self.notes.append(f"fused rotary kernel disagreed ({out['rotary']}): switched off")
        if not (max(out["silu_mul"].values()) < 1e-2 and out["rms_norm"]["out"] < 1e-2):
            self.fused_ok = False
            self.notes.append(f"fused elementwise kernels disagreed ({out}): switched off")
        return out

    def profile_step(self, packed, shape_name: str, seq: int, k: int) -> dict:
        """Device time of one packed step by kernel family (torch.profiler), against its wall time."""
        from torch.profiler import ProfilerActivity, profile

        from plora_hpo.engine import AdapterJob, OptimizerSettings, PackedTrainer

        shape = shape_of(shape_name)
        examples = random_examples(64, seq, shape.vocab, seed=7)
        trainer = PackedTrainer(
            packed, settings=OptimizerSettings(lr_schedule="constant", max_grad_norm=1.0), pad_id=0, device=self.device
        )
        try:
            for i in range(k):
                rank = RANK_CYCLE[i % len(RANK_CYCLE)]
                config = AdapterConfig(
                    rank=rank,
                    alpha=2.0 * rank,
                    learning_rate=1e-4 * (1 + i % 4),
                    batch_size=(1, 2)[i % 2],
                    seed=1000 + i,
                )
                trainer.add_job(AdapterJob(f"a{i}-r{rank}-alpha{2.0 * rank:g}", config, examples, 10**9))
            for _ in range(2):
                trainer.step()
            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.device.type == "cuda" else [])
            with profile(activities=activities) as prof:
                started = time.perf_counter()
                trainer.step()
                wall = time.perf_counter() - started
            families = {
                "matmul (cuBLAS)": ("gemm", "cutlass", "xmma", "nvjet", "sm90_", "cublas"),
                "lora (Triton)": ("shrink_kernel", "expand_kernel", "outer_kernel"),
                "attention": ("flash", "fmha", "attention"),
                "cross-entropy (Triton)": ("_cross_entropy_kernel",),
                "silu_mul (Triton)": ("_silu_mul",),
                "rms_norm": ("rms", "norm"),
                "optimizer": ("adam", "multi_tensor", "foreach"),
                "copy/cast": ("copy", "cast", "to_copy"),
            }
            totals: dict[str, float] = {}
            launches = 0
            top, cpu_top = [], []
            for event in prof.key_averages():
                device_us = getattr(event, "self_device_time_total", None)
                if device_us is None:
                    device_us = getattr(event, "self_cuda_time_total", 0)
                if event.key in ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx", "cudaLaunchKernelExC"):
                    launches += event.count
                if (
                    event.self_cpu_time_total
                    and event.device_type is not None
                    and "cpu" in str(event.device_type).lower()
                ):
                    cpu_top.append((event.self_cpu_time_total / 1e6, event.key[:60], event.count))
                if not device_us or event.device_type is None or "cuda" not in str(event.device_type).lower():
                    continue
                if "#" in event.key or event.key.startswith(("ProfilerStep", "Optimizer.")):
                    continue  # user annotations on the GPU timeline span other kernels: not device work
                name = event.key.lower()
                family = next((f for f, keys in families.items() if any(k in name for k in keys)), "other elementwise")
                totals[family] = totals.get(family, 0.0) + device_us / 1e6
                top.append((device_us / 1e6, event.key[:90], event.count))
            top.sort(reverse=True)
            busy = sum(totals.values())
            idle = idle_gaps(prof) if self.device.type == "cuda" else None
            return {
                "model": shape_name,
                "seq_len": seq,
                "K": k,
                "wall_s_profiled": wall,
                "device_busy_s": busy,
                "device_s_by_family": {f: round(v, 4) for f, v in sorted(totals.items(), key=lambda x: -x[1])},
                "kernel_launches": launches,
                "top_kernels": [{"s": round(t, 4), "name": n, "count": c} for t, n, c in top[:40]],
                "host_self_s": round(sum(t for t, _, _ in cpu_top), 4),
                "top_host_ops": [
                    {"s": round(t, 4), "name": n, "count": c} for t, n, c in sorted(cpu_top, reverse=True)[:12]
                ],
                "device_idle": idle,
            }
        except Exception as exc:
            import traceback

            traceback.print_exc()
            return {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
        finally:
            for adapter_id in list(trainer.jobs):
                trainer.remove_job(adapter_id)
            packed.release_storage()
            del trainer
            free_memory(self.device)

    # ---- kernel warm-up (compiles the Triton variants a pack's layers need) ----
    def warm_kernels(self, shape: ModelShape, seq: int, k: int, batch_cycle=(1, 2)) -> float:
        if self.device.type != "cuda":
            return 0.0
        from plora_hpo.kernels import SegmentLayout, packed_lora_add

        started = time.perf_counter()
        ranks = [RANK_CYCLE[i % len(RANK_CYCLE)] for i in range(k)]
        rows = [batch_cycle[i % len(batch_cycle)] for i in range(k)]
        layout = SegmentLayout.from_counts([r * seq for r in rows], ranks, [1.0] * k)
        tokens = sum(rows) * seq
        dims = sorted({shape.linear_dims(m) for m in TARGET_MODULES})
        for d_in, d_out in dims:
            x = torch.randn(tokens, d_in, device=self.device, dtype=self.dtype, requires_grad=True)
            a = torch.randn(sum(ranks), d_in, device=self.device, dtype=self.dtype, requires_grad=True)
            b = torch.randn(d_out, sum(ranks), device=self.device, dtype=self.dtype, requires_grad=True)
            y = torch.randn(tokens, d_out, device=self.device, dtype=self.dtype, requires_grad=True)
            packed_lora_add(y, x, a, b, layout).sum().backward()
            del x, a, b, y
        sync(self.device)
        free_memory(self.device)
        return time.perf_counter() - started

    # ---- quality ----
    def quality_check(self, steps: int) -> dict:
        """Packed bf16 (Triton, fused ops) vs the fp32 reference path, same init and data.

        The adapters are corners of the shipped paper120 grid (search_spaces/paper120.yaml),
        its hottest (rank 128, alpha 4r, lr 4e-4) included. A third run, fp32 again with the
        embeddings perturbed by 1e-6 of their spread, measures how far the fp32 curve itself
        moves under a perturbation of rounding size: where that floor exceeds 1%, the adapter's
        trajectory is chaotic and no finite precision can track it step by step.
        """
        from plora_hpo.engine import AdapterJob, OptimizerSettings, PackedLoraModel, PackedTrainer

        shape = SMOKE_SHAPES["tiny-a"] if self.smoke else QUALITY_SHAPE
        seq = 32 if self.smoke else 128
        corners = [(8, 0.25, 2e-5, 2), (16, 1, 2e-4, 2), (32, 4, 1e-4, 8), (64, 1, 4e-4, 8), (128, 4, 4e-4, 2),
                   (128, 0.25, 4e-4, 8)]  # fmt: skip
        configs = [
            AdapterConfig(rank=r, alpha=m * r, learning_rate=lr, batch_size=b, seed=50 + i)
            for i, (r, m, lr, b) in enumerate(corners)
        ]
        data = [markov_examples(48, seq, shape.vocab, seed=60 + i) for i in range(len(configs))]
        runs = (("bf16", torch.bfloat16, None, 0.0), ("fp32_reference", torch.float32, "reference", 0.0),
                ("fp32_perturbed", torch.float32, "reference", 1e-6))  # fmt: skip
        curves = {}
        started = time.perf_counter()
        for label, dtype, kernels, perturbation in runs:
            previous = os.environ.get("PLORA_KERNELS")
            if kernels:
                os.environ["PLORA_KERNELS"] = kernels
            try:
                model = build_model(shape, torch.float32, self.device, seed=3)
                if perturbation:
                    weight = model.get_input_embeddings().weight.data
                    noise = torch.randn(weight.shape, generator=torch.Generator().manual_seed(4))
                    weight.add_(noise.to(weight.device) * weight.std() * perturbation)
                packed = PackedLoraModel(model.to(dtype), TARGET_MODULES)
                trainer = PackedTrainer(
                    packed,
                    settings=OptimizerSettings(lr_schedule="cosine", warmup_ratio=0.05, max_grad_norm=1.0),
                    pad_id=0,
                    device=self.device,
                    fused_elementwise=dtype != torch.float32,
                )
                for i, config in enumerate(configs):
                    trainer.add_job(AdapterJob(f"q{i}", config, data[i], steps))
                losses = {f"q{i}": [] for i in range(len(configs))}
                trainer.run(lambda r, losses=losses: losses[r.adapter_id].append(r.loss) or True)
                curves[label] = losses
            finally:
                if kernels:
                    if previous is None:
                        os.environ.pop("PLORA_KERNELS", None)
                    else:
                        os.environ["PLORA_KERNELS"] = previous
                free_memory(self.device)

        def deviation(got: list[float], want: list[float]) -> tuple[float, float]:
            """(max per-step, max 10-step-smoothed) relative deviation of two loss curves."""
            got_t, want_t = (torch.tensor(c, dtype=torch.float64) for c in (got, want))
            window = min(10, len(got_t))
            smooth = [torch.nn.functional.avg_pool1d(c[None, None], window, 1)[0, 0] for c in (got_t, want_t)]
            per_step = ((got_t - want_t).abs() / want_t.abs()).max()
            return float(per_step), float(((smooth[0] - smooth[1]).abs() / smooth[1].abs()).max())

        per_adapter = {}
        for i, adapter_id in enumerate(curves["bf16"]):
            want = curves["fp32_reference"][adapter_id]
            dev, dev_smooth = deviation(curves["bf16"][adapter_id], want)
            floor, floor_smooth = deviation(curves["fp32_perturbed"][adapter_id], want)
            rank, multiplier, lr, batch = corners[i]
            per_adapter[adapter_id] = {
                "rank": rank,
                "alpha": multiplier * rank,
                "learning_rate": lr,
                "batch_size": batch,
                "first_loss_fp32": want[0],
                "last_loss_fp32": want[-1],
                "last_loss_bf16": curves["bf16"][adapter_id][-1],
                "max_rel_dev": dev,
                "max_rel_dev_smoothed10": dev_smooth,
                "fp32_floor_max_rel_dev": floor,
                "fp32_floor_max_rel_dev_smoothed10": floor_smooth,
                "chaotic": floor > 0.01,
            }
        tracked = [v for v in per_adapter.values() if not v["chaotic"]]
        worst = max(v["max_rel_dev"] for v in per_adapter.values())
        worst_smooth = max(v["max_rel_dev_smoothed10"] for v in per_adapter.values())
        return {
            "steps": steps,
            "model": asdict(shape),
            "seq_len": seq,
            "data": "per-adapter first-order Markov chains (4 successors per token), 48 sequences each",
            "adapters": "corners of search_spaces/paper120.yaml: (rank, alpha multiplier, lr, batch) " + str(corners),
            "per_adapter": per_adapter,
            "max_rel_dev": worst,
            "max_rel_dev_smoothed10": worst_smooth,
            "max_rel_dev_non_chaotic": max((v["max_rel_dev"] for v in tracked), default=None),
            "chaotic_adapters": [a for a, v in per_adapter.items() if v["chaotic"]],
            "within_1pct_every_step": worst <= 0.01,
            "within_1pct_smoothed": worst_smooth <= 0.01,
            "seconds": time.perf_counter() - started,
            "curves": {k: {a: [round(x, 5) for x in v] for a, v in c.items()} for k, c in curves.items()},
        }

    # ---- summary ----
    def _why_no_coloc(self) -> str:
        """Why the co-located ratio is missing: the section was off, its processes failed, or no K32 row."""
        rows = [r for r in self.rows if r["kind"] == "colocated"]
        if not rows:
            return "co-located section not run (--no-colocated or --sections without coloc)"
        if not rows[0].get("tokens_per_s"):
            return f"co-located processes failed: {str(rows[0].get('error'))[:600]}"
        return "no packed K32 row measured (skipped for time or failed; see rows)"

    def find(self, name: str) -> dict | None:
        return next((r for r in self.rows if r["name"] == name and not r.get("error")), None)

    def summary(self) -> dict:
        big, big7 = self.args.shapes
        seq = self.args.seqs[0]
        packed32 = self.find(f"{big} s{seq} packed K32")
        peft_b1 = self.find(f"{big} s{seq} peft b1")
        coloc = next((r for r in self.rows if r["kind"] == "colocated" and r.get("tokens_per_s")), None)
        packed32_7b = self.find(f"{big7} s{seq} packed K32")

        def ratio(a, b):
            return a["tokens_per_s"] / b["tokens_per_s"] if a and b and b.get("tokens_per_s") else None

        # cost model: prior error over the packed rows whose engine settings it describes, and the
        # calibrated held-out error of the K = 32 rows (Predictor.calibrated)
        observations = self.observations()
        described = {o["name"] for o in observations if _modelled(o)}
        mem_errors, step_errors = [], []
        for r in self.rows:
            if r.get("error") or r["kind"] != "packed" or r["name"] not in described:
                continue
            if r.get("pred_peak_gib") and r.get("peak_gib"):
                mem_errors.append((r["pred_peak_gib"] - r["peak_gib"]) / r["peak_gib"])
            if r.get("pred_step_s") and r.get("step_s"):
                step_errors.append((r["pred_step_s"] - r["step_s"]) / r["step_s"])
        calibrated = self.predict.calibrated(self.rows, observations) if self.predict is not None else []
        cal_mem = [abs(c["memory_error"]) for c in calibrated if c.get("memory_error") is not None]
        cal_step = [abs(c["step_error"]) for c in calibrated if c.get("step_error") is not None]
        summary = {
            "packed32_vs_peft_b1": ratio(packed32, peft_b1),
            "packed32_vs_colocated": ratio(packed32, coloc),
            "packed32_vs_colocated_missing": None if ratio(packed32, coloc) is not None else self._why_no_coloc(),
            "mfu_7b": packed32_7b["mfu"] if packed32_7b else None,
            "memory_prediction_error": statistics.median(abs(e) for e in mem_errors) if mem_errors else None,
            "memory_prediction_error_max": max((abs(e) for e in mem_errors), default=None),
            "memory_prediction_signed": [round(e, 3) for e in mem_errors],
            "step_prediction_error": statistics.median(abs(e) for e in step_errors) if step_errors else None,
            "step_prediction_error_max": max((abs(e) for e in step_errors), default=None),
            "step_prediction_signed": [round(e, 3) for e in step_errors],
            "memory_prediction_error_calibrated": max(cal_mem, default=None),
            "step_prediction_error_calibrated": max(cal_step, default=None),
            "prediction_calibrated": calibrated,
            "definitions": (
                f"ratios: tokens/s of '{big} s{seq} packed K32' (32 adapters, ranks 8..128, batch 1-2) over "
                f"'{big} s{seq} peft b1' and over the summed tokens/s of the co-located PEFT batch-4 processes; "
                f"mfu_7b: 4*decoder linear params*tokens/s / measured bf16 matmul rate for '{big7} s{seq} packed K32'; "
                "memory/step_prediction_error: median |pred-measured|/measured over the packed rows whose engine "
                "settings the cost model describes (defaults, micro-batching, checkpointing; fixed-length data), "
                "prediction = planner cost model prior (uncalibrated); *_calibrated: max |error| over the K32 rows "
                "of the model calibrated on that model's packed rows measured before the row or with fewer "
                "adapters (prediction_calibrated lists each row, what it was fitted on, and both errors)"
            ),
        }
        if self.quality:
            summary["quality_max_rel_dev"] = self.quality.get("max_rel_dev")
            summary["quality_max_rel_dev_smoothed10"] = self.quality.get("max_rel_dev_smoothed10")
            summary["quality_max_rel_dev_non_chaotic"] = self.quality.get("max_rel_dev_non_chaotic")
        goals = {
            "packed32_vs_peft_b1>=15": _ge(summary["packed32_vs_peft_b1"], 15),
            "packed32_vs_colocated>=3": _ge(summary["packed32_vs_colocated"], 3),
            "mfu_7b>=0.5": _ge(summary["mfu_7b"], 0.5),
            "memory_prediction_error<=0.1": None
            if summary["memory_prediction_error_max"] is None
            else summary["memory_prediction_error_max"] <= 0.1,
            "memory_prediction_error_calibrated<=0.1": _le(summary["memory_prediction_error_calibrated"], 0.1),
            "step_prediction_error_calibrated<=0.15": _le(summary["step_prediction_error_calibrated"], 0.15),
        }
        summary["goals_met"] = goals
        return summary

    def observations(self) -> list[dict]:
        """Packed rows in the planner's calibration format (plora_hpo.planner.observations.Observation)."""
        out = []
        for r in self.rows:
            if r["kind"] != "packed" or r.get("error") or r.get("min_len"):
                continue
            out.append(
                {
                    "name": r["name"],
                    "model": r["model"],
                    "gpu": self.meta["gpu"],
                    "ranks": r["ranks"],
                    "batch_sizes": r["batch_sizes"],
                    "seq_len": r["seq_len"],
                    "targets": list(TARGET_MODULES),
                    "step_seconds": r["step_s"],
                    "peak_bytes": r["peak_gib"] * GIB,
                    "degree": 1,
                    "dtype_bytes": 2,
                    "checkpointing": bool(r["knobs"].get("activation_checkpointing")),
                    "logits_chunk_tokens": r["knobs"].get("loss_chunk_tokens", 4096),
                    "knobs": r["knobs"],
                }
            )
        return out


def _ge(value, bound):
    return None if value is None else value >= bound


def _le(value, bound):
    return None if value is None else value <= bound


def _modelled(observation: dict) -> bool:
    """Whether the cost model describes this exported packed row's engine settings."""
    try:
        from plora_hpo.planner.observations import Observation

        return Observation.from_dict(observation).modelled
    except Exception:  # the planner is another engineer's module: report, don't die
        return False


def markov_examples(n: int, seq: int, vocab: int, seed: int) -> list[Example]:
    """Sequences of a random first-order Markov chain with 4 likely successors per token: learnable."""
    g = torch.Generator().manual_seed(seed)
    successors = torch.randint(1, vocab, (vocab, 4), generator=g)
    out = []
    for _ in range(n):
        ids = torch.empty(seq, dtype=torch.long)
        ids[0] = int(torch.randint(1, vocab, (1,), generator=g))
        choice = torch.randint(0, 4, (seq,), generator=g)
        for t in range(1, seq):
            ids[t] = successors[ids[t - 1], choice[t]]
        out.append(Example(ids, ids))
    return out


def format_row(r: dict) -> str:
    if r.get("error"):
        return f"{r['name']:<44} ERROR {r['error'][:120]}"

    def f(key, fmt, default="-"):
        value = r.get(key)
        return format(value, fmt) if isinstance(value, (int, float)) and value == value else default

    pred_mem = r.get("pred_peak_gib")
    pred_mem_s = f"{pred_mem:6.1f}" if isinstance(pred_mem, float) else "     -"
    return (
        f"{r['name']:<44} {f('tokens_per_s', '9.0f')} tok/s  MFU {f('mfu', '5.1%')}  "
        f"peak {f('peak_gib', '6.1f')} GiB (pred {pred_mem_s})  step {f('step_s', '7.3f')} s "
        f"(pred {f('pred_step_s', '6.3f')})"
    )


def run(args: argparse.Namespace) -> None:
    from plora_hpo.engine import PackedLoraModel

    bench = Bench(args)
    big, big7 = args.shapes
    seq, seq_long = args.seqs
    warm = 1 if args.smoke else 2
    steps = 2 if args.smoke else 4
    peft_steps = 2 if args.smoke else 6
    K32 = 6 if args.smoke else 32  # the smoke run keeps the row names, with fewer adapters

    def want(section: str) -> bool:
        return "all" in args.sections or section in args.sections

    # 1. co-located PEFT processes start now; their start-up overlaps ours (nothing is timed meanwhile)
    coloc = (
        Colocated(args, big, seq, batch=4, count=4 if not args.smoke else 2, window_s=args.coloc_window_s)
        if args.colocated and want("coloc")
        else None
    )
    model = build_model(shape_of(big), bench.dtype, bench.device)
    try:
        compile_s = bench.warm_kernels(shape_of(big), seq, K32)
    except Exception as exc:  # compile errors show up again, per row, where they are reported
        compile_s = float("nan")
        bench.notes.append(f"kernel warm-up failed: {type(exc).__name__}: {str(exc)[:300]}")
    bench.notes.append(f"Triton warm-up for the {big} K=32 layout (overlaps the co-located start-up): {compile_s:.1f}s")
    if coloc is not None:
        res = coloc.run(wait_s=args.coloc_wait_s)
        n = coloc.count
        row = {"name": f"{big} s{seq} colocated {n}x b{coloc.batch}",
               "kind": "colocated", "model": big, "seq_len": seq, "K": n, "ranks": [16] * n,
               "batch_sizes": [coloc.batch] * n, "tokens_per_s": res["tokens_per_s"], "error": res["error"],
               "peak_gib": sum(res["peak_gib_each"]), "peak_gib_each": res["peak_gib_each"],
               "startup_s": res["startup_s"], "processes": res["processes"]}  # fmt: skip
        bench.add_row(row)
    bench.matmul_tflops = measure_matmul_tflops(bench.device, args.smoke)
    for row in bench.rows:  # rows measured before the matmul rate
        if row.get("tokens_per_s"):
            row["mfu"] = bench.mfu(shape_of(row["model"]), row["tokens_per_s"])
    bench.predict = Predictor(bench.meta["gpu"], bench.meta["gpu_memory_gib"], bench.matmul_tflops)
    print(f"bf16 matmul: {bench.matmul_tflops:.0f} TFLOP/s", flush=True)
    try:
        bench.checks = bench.self_check()
    except Exception as exc:
        bench.checks = {"error": f"{type(exc).__name__}: {exc}"}
        bench.fused_ok = False
        os.environ["PLORA_FUSED_CE"] = "0"
    print(f"self-check: {bench.checks}", flush=True)
    free_memory(bench.device)

    # 2. the headline rows (summary), in priority order
    if want("headline"):
        bench.peft_row(model, big, seq, 1, warm + 1, peft_steps)
        bench.peft_row(model, big, seq, 4, warm, peft_steps)
    packed = PackedLoraModel(model, TARGET_MODULES)
    if want("headline"):
        bench.packed_row(packed, big, seq, name=f"{big} s{seq} packed K32", k=K32, warmup=warm, steps=steps)

    model7 = packed7 = None
    if (want("7b") or want("7b_long")) and bench.fits(f"{big7} block", 70 if not args.smoke else 5):
        model7 = build_model(shape_of(big7), bench.dtype, bench.device)
        if want("7b"):
            bench.peft_row(model7, big7, seq, 4, warm, peft_steps)
            bench.peft_row(model7, big7, seq, 1, warm, peft_steps)
        packed7 = PackedLoraModel(model7, TARGET_MODULES)
        micro7 = None if args.smoke else args.micro_7b
        if want("7b"):
            bench.packed_row(
                packed7, big7, seq, name=f"{big7} s{seq} packed K32", k=K32,
                knobs={"micro_batch_tokens": micro7}, warmup=1, steps=3 if not args.smoke else 2,
            )  # fmt: skip

    if want("quality") and args.quality_steps and bench.fits("quality", 25 if not args.smoke else 5):
        try:
            bench.quality = bench.quality_check(args.quality_steps)
            q = bench.quality
            print(f"quality: max rel dev {q['max_rel_dev']:.4f} (smoothed {q['max_rel_dev_smoothed10']:.4f}) "
                  f"over {q['steps']} steps, {q['seconds']:.0f}s", flush=True)  # fmt: skip
        except Exception as exc:
            bench.quality = {"error": f"{type(exc).__name__}: {exc}"}
            import traceback

            traceback.print_exc()
        bench.save()

    # 3. the rest of the matrix, while time allows
    if packed7 is not None:
        if want("7b_long") and bench.fits(f"{big7} s{seq_long} packed K32", 30 if not args.smoke else 1):
            bench.packed_row(packed7, big7, seq_long, name=f"{big7} s{seq_long} packed K32", k=K32,
                             knobs={"micro_batch_tokens": None if args.smoke else args.micro_7b}, warmup=1,
                             steps=2)  # fmt: skip
        del packed7, model7
        free_memory(bench.device)

    micro = 8192 if not args.smoke else 128
    micro_long = None if args.smoke else 16384
    extras = [
        (f"{big} s{seq} packed K32 -packed_storage", dict(k=K32, knobs={"packed_storage": False}), 15),
        (f"{big} s{seq} packed K32 -fused_elementwise", dict(k=K32, knobs={"fused_elementwise": False}), 10),
        (f"{big} s{seq} packed K32 -fused_ce", dict(k=K32, env={"PLORA_FUSED_CE": "0"}), 10),
        (f"{big} s{seq} packed K32 -fused_rotary", dict(k=K32, env={"PLORA_FUSED_ROTARY": "0"}), 10),
        (f"{big} s{seq} packed K32 -prefetch", dict(k=K32, knobs={"prefetch": False}), 10),
        (f"{big} s{seq} mixedlen K32 padded", dict(k=K32, min_len=seq // 8), 10),
        (f"{big} s{seq} mixedlen K32 varlen", dict(k=K32, min_len=seq // 8, knobs={"packing": "varlen"}), 12),
        (f"{big} s{seq} packed K32 +checkpointing", dict(k=K32, knobs={"activation_checkpointing": True}), 12),
        (f"{big} s{seq} packed K8", dict(k=8), 8),
        (f"{big} s{seq} packed K1 r16 b4", dict(k=1, batch_cycle=(4,), rank_cycle=(16,)), 20),
        (f"{big} s{seq} packed K32 micro 8192", dict(k=K32, knobs={"micro_batch_tokens": micro}), 10),
        (f"{big} s{seq_long} packed K32", dict(k=K32, seq=seq_long, knobs={"micro_batch_tokens": micro_long}), 40),
        (f"{big} s{seq} mixedlen K32 bucketed", dict(k=K32, min_len=seq // 8, knobs={"micro_batch_tokens": micro},
                                                     warmup=8 if not args.smoke else 1), 30),
        (f"{big} s{seq} packed K32 -bf16_cast", dict(k=K32, cast_adapters=False), 30),
    ]  # fmt: skip
    if want("profile") and bench.fits("profile", 15 if not args.smoke else 1):
        bench.profile = bench.profile_step(packed, big, seq, K32)
        print(f"profile: {json.dumps(bench.profile)[:1500]}", flush=True)
        bench.save()
    if want("extras"):
        for name, spec, estimate in extras:
            if args.extras and not any(f in name for f in args.extras):
                continue
            if not bench.fits(name, estimate if not args.smoke else 1):
                continue
            if spec.get("knobs", {}).get("packing") == "varlen":
                bench.varlen = bench.varlen_check(packed, big, seq)
                print(f"varlen check: {bench.varlen}", flush=True)
                bench.save()
            spec = dict(spec)
            row_seq = spec.pop("seq", seq)
            row_warm = spec.pop("warmup", warm)
            bench.packed_row(packed, big, row_seq, name=name, warmup=row_warm, steps=steps, **spec)
    if want("long_peft") and bench.fits(f"{big} s{seq_long} peft b1", 10 if not args.smoke else 1):
        # the PEFT baseline needs the plain base model back
        bench.notes.append("seq-long PEFT row ran on a fresh base model")
        del packed, model
        free_memory(bench.device)
        model = build_model(shape_of(big), bench.dtype, bench.device)
        bench.peft_row(model, big, seq_long, 1, warm, peft_steps)

    bench.save()
    print_table(bench)


def print_table(bench: Bench) -> None:
    print("\n=== throughput (" + bench.meta["gpu"] + f", bf16 matmul {bench.matmul_tflops:.0f} TFLOP/s) ===")
    for r in bench.rows:
        print(format_row(r))
    if bench.quality and "error" not in bench.quality:
        q = bench.quality
        print(f"quality ({q['steps']} steps, {len(q['per_adapter'])} adapters): max rel dev {q['max_rel_dev']:.4f}, "
              f"smoothed(10) {q['max_rel_dev_smoothed10']:.4f}, "
              f"chaotic (fp32 floor > 1%): {q['chaotic_adapters']}")  # fmt: skip
    elif bench.quality:
        print("quality: " + bench.quality["error"])
    print("summary:", json.dumps({k: v for k, v in bench.summary().items() if k != "definitions"}, default=str))
    if bench.skipped:
        print("skipped:", ", ".join(s["row"] for s in bench.skipped))
    print(f"elapsed {bench.elapsed():.0f}s; JSON: {bench.out}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=None, help="JSON path (default $OUT/throughput-h200.json)")
    p.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU: check every code path")
    p.add_argument("--budget-s", type=float, default=280.0, help="skip optional rows past this many seconds")
    p.add_argument("--quality-steps", type=int, default=None, help="steps of the quality check (0: skip)")
    p.add_argument("--no-colocated", dest="colocated", action="store_false")
    p.add_argument("--coloc-window-s", type=float, default=8.0)
    p.add_argument("--coloc-wait-s", type=float, default=120.0)
    p.add_argument(
        "--sections",
        default="all",
        type=lambda v: v.split(","),
        help="comma list of: coloc, headline, 7b, quality, 7b_long, extras, profile, long_peft (default all)",
    )
    p.add_argument("--extras", default=None, type=lambda v: v.split(","), help="only extras whose name contains these")
    p.add_argument("--micro-7b", type=int, default=8192, help="micro-batch tokens of the 7b packed rows")
    # worker mode (internal)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--worker-id", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--sync-dir", default=None, help=argparse.SUPPRESS)
    p.add_argument("--shape", default=None, help=argparse.SUPPRESS)
    p.add_argument("--seq", type=int, default=512, help=argparse.SUPPRESS)
    p.add_argument("--batch", type=int, default=4, help=argparse.SUPPRESS)
    p.add_argument("--window-s", type=float, default=8.0, help=argparse.SUPPRESS)
    p.add_argument("--warmup", type=int, default=2, help=argparse.SUPPRESS)
    p.add_argument("--wait-s", type=float, default=240.0, help=argparse.SUPPRESS)
    p.add_argument("--device", default=None, help=argparse.SUPPRESS)
    p.add_argument("--dtype", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.device is None:
        args.device = "cpu" if args.smoke or not torch.cuda.is_available() else "cuda"
    if args.dtype is None:
        args.dtype = "bf16" if args.device == "cuda" else "fp32"
    if args.smoke:
        args.shapes, args.seqs = ("tiny-a", "tiny-b"), (32, 64)
        args.coloc_window_s = min(args.coloc_window_s, 2.0)
        if args.quality_steps is None:
            args.quality_steps = 6
    else:
        args.shapes, args.seqs = ("qwen2.5-1.5b", "qwen2.5-7b"), (512, 1024)
        if args.quality_steps is None:
            args.quality_steps = 200
    if args.out is None and not args.worker:
        out_dir = os.environ.get("OUT") or "."
        args.out = Path(out_dir) / ("throughput-smoke.json" if args.smoke else "throughput-h200.json")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.worker:
        worker_main(args)
        return
    run(args)


if __name__ == "__main__":
    main()
