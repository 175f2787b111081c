"""Which devices a sweep trains on, from the ``--device`` text, and whether it trains them in
worker processes.

Kept apart from the sweep recipe so that the CLI can decide, with torch alone imported, where
to start worker processes before it imports the rest (they import and load while it does).
"""

from __future__ import annotations

import torch

from plora_hpo.errors import ConfigError


def resolve_devices(spec: str | None) -> list[torch.device]:
    """``None``/``"cuda"``: every visible GPU (else the CPU); ``"cuda:1"``; ``"cuda:0,cuda:1"``;
    ``"cpu"``. Repeating a device (``"cpu,cpu"``) runs that many workers on it."""
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


def sweep_devices(spec: str | None, processes: bool | None, degree: int) -> tuple[list[str], bool]:
    """The devices a sweep trains on (see :func:`resolve_devices`) and whether in worker
    processes: as asked, else when there are several devices or packs split over several
    (whose groups are processes)."""
    devices = resolve_devices(spec)
    return [str(d) for d in devices], processes if processes is not None else len(devices) > 1 or degree > 1
