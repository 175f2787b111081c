"""Which devices a sweep trains on, from the ``--device`` text, and whether it trains them in
worker processes.

Kept apart from the sweep recipe, and torch imported only to count or check GPUs, so that the
CLI can start worker processes for an explicit device list before it imports torch or anything
else a sweep uses (they import and load while it does).
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

from plora_hpo.errors import ConfigError

if TYPE_CHECKING:
    import torch

_NAMED = re.compile(r"cpu|cuda:(0|[1-9][0-9]*)")  # as torch.device writes them


def named_devices(spec: str | None) -> list[str] | None:
    """The devices an explicit ``--device`` list names (``cpu``, ``cuda:N``), read without torch and
    without checking that they exist; None when finding them needs torch (``cuda``, the default,
    or text that is not such a list: :func:`resolve_devices` says what is wrong with it)."""
    if spec is None:
        return None
    parts = [part.strip() for part in spec.split(",")]
    if not all(_NAMED.fullmatch(part) for part in parts):
        return None
    return parts


def resolve_devices(spec: str | None) -> list[torch.device]:
    """``None``/``"cuda"``: every visible GPU (else the CPU); ``"cuda:1"``; ``"cuda:0,cuda:1"``;
    ``"cpu"``. Repeating a device (``"cpu,cpu"``) runs that many workers on it."""
    import torch

    if spec is None or spec == "cuda":
        if torch.cuda.is_available():
            return [torch.device("cuda", i) for i in range(torch.cuda.device_count())]
        if spec == "cuda":
            raise ConfigError("--device cuda: no CUDA device is visible; use --device cpu")
        return [torch.device("cpu")]
    devices = []
    for part in spec.split(","):
        try:
            device = torch.device(part.strip())
        except RuntimeError:
            raise ConfigError(f"--device {spec}: {part!r} is not a device; use cpu, cuda or cuda:N") from None
        if device.type == "cuda" and (
            not torch.cuda.is_available() or (device.index or 0) >= torch.cuda.device_count()
        ):
            raise ConfigError(f"--device {spec}: {part} is not visible; use --device cpu or an existing cuda:N")
        if device.type not in ("cpu", "cuda"):
            raise ConfigError(f"--device {spec}: {device.type} is not supported; use cpu or cuda")
        devices.append(device)
    return devices


def in_processes(processes: bool | None, n_devices: int, degree: int) -> bool:
    """Whether a sweep trains in worker processes: as asked, else when it has several devices or
    packs split over several (whose groups are processes)."""
    return processes if processes is not None else n_devices > 1 or degree > 1


def sweep_devices(spec: str | None, processes: bool | None, degree: int) -> tuple[list[str], bool]:
    """The devices a sweep trains on (checked: see :func:`resolve_devices`) and whether in worker
    processes (:func:`in_processes`)."""
    devices = [str(d) for d in resolve_devices(spec)]
    return devices, in_processes(processes, len(devices), degree)
