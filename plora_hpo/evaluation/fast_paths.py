"""How evaluation forwards run on CUDA: SDPA without cuDNN, fused elementwise ops, segment GEMMs.

In an H200 profile (qwen2.5-1.5b shape, bf16; not kept in ``benchmarks/results/``) cuDNN's SDPA
spent milliseconds of host time per call whenever the key length was new, as it is at every
decode step and for every scoring batch; the flash and memory-efficient kernels launch
directly. Eager RMSNorm upcasts to fp32 and runs several kernels, and the SwiGLU MLP runs
``silu`` and ``*`` apart: memory-bound passes at scoring sizes, launches (host time) at decode
sizes. The engine's fused forwards (``plora_hpo.engine.fused``, what training uses on CUDA)
compute the same function up to one bf16 rounding instead of two, and were the largest single
saving in that profile's scoring time. The same swap also fuses the rotary embedding of q and k
(:mod:`plora_hpo.engine.rotary`), added after that profile.

Large forwards also apply the adapters as cuBLAS GEMMs per segment
(:mod:`~plora_hpo.evaluation.segment_gemms`, switched on through :func:`segment_gemms_on`).
Elsewhere (the CPU, where results must equal HF + PEFT bit for bit) nothing changes.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from plora_hpo.engine.fused import fuse_elementwise, unfuse_elementwise
from plora_hpo.evaluation._model import model_device

# SDPA's backend switches are process-wide, while device workers evaluate in threads of their own:
# cuDNN stays off while any of them is inside attention_backends, and comes back after the last.
_cudnn_lock = threading.Lock()
_cudnn_users = 0
_cudnn_before = True


def segment_gemms_on(device: torch.device) -> bool:
    """Whether large forwards take the segment GEMMs: on CUDA only (module doc)."""
    return device.type == "cuda"


@contextmanager
def attention_backends(device: torch.device) -> Iterator[None]:
    """On CUDA, SDPA may pick flash, memory-efficient or math kernels, not cuDNN (module doc)."""
    global _cudnn_users, _cudnn_before
    if device.type != "cuda":
        yield
        return
    with _cudnn_lock:
        if _cudnn_users == 0:
            _cudnn_before = torch.backends.cuda.cudnn_sdp_enabled()
            torch.backends.cuda.enable_cudnn_sdp(False)
        _cudnn_users += 1
    try:
        yield
    finally:
        with _cudnn_lock:
            _cudnn_users -= 1
            if _cudnn_users == 0:
                torch.backends.cuda.enable_cudnn_sdp(_cudnn_before)


@contextmanager
def fused_elementwise(model: nn.Module) -> Iterator[None]:
    """On CUDA, the engine's fused RMSNorm/SwiGLU/rotary forwards within the block.

    A model the trainer already fused stays as it is (and stays fused after the block).
    """
    if model_device(model).type != "cuda":
        yield
        return
    patched = fuse_elementwise(model)
    try:
        yield
    finally:
        if patched:
            unfuse_elementwise(model)


@contextmanager
def fast_forwards(model: nn.Module) -> Iterator[None]:
    """Both of the above: what scoring, generation and the benchmark's ceiling run under."""
    with attention_backends(model_device(model)), fused_elementwise(model):
        yield
