"""Adapter checkpoints on disk: one file per trial lineage, replaced atomically every N steps.

A *lineage* is a trial and its retries after crashes (they share the Optuna user attribute
``lineage``), so a retry finds the file its killed predecessor wrote. A file is written to a
temporary name and renamed over the old one: a ``kill -9`` mid-write leaves the previous
checkpoint intact.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from plora_hpo.engine.resume import AdapterState
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
