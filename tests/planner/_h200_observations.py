"""Measured packs of the packed engine on one H200 (the cost model's held-out check uses them).

Copied verbatim (observation records, the planner's calibration format) from the ``observations``
lists of ``benchmarks/results/throughput-h200.json`` (``MAIN``; bf16 matmul measured at 738.2
TFLOP/s in that run) and ``benchmarks/results/throughput-h200-extras.json`` (``EXTRAS``; 766.9
TFLOP/s), both of 2026-11-29, keyed by the benchmark row they came from. Random-init Qwen2.5
shapes, LoRA on all seven projections, fixed-length random tokens, bf16 base, fp32 adapters.
"""

from __future__ import annotations

_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
_RANKS_32 = [8, 16, 32, 64, 128] * 6 + [8, 16]
_BATCHES_32 = [1, 2] * 16

MAIN_MATMUL_TFLOPS = 738.2205653610415
EXTRAS_MATMUL_TFLOPS = 766.8557444685621

MAIN: dict[str, dict] = {
    "qwen2.5-1.5b s512 packed K32": {
        "model": "qwen2.5-1.5b",
        "gpu": "NVIDIA H200",
        "ranks": _RANKS_32,
        "batch_sizes": _BATCHES_32,
        "seq_len": 512,
        "targets": _TARGETS,
        "step_seconds": 0.5905996834999954,
        "peak_bytes": 87204938240.0,
        "degree": 1,
        "dtype_bytes": 2,
        "checkpointing": False,
        "logits_chunk_tokens": 4096,
        "knobs": {"cast_adapters": True},
    },
    "qwen2.5-7b s512 packed K32": {
        "model": "qwen2.5-7b",
        "gpu": "NVIDIA H200",
        "ranks": _RANKS_32,
        "batch_sizes": _BATCHES_32,
        "seq_len": 512,
        "targets": _TARGETS,
        "step_seconds": 2.1516106409999907,
        "peak_bytes": 104279273472.0,
        "degree": 1,
        "dtype_bytes": 2,
        "checkpointing": False,
        "logits_chunk_tokens": 4096,
        "knobs": {"micro_batch_tokens": 4096, "cast_adapters": True},
    },
    "qwen2.5-7b s1024 packed K32": {
        "model": "qwen2.5-7b",
        "gpu": "NVIDIA H200",
        "ranks": _RANKS_32,
        "batch_sizes": _BATCHES_32,
        "seq_len": 1024,
        "targets": _TARGETS,
        "step_seconds": 4.271835850499997,
        "peak_bytes": 103863577088.0,
        "degree": 1,
        "dtype_bytes": 2,
        "checkpointing": False,
        "logits_chunk_tokens": 4096,
        "knobs": {"micro_batch_tokens": 4096, "cast_adapters": True},
    },
    "qwen2.5-1.5b s512 packed K32 -packed_storage": {
        "model": "qwen2.5-1.5b",
        "gpu": "NVIDIA H200",
        "ranks": _RANKS_32,
        "batch_sizes": _BATCHES_32,
        "seq_len": 512,
        "targets": _TARGETS,
        "step_seconds": 1.422199797999994,
        "peak_bytes": 80020505600.0,
        "degree": 1,
        "dtype_bytes": 2,
        "checkpointing": False,
        "logits_chunk_tokens": 4096,
        "knobs": {"packed_storage": False, "cast_adapters": True},
    },
}

EXTRAS: dict[str, dict] = {
    "qwen2.5-1.5b s512 packed K1 r16 b4": {
        "model": "qwen2.5-1.5b",
        "gpu": "NVIDIA H200",
        "ranks": [16],
        "batch_sizes": [4],
        "seq_len": 512,
        "targets": _TARGETS,
        "step_seconds": 0.3515999485000094,
        "peak_bytes": 8379495424.0,
        "degree": 1,
        "dtype_bytes": 2,
        "checkpointing": False,
        "logits_chunk_tokens": 4096,
        "knobs": {"cast_adapters": True},
    },
    "qwen2.5-1.5b s512 packed K8": {
        "model": "qwen2.5-1.5b",
        "gpu": "NVIDIA H200",
        "ranks": [8, 16, 32, 64, 128, 8, 16, 32],
        "batch_sizes": [1, 2, 1, 2, 1, 2, 1, 2],
        "seq_len": 512,
        "targets": _TARGETS,
        "step_seconds": 0.3802914799999968,
        "peak_bytes": 23768918016.0,
        "degree": 1,
        "dtype_bytes": 2,
        "checkpointing": False,
        "logits_chunk_tokens": 4096,
        "knobs": {"cast_adapters": True},
    },
    "qwen2.5-1.5b s512 packed K32 +checkpointing": {
        "model": "qwen2.5-1.5b",
        "gpu": "NVIDIA H200",
        "ranks": _RANKS_32,
        "batch_sizes": _BATCHES_32,
        "seq_len": 512,
        "targets": _TARGETS,
        "step_seconds": 0.81351710349999,
        "peak_bytes": 36133441024.0,
        "degree": 1,
        "dtype_bytes": 2,
        "checkpointing": True,
        "logits_chunk_tokens": 4096,
        "knobs": {"activation_checkpointing": True, "cast_adapters": True},
    },
    "qwen2.5-1.5b s512 packed K32 micro 8192": {
        "model": "qwen2.5-1.5b",
        "gpu": "NVIDIA H200",
        "ranks": _RANKS_32,
        "batch_sizes": _BATCHES_32,
        "seq_len": 512,
        "targets": _TARGETS,
        "step_seconds": 1.3028898335000036,
        "peak_bytes": 52854439936.0,
        "degree": 1,
        "dtype_bytes": 2,
        "checkpointing": False,
        "logits_chunk_tokens": 4096,
        "knobs": {"micro_batch_tokens": 8192, "cast_adapters": True},
    },
    "qwen2.5-1.5b s1024 packed K32": {
        "model": "qwen2.5-1.5b",
        "gpu": "NVIDIA H200",
        "ranks": _RANKS_32,
        "batch_sizes": _BATCHES_32,
        "seq_len": 1024,
        "targets": _TARGETS,
        "step_seconds": 1.3269301269999971,
        "peak_bytes": 70045336064.0,
        "degree": 1,
        "dtype_bytes": 2,
        "checkpointing": False,
        "logits_chunk_tokens": 4096,
        "knobs": {"micro_batch_tokens": 16384, "cast_adapters": True},
    },
}
