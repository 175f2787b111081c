"""Packed multi-LoRA fwd+bwd on the GPU: Triton kernels vs a per-adapter loop vs a padded batch.

Usage (GPU)::

    python benchmarks/lora_kernels.py --out $OUT/kernels-h200.json [--sweep]

For every (d_in, d_out) of Qwen2.5-3B/7B attention and MLP projections, K ∈ {1, 2, 8, 32}
adapters of ``--tokens`` rows each and ranks uniform 16, uniform 64 or mixed 8..128, it times
forward + backward (grads to x, A, B) of

* ``loop``: a Python loop of per-adapter matmuls over ``x.split`` (separate A_k, B_k tensors);
* ``loop_ref``: the repository's pure-PyTorch reference (slices + cat, the CPU path);
* ``bmm``: one batched matmul with every rank padded to the largest (``torch.bmm``);
* ``grouped``: the same through ``torch._grouped_mm`` when this PyTorch has it;
* ``ours``: ``packed_lora_triton`` on concatenated A/B; ``ours_cat`` adds the per-step
  ``torch.cat`` of per-adapter weights the engine does; ``ours_f32w`` (K = 32 only) uses fp32
  master weights, as PEFT keeps them; also at K = 32 only: ``ours_op`` goes through the torch
  custom op (what torch.compile sees) instead of the eager autograd.Function,
  ``ours_unfused_dx`` launches dx apart from dA, ``ours_per_rank`` launches per rank tile;
  and with a frozen base weight W (d_out × d_in): ``linear_base`` (``F.linear`` alone, grad to x),
  ``linear_add`` (``F.linear`` then ``packed_lora_add_triton``: autograd adds two dx) and
  ``linear_fused`` (``adapted_linear_triton``: the adapters' dx is added into dy·W in place).

Bandwidth: fewest bytes fwd+bwd must move (x read twice, y written, dy read, dx written, weights
and their grads) over our time, against a device-to-device copy measured in the same run.
``roofline_ms`` is that byte count at the copy rate: no implementation that moves those bytes
can be faster, so ``loop_ms / roofline_ms`` caps the speedup over the loop.
``--sweep`` times each kernel phase of a mixed-rank K=32 pack under candidate tile
configurations, ``--waves-sweep`` small packs under several reduction splits. ``--warm N``
first compiles every kernel variant the rows need in N processes at once (Triton's on-disk
cache is shared), since compiling dominates a cold run. ``--tiny`` runs a few small shapes (on
CPU under TRITON_INTERPRET=1) to check the script itself.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

import _bootstrap  # noqa: F401  (makes plora_hpo importable from a bare checkout)
import torch

SHAPES = {  # name: (d_in, d_out)
    "3b.q_o": (2048, 2048),
    "7b.q_o": (3584, 3584),
    "3b.up": (2048, 11008),
    "3b.down": (11008, 2048),
    "7b.up": (3584, 18944),
    "7b.down": (18944, 3584),
}
MIXED = (8, 16, 32, 64, 128)


def ranks_for(name: str, k: int) -> list[int]:
    if name == "mixed":
        return [MIXED[i % len(MIXED)] for i in range(k)]
    return [int(name.removeprefix("uniform"))] * k


def bench(fn: Callable[[], object], cuda: bool, rep_ms: int) -> float:
    """Median milliseconds of ``fn`` (do_bench on CUDA, wall clock under the interpreter)."""
    if cuda:
        import triton.testing

        return float(triton.testing.do_bench(fn, warmup=max(5, rep_ms // 4), rep=rep_ms, return_mode="median"))
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def host_ms(fn: Callable[[], object], cuda: bool, calls: int = 20) -> float:
    """Host milliseconds to issue one call of ``fn`` (no wait for the GPU, whose queue does not
    fill in so few calls): the floor of a host-bound row's time."""
    fn()
    if cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = (time.perf_counter() - t0) * 1e3 / calls
    if cuda:
        torch.cuda.synchronize()
    return elapsed


