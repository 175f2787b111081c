"""Adapter checkpoints on disk: one file per trial lineage, replaced atomically every N steps.

A *lineage* is a trial and its retries after crashes (they share the Optuna user attribute
``lineage``), so a retry finds the file its killed predecessor wrote. A file is written to a
temporary name and renamed over the old one: a ``kill -9`` mid-write leaves the previous
checkpoint intact.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path

import torch

from plora_hpo.engine.adapter_state import AdapterState
from plora_hpo.errors import CheckpointError, first_line

FORMAT_VERSION = 1


class CheckpointStore:
    """The checkpoints of one study: ``<run_dir>/checkpoints/<study>/t<lineage>.pt``."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory

    def path(self, lineage: int) -> Path:
        return self.directory / f"t{lineage}.pt"

    def save(self, lineage: int, state: AdapterState, extra: dict[str, str] | None = None) -> Path:
        self.directory.mkdir(parents=True, exist_ok=True)
        final = self.path(lineage)
        partial = final.with_name(f".{final.name}.{os.getpid()}.partial")
        torch.save({"version": FORMAT_VERSION, "state": state.to_dict(), "extra": extra or {}}, partial)
        os.replace(partial, final)
        return final

    def load(self, lineage: int) -> tuple[AdapterState, dict[str, str]] | None:
        """The lineage's last checkpoint, or None if it never wrote one."""
        path = self.path(lineage)
        if not path.is_file():
            return None
        return read_checkpoint(path)

    def delete(self, lineage: int) -> None:
        self.path(lineage).unlink(missing_ok=True)

    def validate_all(self) -> int:
        """Read every checkpoint once (before a resumed sweep starts anything); returns how many."""
        paths = sorted(self.directory.glob("t*.pt")) if self.directory.is_dir() else []
        for path in paths:
            read_checkpoint(path)
        return len(paths)


class CheckpointPacer:
    """Keeps the time a device spends writing checkpoints under a share of its wall time.

    Sizes are in LoRA parameters (what a save writes is proportional to them). The cost of the
    next save is predicted from the seconds per parameter of the saves so far (the first save is
    always written: it is the measurement). A save that would push the total
    above ``share`` of the time since the device started is skipped; the next due one is
    considered again.
    """

    def __init__(self, share: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.share = share
        self.clock = clock
        self.started = clock()
        self.spent = 0.0
        self.written = 0

    def affordable(self, size: int) -> bool:
        if self.written == 0:
            return True
        predicted = self.spent * size / self.written
        return self.spent + predicted <= self.share * (self.clock() - self.started)

    def record(self, size: int, seconds: float) -> None:
        self.spent += seconds
        self.written += max(1, size)


def read_checkpoint(path: Path) -> tuple[AdapterState, dict[str, str]]:
    try:
        data = torch.load(path, map_location="cpu", weights_only=True)
        if data.get("version") != FORMAT_VERSION:
            raise ValueError(f"format version {data.get('version')!r}, expected {FORMAT_VERSION}")
        return AdapterState.from_dict(data["state"]), dict(data["extra"])
    except Exception as err:  # truncated zip, unpickling errors, missing keys, bad values
        raise CheckpointError(
            f"checkpoint {path} is unreadable ({first_line(err, 160)}); delete it to retrain that trial from step 0"
        ) from None
