"""CPU cost of the packed LoRA path against the base matmul it rides on (the CPU sweep's path).

Three forward passes of one adapted linear layer over a packed batch, frozen (as in evaluation):

* ``base``: ``x·Wᵀ`` alone;
* ``delta_then_add``: ``x·Wᵀ + packed_lora_reference(...)`` — the full-width delta written, scaled,
  concatenated and added (the pure-PyTorch oracle the Triton kernels are tested against);
* ``accumulate``: ``adapted_linear_reference`` — the rank-wide intermediate scaled and each
  segment's expand accumulated into the base output (what the CPU path runs).

Shapes: SmolLM2-135M's MLP up projection (576 → 1536) and attention output (576 → 576), a batch
of 2048 tokens split over four adapters of ranks 16, 64, 8 and 32; one torch thread (the thread
count a loaded 2-core machine gets). Each path's fastest of the interleaved runs is reported
(medians too, in the JSON): on a shared machine the minimum is the least disturbed measure.
Prints a table; writes JSON (machine, date, versions, command) to ``--out``.

Usage::

    python benchmarks/cpu_lora_path.py --out benchmarks/results/cpu-lora-path.json
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import platform
import shlex
import statistics
import sys
import time
from pathlib import Path

import _bootstrap  # noqa: F401  (makes plora_hpo importable from a bare checkout)
import torch

from plora_hpo.kernels.layout import SegmentLayout
from plora_hpo.kernels.torch_lora import adapted_linear_reference, packed_lora_reference

RANKS = (16, 64, 8, 32)
SCALINGS = (2.0, 1.0, 0.5, 1.0)
TOKENS = 2048
SHAPES = {"up_proj 576->1536": (576, 1536), "o_proj 576->576": (576, 576)}


def timings_ms(paths: dict, x: torch.Tensor, repeats: int) -> dict[str, list[float]]:
    """Each path's wall times, the paths interleaved so that machine noise hits them alike."""
    for fn in paths.values():
        for _ in range(3):
            fn(x)
    times: dict[str, list[float]] = {path: [] for path in paths}
    for _ in range(repeats):
        for path, fn in paths.items():
            started = time.perf_counter()
            fn(x)
            times[path].append((time.perf_counter() - started) * 1e3)
    return times


def measure(name: str, d_in: int, d_out: int, layout: SegmentLayout, repeats: int) -> dict:
    x = torch.randn(TOKENS, d_in)
    weight = torch.randn(d_out, d_in) * 0.02
    a_cat = torch.randn(sum(RANKS), d_in) * 0.02
    b_cat = torch.randn(d_out, sum(RANKS)) * 0.02
    paths = {
        "base": lambda x: torch.nn.functional.linear(x, weight),
        "delta_then_add": lambda x: (
            torch.nn.functional.linear(x, weight) + packed_lora_reference(x, a_cat, b_cat, layout)
        ),
        "accumulate": lambda x: adapted_linear_reference(x, weight, None, a_cat, b_cat, layout),
    }
    times = timings_ms(paths, x, repeats)
    ms = {path: min(t) for path, t in times.items()}  # the least-disturbed run of each
    return {
        "shape": name,
        "ms": ms,
        "median_ms": {path: statistics.median(t) for path, t in times.items()},
        "lora_over_base": {p: (ms[p] - ms["base"]) / ms["base"] for p in ("delta_then_add", "accumulate")},
        "outputs_agree": torch.allclose(paths["accumulate"](x), paths["delta_then_add"](x), rtol=1e-5, atol=1e-6),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    layout = SegmentLayout.from_counts([TOKENS // len(RANKS)] * len(RANKS), list(RANKS), list(SCALINGS))
    with torch.no_grad():
        rows = [measure(name, d_in, d_out, layout, args.repeats) for name, (d_in, d_out) in SHAPES.items()]
    result = {
        "benchmark": "cpu_lora_path",
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "machine": {"platform": platform.platform(), "processor": platform.processor(), "threads": 1},
        "versions": {"python": platform.python_version(), "torch": torch.__version__},
        "command": "python " + " ".join(shlex.quote(a) for a in sys.argv),
        "workload": f"{TOKENS} tokens, adapters of ranks {RANKS}, frozen forward, "
        f"fastest of {args.repeats} interleaved runs",
        "rows": rows,
    }
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"{'shape':<20} {'base ms':>8} {'delta+add ms':>13} {'accumulate ms':>14} {'LoRA cost then':>15} {'now':>6}")
    for row in rows:
        ms, extra = row["ms"], row["lora_over_base"]
        print(
            f"{row['shape']:<20} {ms['base']:8.1f} {ms['delta_then_add']:13.1f} {ms['accumulate']:14.1f} "
            f"{extra['delta_then_add']:14.0%} {extra['accumulate']:6.0%}"
        )


if __name__ == "__main__":
    main()