def copy_bandwidth(device: torch.device, cuda: bool) -> float:
    """Device-to-device copy rate in GB/s, counting bytes read plus bytes written."""
    n = (1 << 30) if cuda else (1 << 20)
    src = torch.randn(n, device=device, dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    ms = bench(lambda: dst.copy_(src), cuda, 100)
    return 2 * src.numel() * src.element_size() / ms / 1e6


class Problem:
    """Inputs of one configuration, in every layout the compared methods want."""

    def __init__(self, d_in: int, d_out: int, ranks: list[int], tokens: int, device: torch.device):
        from plora_hpo.kernels import SegmentLayout

        gen = torch.Generator(device=device).manual_seed(len(ranks) * 1000 + d_in + d_out)
        k, bf16 = len(ranks), torch.bfloat16
        self.counts, self.ranks = [tokens] * k, ranks
        self.scalings = [2.0 / r**0.5 for r in ranks]
        self.layout = SegmentLayout.from_counts(self.counts, ranks, self.scalings)
        n = tokens * k

        def rand(*shape: int, scale: float = 1.0, dtype: torch.dtype = bf16) -> torch.Tensor:
            return (torch.randn(*shape, generator=gen, device=device) * scale).to(dtype)

        self.x = rand(n, d_in).requires_grad_()
        self.dy = rand(n, d_out)
        a32 = [rand(r, d_in, scale=d_in**-0.5, dtype=torch.float32) for r in ranks]
        b32 = [rand(d_out, r, scale=0.02, dtype=torch.float32) for r in ranks]
        self.a_list = [a.to(bf16).requires_grad_() for a in a32]
        self.b_list = [b.to(bf16).requires_grad_() for b in b32]
        self.a_cat = torch.cat(self.a_list).detach().requires_grad_()
        self.b_cat = torch.cat(self.b_list, dim=1).detach().requires_grad_()
        self.a_cat32 = torch.cat(a32).requires_grad_()
        self.b_cat32 = torch.cat(b32, dim=1).requires_grad_()
        r_max = max(ranks)
        a_pad = torch.zeros(k, r_max, d_in, device=device, dtype=bf16)
        b_pad = torch.zeros(k, d_out, r_max, device=device, dtype=bf16)
        for i, (a, b) in enumerate(zip(self.a_list, self.b_list)):
            a_pad[i, : a.shape[0]] = a.detach()
            b_pad[i, :, : b.shape[1]] = b.detach()
        self.a_pad, self.b_pad = a_pad.requires_grad_(), b_pad.requires_grad_()
        self.s = torch.tensor(self.scalings, device=device, dtype=bf16)
        self.offs = torch.tensor(self.layout.token_offsets[1:], device=device, dtype=torch.int32)
        self.s_rows = self.s.repeat_interleave(tokens)
        self.w = rand(d_out, d_in, scale=d_in**-0.5)  # frozen base weight of the linear_* methods

    def min_bytes(self) -> int:
        """Fewest bytes of one fwd+bwd: x twice, y, dy, dx; A and B read twice, grads written."""
        n, d_in = self.x.shape
        d_out = self.dy.shape[1]
        weights = sum(self.ranks) * (d_in + d_out)
        return 2 * (2 * n * d_in + n * d_out + n * d_out + n * d_in) + 2 * 3 * weights


def methods(p: Problem) -> dict[str, Callable[[], object]]:
    from plora_hpo.kernels import _tuning, packed_lora_reference
    from plora_hpo.kernels._adapted_linear import adapted_linear_triton
    from plora_hpo.kernels.triton_lora import packed_lora_add_triton, packed_lora_op, packed_lora_triton

    def fwd_bwd(forward: Callable[[], torch.Tensor], leaves: list[torch.Tensor]) -> Callable[[], object]:
        return lambda: torch.autograd.grad(forward(), leaves, p.dy)

    def loop() -> torch.Tensor:
        outs = [((xk @ a.t()) * s) @ b.t() for xk, a, b, s in zip(p.x.split(p.counts), p.a_list, p.b_list, p.scalings)]
        return torch.cat(outs)

    def bmm() -> torch.Tensor:
        k, _, d_in = p.a_pad.shape
        h = torch.bmm(p.x.view(k, -1, d_in), p.a_pad.transpose(1, 2)) * p.s.view(k, 1, 1)
        return torch.bmm(h, p.b_pad.transpose(1, 2)).view(p.x.shape[0], -1)

    def grouped() -> torch.Tensor:
        h = torch._grouped_mm(p.x, p.a_pad.transpose(1, 2), offs=p.offs) * p.s_rows[:, None]
        return torch._grouped_mm(h, p.b_pad.transpose(1, 2), offs=p.offs)

    def ours_cat() -> torch.Tensor:
        a_cat, b_cat = torch.cat(p.a_list), torch.cat(p.b_list, dim=1)
        return packed_lora_triton(p.x, a_cat, b_cat, p.layout)

    lists = [p.x, *p.a_list, *p.b_list]
    out = {
        "loop": fwd_bwd(loop, lists),
        "loop_ref": fwd_bwd(lambda: packed_lora_reference(p.x, p.a_cat, p.b_cat, p.layout), [p.x, p.a_cat, p.b_cat]),
        "bmm": fwd_bwd(bmm, [p.x, p.a_pad, p.b_pad]),
        "ours": fwd_bwd(lambda: packed_lora_triton(p.x, p.a_cat, p.b_cat, p.layout), [p.x, p.a_cat, p.b_cat]),
        "ours_cat": fwd_bwd(ours_cat, lists),
    }
    if len(p.ranks) >= 32 or not p.x.is_cuda:  # fp32 master weights (PEFT's), largest packs only
        out["ours_f32w"] = fwd_bwd(
            lambda: packed_lora_triton(p.x, p.a_cat32, p.b_cat32, p.layout), [p.x, p.a_cat32, p.b_cat32]
        )
        out["ours_op"] = fwd_bwd(lambda: packed_lora_op(p.x, p.a_cat, p.b_cat, None, p.layout), [p.x, p.a_cat, p.b_cat])

        def tuned(**changes: object) -> Callable[[], object]:
            run = out["ours"]

            def fn() -> object:
                with _tuning.override(**changes):
                    return run()

            return fn

        out["ours_unfused_dx"] = tuned(fuse_dx=False)
        if len(set(p.ranks)) > 1:
            out["ours_per_rank"] = tuned(merge_ranks=False)
        lora = [p.x, p.a_cat, p.b_cat]
        out["linear_base"] = fwd_bwd(lambda: torch.nn.functional.linear(p.x, p.w), [p.x])
        out["linear_add"] = fwd_bwd(
            lambda: packed_lora_add_triton(torch.nn.functional.linear(p.x, p.w), p.x, p.a_cat, p.b_cat, p.layout), lora
        )
        out["linear_fused"] = fwd_bwd(lambda: adapted_linear_triton(p.x, p.w, None, p.a_cat, p.b_cat, p.layout), lora)
    if hasattr(torch, "_grouped_mm") and p.x.is_cuda:
        out["grouped"] = fwd_bwd(grouped, [p.x, p.a_pad, p.b_pad])
    return out


def run_rows(
    args: argparse.Namespace, device: torch.device, cuda: bool, copy_gbps: float, save: Callable[[list], None]
) -> list[dict]:
    rows: list[dict] = []
    for shape in args.shapes:
        d_in, d_out = SHAPES[shape]
        for k in args.adapters:
            for rank_name in args.ranks:
                p = Problem(d_in, d_out, ranks_for(rank_name, k), args.tokens, device)
                row: dict = {"shape": shape, "d_in": d_in, "d_out": d_out, "K": k, "ranks": rank_name}
                row["tokens"] = p.x.shape[0]
                for name, fn in methods(p).items():
                    try:
                        row[f"{name}_ms"] = bench(fn, cuda, args.rep_ms)
                        if name in ("ours", "bmm"):
                            row[f"{name}_host_ms"] = host_ms(fn, cuda)
                    except Exception as exc:  # a baseline this PyTorch cannot run
                        row[f"{name}_error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
                ours = row["ours_ms"]
                row["min_bytes"] = p.min_bytes()
                row["roofline_ms"] = p.min_bytes() / copy_gbps / 1e6
                row["ours_GBps"] = p.min_bytes() / ours / 1e6
                row["bandwidth_fraction"] = row["ours_GBps"] / copy_gbps
                row["speedup_vs_loop"] = row["loop_ms"] / ours
                row["speedup_vs_loop_ref"] = row["loop_ref_ms"] / ours
                padded = [row[m] for m in ("bmm_ms", "grouped_ms") if m in row]
                row["padded_ms"] = min(padded)
                row["ratio_vs_padded"] = ours / row["padded_ms"]
                if "linear_fused_ms" in row and "linear_add_ms" in row:
                    row["linear_fused_vs_add"] = row["linear_fused_ms"] / row["linear_add_ms"]
                rows.append(row)
                save(rows)  # a run cut short keeps every finished row
                print(json.dumps(row), flush=True)
                del p
                if cuda:
                    torch.cuda.empty_cache()
    return rows


def correctness(device: torch.device, tokens: int) -> dict:
    """bf16 activations (bf16 and fp32 weights) against fp64, ragged segments, mixed ranks whose
    total (504) is not a multiple of 16 (B's row stride gets the kernels' alignment hints). Each
    case runs twice, the second time through the compiled launchers; the worse error is kept."""
    from plora_hpo.kernels import SegmentLayout, packed_lora_reference
    from plora_hpo.kernels.triton_lora import packed_lora_add_triton

    gen = torch.Generator().manual_seed(0)
    counts = [tokens, 0, tokens // 2 + 3, 1, tokens - 5, 17, tokens, 2 * tokens // 3]
    ranks = [8, 128, 128, 16, 64, 8, 32, 120]
    layout = SegmentLayout.from_counts(counts, ranks, [0.5, 2, 1, 4, 0.25, 1, 2, 0.5], token_start=5)
    d_in, d_out = SHAPES["7b.up"] if device.type == "cuda" else (40, 72)
    n = layout.token_offsets[-1] + 7
    result = {"counts": counts, "ranks": ranks, "d_in": d_in, "d_out": d_out}
    for w_name, w_dtype in (("bf16_weights", torch.bfloat16), ("fp32_weights", torch.float32)):
        x = torch.randn(n, d_in, generator=gen).to(device, torch.bfloat16).requires_grad_()
        a = (torch.randn(sum(ranks), d_in, generator=gen) * d_in**-0.5).to(device, w_dtype).requires_grad_()
        b = (torch.randn(d_out, sum(ranks), generator=gen) * 0.1).to(device, w_dtype).requires_grad_()
        base = torch.randn(n, d_out, generator=gen).to(device, torch.bfloat16)
        dy = torch.randn(n, d_out, generator=gen).to(device, torch.bfloat16)
        ref64 = [t.detach().double().requires_grad_() for t in (x, a, b)]
        delta = packed_lora_reference(*ref64, layout)
        want = [base.double() + delta, *torch.autograd.grad(delta, ref64, dy.double())]
        errors: dict[str, float] = {}
        for _ in range(2):
            out = packed_lora_add_triton(base, x, a, b, layout)
            got = [out, *torch.autograd.grad(out, (x, a, b), dy)]
            for name, g, w in zip(("out", "dx", "dA", "dB"), got, want):
                errors[name] = max(errors.get(name, 0.0), ((g.double() - w).norm() / w.norm()).item())
        result[w_name] = errors
    return result


def _phases(kernel: str, x, dy, a, b, h, out, dx, plan, t) -> dict[str, tuple[Callable[[], object], int]]:
    """The two passes of ``kernel`` in a fwd+bwd, each with the elements of its big tensor(s)."""
    from plora_hpo.kernels._launch import expand, shrink, weight_grad

    n_in, n_out = x.numel(), dy.numel()
    if kernel == "shrink":
        return {
            "fwd x.At": (lambda: shrink(x, a, a.stride(1), a.stride(0), plan, t), n_in),
            "bwd dy.B": (lambda: shrink(dy, b, b.stride(0), b.stride(1), plan, t), n_out),
        }
    if kernel == "expand":
        return {
            "fwd h.Bt": (lambda: expand(h, b, b.stride(1), b.stride(0), out, None, plan, t), n_out),
            "fwd base+h.Bt in place": (lambda: expand(h, b, b.stride(1), b.stride(0), out, out, plan, t), 2 * n_out),
        }
    return {
        "bwd dB": (lambda: weight_grad(dy, h, b, 1, plan, t), n_out),
        "bwd dA+dx": (lambda: weight_grad(x, h, a, 0, plan, t, dx=(a, dx)), 2 * n_in),
    }


def sweep(device: torch.device, cuda: bool, tokens: int) -> list[dict]:
    """Time each kernel phase alone: a mixed-rank pack under candidate tiles (the first is the
    default; ``block_c_big`` is the column block of rank tiles ≥ 128), then a few other packs
    under the defaults; bandwidth counts the big tensors once."""
    from plora_hpo.kernels import _tuning
    from plora_hpo.kernels._launch import shrink
    from plora_hpo.kernels._plan import plan_for

    lc, default = _tuning.LaunchConfig, _tuning.Tuning()
    others = {
        "shrink": [lc(64, 8, 4, 32), lc(64, 8, 4, 64), lc(128, 8, 3, 64)],
        "expand": [lc(128, 8, 3, 64), lc(64, 8, 3, 32), lc(64, 4, 3, 64)],
        "outer": [lc(64, 8, 3, 64), lc(128, 8, 3, 128), lc(64, 4, 3, 32)],
    }
    candidates = {kernel: [getattr(default, kernel), *configs] for kernel, configs in others.items()}
    packs = [("7b.up", 32, "mixed", candidates)]  # every candidate; then the defaults alone:
    if cuda:
        default = {kernel: options[:1] for kernel, options in candidates.items()}
        packs += [("7b.up", 32, "uniform64", default), ("7b.up", 8, "uniform16", default)]
        packs += [("3b.q_o", 32, "uniform16", default), ("3b.up", 32, "mixed", default)]
    results = []
    for shape, k, rank_name, configs in packs:
        d_in, d_out = SHAPES[shape] if cuda else (64, 96)
        p = Problem(d_in, d_out, ranks_for(rank_name, k if cuda else 5), tokens, device)
        x, dy, a, b = p.x.detach(), p.dy, p.a_cat.detach(), p.b_cat.detach()
        for kernel, options in configs.items():
            for cfg in options:
                with _tuning.override(**{kernel: cfg}) as t:
                    plan = plan_for(p.layout, t.block_m, device)
                    h = shrink(x, a, a.stride(1), a.stride(0), plan, t)
                    out = torch.empty(x.shape[0], d_out, device=device, dtype=x.dtype)
                    dx = torch.empty_like(x)
                    for phase, (fn, elems) in _phases(kernel, x, dy, a, b, h, out, dx, plan, t).items():
                        ms = bench(fn, cuda, 20)
                        row = {"shape": shape, "K": k, "ranks": rank_name, "kernel": kernel, "phase": phase}
                        row.update(config=asdict(cfg), ms=ms, GBps=2 * elems / ms / 1e6)
                        results.append(row)
                        print(json.dumps(row), flush=True)
        del p
    return results


def waves_sweep(device: torch.device, cuda: bool, tokens: int) -> list[dict]:
    """Small-K problems depend on how much a reduction is split: time fwd+bwd per ``waves``."""
    from plora_hpo.kernels import _tuning

    results = []
    for shape in ("7b.q_o", "7b.down") if cuda else ("tiny",):
        d_in, d_out = SHAPES[shape]
        for k in (1, 2) if cuda else (1,):
            p = Problem(d_in, d_out, ranks_for("mixed", k), tokens, device)
            fn = methods(p)["ours"]
            for waves in (1, 2, 4, 8, 16) if cuda else (4,):
                with _tuning.override(waves=waves):
                    row = {"shape": shape, "K": k, "waves": waves, "ms": bench(fn, cuda, 30)}
                results.append(row)
                print(json.dumps(row), flush=True)
            del p
    return results


def _warm_one(job: tuple[int, int, int, str, int]) -> None:
    """Run each Triton method of one row once (in a worker process: compiles, times nothing)."""
    d_in, d_out, k, rank_name, tokens = job
    cuda = torch.cuda.is_available()
    p = Problem(d_in, d_out, ranks_for(rank_name, k), tokens, torch.device("cuda" if cuda else "cpu"))
    for name, fn in methods(p).items():
        if name.startswith(("ours", "linear")):
            fn()
    if cuda:
        torch.cuda.synchronize()
        del p
        torch.cuda.empty_cache()  # 14 workers must not each keep a 7B pack's memory reserved


def warm(args: argparse.Namespace, procs: int) -> float:
    """Compile the kernel variants of every row in ``procs`` processes at once; seconds taken.

    Rows of one (ranks, K) mostly share variants, so the jobs go out one shape at a time."""
    import multiprocessing

    t0 = time.perf_counter()
    jobs = [(*SHAPES[s], k, r, args.tokens) for s in args.shapes for r in args.ranks for k in args.adapters]
    with multiprocessing.get_context("spawn").Pool(procs) as pool:
        pool.map(_warm_one, jobs, chunksize=1)
    return time.perf_counter() - t0


def summarize(rows: list[dict]) -> dict:
    def med(values: list[float]) -> float | None:
        return statistics.median(values) if values else None

    k_max = max(r["K"] for r in rows)
    mixed_kmax = [r for r in rows if r["K"] == k_max and r["ranks"] == "mixed"]
    uniform = [r for r in rows if r["ranks"] != "mixed"]
    mixed = [r for r in rows if r["ranks"] == "mixed" and r["K"] > 1]
    return {
        "speedup_vs_loop_k32": med([r["speedup_vs_loop"] for r in mixed_kmax]),
        "speedup_vs_loop_ref_k32": med([r["speedup_vs_loop_ref"] for r in mixed_kmax]),
        "ratio_vs_padded_uniform": med([r["ratio_vs_padded"] for r in uniform]),
        "ratio_vs_padded_uniform_worst": max((r["ratio_vs_padded"] for r in uniform), default=None),
        "ratio_vs_padded_mixed": med([r["ratio_vs_padded"] for r in mixed]),
        "bandwidth_fraction": med([r["bandwidth_fraction"] for r in rows if r["K"] == k_max]),
        "bandwidth_fraction_best": max(r["bandwidth_fraction"] for r in rows),
        "ratio_vs_padded_uniform_k32": med([r["ratio_vs_padded"] for r in uniform if r["K"] == k_max]),
        "speedup_vs_loop_k32_roofline_cap": med([r["loop_ms"] / r["roofline_ms"] for r in mixed_kmax]),
        "linear_fused_vs_add_k32": med([r["linear_fused_vs_add"] for r in rows if "linear_fused_vs_add" in r]),
        "definitions": (
            f"speedups: median over shapes of loop/ours at K={k_max}, mixed ranks; ratios: median of "
            f"ours/min(bmm, grouped) time; bandwidth_fraction: median over K={k_max} rows of "
            f"(min_bytes/ours time)/copy bandwidth; speedup_vs_loop_k32_roofline_cap: median of "
            f"loop/(min_bytes at the copy rate), the most any kernel could reach; "
            f"linear_fused_vs_add_k32: median of adapted_linear time / (F.linear + packed_lora_add) time"
        ),
    }


def print_table(rows: list[dict], summary: dict, copy_gbps: float) -> None:
    head = f"{'shape':8} {'K':>2} {'ranks':9} {'loop':>8} {'padded':>8} {'ours':>8} {'x_loop':>7} {'/pad':>5} {'BW':>5}"
    print(head)
    for r in rows:
        print(
            f"{r['shape']:8} {r['K']:>2} {r['ranks']:9} {r['loop_ms']:8.3f} {r['padded_ms']:8.3f} "
            f"{r['ours_ms']:8.3f} {r['speedup_vs_loop']:7.2f} {r['ratio_vs_padded']:5.2f} "
            f"{r['bandwidth_fraction']:5.2f}"
        )
    print(f"copy bandwidth {copy_gbps:.0f} GB/s (read+write); times in ms, fwd+bwd")
    print("summary", json.dumps({k: v for k, v in summary.items() if k != "definitions"}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="JSON path (default $OUT/kernels-h200.json)")
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--adapters", nargs="+", type=int, default=[1, 2, 8, 32])
    parser.add_argument("--ranks", nargs="+", default=["uniform16", "uniform64", "mixed"])
    parser.add_argument("--tokens", type=int, default=1024, help="rows per adapter")
    parser.add_argument("--rep-ms", type=int, default=25)
    parser.add_argument("--sweep", action="store_true", help="also time kernel phases per tile config")
    parser.add_argument("--waves-sweep", action="store_true", help="also time small packs per split target")
    parser.add_argument("--warm", type=int, default=0, help="compile the rows' kernels in N processes first")
    parser.add_argument("--no-rows", action="store_true", help="skip the main comparison")
    parser.add_argument("--tiny", action="store_true", help="tiny shapes: check the script on CPU")
    args = parser.parse_args()

    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    if args.tiny:
        SHAPES.clear()
        SHAPES.update({"tiny": (64, 96)})
        args.shapes, args.adapters, args.tokens = ["tiny"], [1, 2], 24
    import triton

    from plora_hpo.kernels import _tuning

    report: dict = {
        "gpu": torch.cuda.get_device_name() if cuda else "cpu (TRITON_INTERPRET)",
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "tuning": asdict(_tuning.current()),
    }
    report["correctness_bf16_vs_fp64"] = correctness(device, args.tokens)
    print("correctness", json.dumps(report["correctness_bf16_vs_fp64"]), flush=True)
    copy_gbps = copy_bandwidth(device, cuda)
    report["copy_bandwidth_GBps"] = copy_gbps
    out = Path(args.out or Path(os.environ.get("OUT", "benchmarks/results")) / "kernels-h200.json")
    out.parent.mkdir(parents=True, exist_ok=True)

    def save(rows: list[dict]) -> None:
        report["rows"], report["summary"] = rows, summarize(rows)
        out.write_text(json.dumps(report, indent=1))

    if args.warm and not args.no_rows:
        report["warm_s"] = warm(args, args.warm)
        print(f"compiled in {args.warm} processes in {report['warm_s']:.0f} s", flush=True)
    if not args.no_rows:
        run_rows(args, device, cuda, copy_gbps, save)
    if args.sweep:  # after the rows, so a run cut short still leaves them on disk
        report["sweep"] = sweep(device, cuda, args.tokens)
    if args.waves_sweep:
        report["waves_sweep"] = waves_sweep(device, cuda, args.tokens)
    out.write_text(json.dumps(report, indent=1))
    if not args.no_rows:
        print_table(report["rows"], report["summary"], copy_gbps)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
