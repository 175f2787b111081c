"""Device tensors to host memory: page-locked buffers filled by queued copies, waited for once or not at all.

``Tensor.to("cpu")`` on a CUDA tensor waits for each copy in turn, into freshly allocated pageable
memory (first-touch page faults, a transfer staged through a driver buffer). An adapter's
checkpoint is hundreds of tensors and, at a 1.5B shape and rank 128, gigabytes: copied that way it
holds the training loop for a second or more. Here every copy goes into a page-locked buffer from
PyTorch's caching host allocator (reused from one checkpoint to the next), all are queued on the
tensor's stream, and the host waits once. Tensors already on the host are copied plainly. Every
copy is contiguous (safetensors writes only contiguous tensors).

Page-locking memory the allocator does not hold yet costs far more than the copy itself (tens of
times, for a checkpoint-sized state), and less in one allocation than in one per tensor: with
``shared``, the copies of one dtype are views of one buffer.

:func:`queue_host_copies` does not wait at all: the copies run on a side stream of each device,
after the work already queued on its current stream, beside whatever that stream runs next (the
copy engine works while the kernels run). Its caller keeps two rules until the returned events
complete: nothing reads the copies, and nothing writes into the sources (the current stream
``wait_event``-s first). Freed sources are safe: their memory is not reused before the copies end.

Boundary: copies only; what to copy and when is the caller's.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping
from typing import TypeVar

import torch

K = TypeVar("K", bound=Hashable)


def _page_locked(tensors: list[torch.Tensor], shared: bool) -> list[torch.Tensor]:
    """Empty page-locked host tensors shaped like ``tensors``: one allocation each, or with
    ``shared`` one per dtype, cut into views."""
    if not shared:
        return [torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=True) for t in tensors]
    totals: dict[torch.dtype, int] = {}
    for t in tensors:
        totals[t.dtype] = totals.get(t.dtype, 0) + t.numel()
    flat = {dtype: torch.empty(n, dtype=dtype, device="cpu", pin_memory=True) for dtype, n in totals.items()}
    offsets = dict.fromkeys(totals, 0)
    views = []
    for t in tensors:
        start = offsets[t.dtype]
        views.append(flat[t.dtype][start : start + t.numel()].view(t.shape))
        offsets[t.dtype] = start + t.numel()
    return views


def host_copies(tensors: Mapping[K, torch.Tensor], *, shared: bool = False) -> dict[K, torch.Tensor]:
    """Host copies of ``tensors`` (same keys, shapes and dtypes), safe to read when this returns.

    With ``shared``, the copies of device tensors of one dtype share one page-locked buffer: for a
    caller that keeps them together (``torch.save`` writes a shared buffer once; safetensors writes
    views that do not overlap as tensors of their own).
    """
    on_device = {k: t.detach() for k, t in tensors.items() if t.device.type == "cuda"}
    copies = dict(zip(on_device, _page_locked(list(on_device.values()), shared)))
    for key, tensor in on_device.items():
        copies[key].copy_(tensor, non_blocking=True)
    for device in {t.device for t in on_device.values()}:
        torch.cuda.current_stream(device).synchronize()
    return _with_host_tensors(tensors, copies)


def queue_host_copies(
    tensors: Mapping[K, torch.Tensor], *, shared: bool = False
) -> tuple[dict[K, torch.Tensor], list[torch.cuda.Event]]:
    """Host copies of ``tensors`` as :func:`host_copies` makes them, queued but not waited for:
    returns them and the events (one per device) after which they may be read and the sources
    written (see the module's rules). Tensors already on the host are copied at once."""
    on_device = {k: t.detach() for k, t in tensors.items() if t.device.type == "cuda"}
    copies = dict(zip(on_device, _page_locked(list(on_device.values()), shared)))
    events = []
    for device in {t.device for t in on_device.values()}:
        side = _copy_stream(device)
        side.wait_stream(torch.cuda.current_stream(device))  # the values as of the work queued so far
        with torch.cuda.stream(side):
            for key, tensor in on_device.items():
                if tensor.device == device:
                    copies[key].copy_(tensor, non_blocking=True)
                    tensor.record_stream(side)  # freed meanwhile, its memory waits for the copy
        events.append(side.record_event())
    return _with_host_tensors(tensors, copies), events


_copy_streams: dict[torch.device, torch.cuda.Stream] = {}


def _copy_stream(device: torch.device | str) -> torch.cuda.Stream:
    """The device's side stream for queued host copies (one per device, made on first use;
    ``"cuda"`` names the current device, the one its tensors report as ``cuda:N``)."""
    device = torch.device(device)
    if device.index is None:
        device = torch.device(device.type, torch.cuda.current_device())
    if device not in _copy_streams:
        _copy_streams[device] = torch.cuda.Stream(device)
    return _copy_streams[device]


def _with_host_tensors(tensors: Mapping[K, torch.Tensor], copies: dict[K, torch.Tensor]) -> dict[K, torch.Tensor]:
    """``copies`` for the device tensors, in ``tensors``' order, and plain copies of the host ones."""
    return {
        k: copies[k] if k in copies else t.detach().to("cpu").clone(memory_format=torch.contiguous_format)
        for k, t in tensors.items()
    }
