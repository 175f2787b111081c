"""Device tensors to host memory with one wait: page-locked buffers filled by queued copies.

``Tensor.to("cpu")`` on a CUDA tensor waits for each copy in turn, into freshly allocated pageable
memory (first-touch page faults, a transfer staged through a driver buffer). An adapter's
checkpoint is hundreds of tensors and, at a 1.5B shape and rank 128, gigabytes: copied that way it
holds the training loop for a second or more. Here every copy goes into a page-locked buffer from
PyTorch's caching host allocator (reused from one checkpoint to the next), all are queued on the
tensor's stream, and the host waits once. Tensors already on the host are copied plainly. Every
copy is contiguous (safetensors writes only contiguous tensors).

Boundary: copies only; what to copy and when is the caller's.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping
from typing import TypeVar

import torch

K = TypeVar("K", bound=Hashable)


def host_copies(tensors: Mapping[K, torch.Tensor]) -> dict[K, torch.Tensor]:
    """Host copies of ``tensors`` (same keys, shapes and dtypes), safe to read when this returns."""
    out: dict[K, torch.Tensor] = {}
    devices: set[torch.device] = set()
    for key, tensor in tensors.items():
        tensor = tensor.detach()
        if tensor.device.type != "cuda":
            out[key] = tensor.to("cpu").clone(memory_format=torch.contiguous_format)
            continue
        buffer = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu", pin_memory=True)
        buffer.copy_(tensor, non_blocking=True)
        out[key] = buffer
        devices.add(tensor.device)
    for device in devices:
        torch.cuda.current_stream(device).synchronize()
    return out
