"""What a checkpoint capture costs the training loop on a GPU: page-locked host allocation
against the device→host copy itself, per tensor or as one buffer.

A capture copies one adapter's fp32 LoRA factors and both AdamW moments to host memory (12 bytes
a parameter; at the qwen2.5-1.5b shape and rank 128, 1.7 GB in ~1,200 tensors). Each strategy
runs in a fresh process (the caching host allocator starts empty, as in a sweep's first round
of checkpoints), captures the same state twice (cold, then warm: the first copies freed), and
times its parts with the device synchronised:

* ``per-tensor``: one page-locked buffer per tensor (``host_copies``' default, an export's);
* ``one-buffer``: one page-locked buffer for all of them, the tensors copied into views of it
  (``host_copies(shared=True)``, a checkpoint's, per dtype);
* ``pageable``: ``tensor.to("cpu")`` one after the other.

``--allocator`` repeats the page-locked strategies under other settings of torch's allocator
(``PYTORCH_CUDA_ALLOC_CONF`` of the child process), such as page-locking ``malloc``-ed memory with
several threads (``pinned_use_cuda_host_register``, ``pinned_num_register_threads``) instead of
``cudaHostAlloc``; without it, torch's default only. A ``pageable`` copy allocates no page-locked
memory, so it runs under the default alone.

Device::

    python3 benchmarks/checkpoint_capture.py --out $OUT

prints a table and writes ``checkpoint-capture-<gpu>.json`` (such as ``-h200``).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _bootstrap  # noqa: F401  (plora_hpo importable from a bare checkout)

from plora_hpo.allocator import VARIABLES as ALLOCATOR_VARIABLES

STRATEGIES = ("per-tensor", "one-buffer", "pageable")


def adapter_state(shape_name: str, rank: int, device: str) -> list:
    """A rank-``rank`` adapter's factors and two moments on every target module, fp32."""
    import torch

    from plora_hpo.shapes import TARGET_MODULES, shape_by_name

    shape = shape_by_name(shape_name)
    tensors = []
    for _ in range(shape.layers):
        for module in TARGET_MODULES:
            d_in, d_out = shape.linear_dims(module)
            for dims in ((rank, d_in), (d_out, rank)):
                tensors += [torch.randn(dims, device=device) for _ in range(3)]  # weight, exp_avg, exp_avg_sq
    return tensors


def capture(strategy: str, tensors: list) -> tuple[list, dict[str, float]]:
    import torch

    sync = torch.cuda.synchronize
    sync()
    t0 = time.perf_counter()
    if strategy == "pageable":
        out = [t.to("cpu") for t in tensors]
        sync()
        return out, {"allocate_s": 0.0, "copy_s": time.perf_counter() - t0}
    if strategy == "per-tensor":
        out = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in tensors]
    else:
        flat = torch.empty(sum(t.numel() for t in tensors), dtype=torch.float32, pin_memory=True)
        out, offset = [], 0
        for t in tensors:
            out.append(flat[offset : offset + t.numel()].view(t.shape))
            offset += t.numel()
    t1 = time.perf_counter()
    for buffer, t in zip(out, tensors):
        buffer.copy_(t, non_blocking=True)
    sync()
    return out, {"allocate_s": t1 - t0, "copy_s": time.perf_counter() - t1}


def child(strategy: str, shape: str, rank: int) -> None:
    """One strategy in this fresh process: a cold capture, the copies freed, a warm one."""
    import torch

    tensors = adapter_state(shape, rank, "cuda")
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    rows = []
    for attempt in ("cold", "warm"):
        out, seconds = capture(strategy, tensors)
        assert all(torch.equal(o, t.cpu()) for o, t in zip(out[:3], tensors[:3]))
        rows.append({"attempt": attempt, **seconds, "total_s": seconds["allocate_s"] + seconds["copy_s"]})
        del out
    print(json.dumps({"strategy": strategy, "tensors": len(tensors), "gb": nbytes / 1e9, "runs": rows}))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="qwen2.5-1.5b")
    p.add_argument("--ranks", default="8,128")
    p.add_argument(
        "--allocator",
        action="append",
        default=[],
        metavar="SETTINGS",
        help="PYTORCH_CUDA_ALLOC_CONF for the page-locked strategies, besides torch's default (repeatable)",
    )
    p.add_argument("--strategies", default=",".join(STRATEGIES), help="comma-separated, of " + ", ".join(STRATEGIES))
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ".")))
    p.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        child(args.child[0], args.child[1], int(args.child[2]))
        return
    import torch
    from sweep_e2e import device_info, gpu_tag, versions

    strategies = args.strategies.split(",")
    unknown = sorted(set(strategies) - set(STRATEGIES))
    if unknown:
        p.error(f"--strategies: unknown {', '.join(unknown)}; choose from {', '.join(STRATEGIES)}")
    base = {k: v for k, v in os.environ.items() if k not in ALLOCATOR_VARIABLES}
    results = []
    for rank in [int(r) for r in args.ranks.split(",")]:
        for strategy in strategies:
            for settings in [None, *(args.allocator if strategy != "pageable" else [])]:
                cmd = [sys.executable, __file__, "--child", strategy, args.shape, str(rank)]
                env = base if settings is None else {**base, ALLOCATOR_VARIABLES[0]: settings}
                done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=True, env=env)
                row = json.loads(done.stdout.strip().splitlines()[-1])
                results.append({"rank": rank, "allocator": settings, **row})
    info = device_info()
    report = {
        "benchmark": "checkpoint_capture",
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        **info,
        "versions": versions(),
        "torch_cuda": torch.version.cuda,
        "shape": args.shape,
        "results": results,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"checkpoint-capture-{gpu_tag(info)}.json").write_text(json.dumps(report, indent=1) + "\n")
    head = ("rank", "strategy", "GB", "tensors", "cold alloc", "cold copy", "warm alloc", "warm copy", "allocator")
    print("{:>4} {:11} {:>5} {:>7} {:>10} {:>9} {:>10} {:>9}  {}".format(*head))
    for r in results:
        cold, warm = r["runs"]
        print(
            f"{r['rank']:>4} {r['strategy']:11} {r['gb']:5.2f} {r['tensors']:>7} {cold['allocate_s']:10.3f} "
            f"{cold['copy_s']:9.3f} {warm['allocate_s']:10.3f} {warm['copy_s']:9.3f}  {r['allocator'] or 'default'}"
        )


if __name__ == "__main__":
    main()
