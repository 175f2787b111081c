"""Adapter checkpoints on disk: one file per trial lineage, replaced atomically every N steps.

A *lineage* is a trial and its retries after crashes (they share the Optuna user attribute
``lineage``), so a retry finds the file its killed predecessor wrote. A file is written to a
temporary name and renamed over the old one: a ``kill -9`` mid-write leaves the previous
checkpoint intact.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch

from plora_hpo.engine.adapter_state import AdapterState
from plora_hpo.errors import CheckpointError, PloraError, disk_full, first_line
from plora_hpo.trials import TrialInterrupted

FORMAT_VERSION = 1


class NoSpaceLeft(TrialInterrupted, PloraError):
    """A checkpoint could not be written because its file system is full: the sweep stops and
    its trials resume from their previous checkpoints once there is room."""


def disk_has_room(directory: Path, needed: int = 1 << 20) -> bool:
    """Whether the file system of ``directory`` (or its nearest existing parent) has ``needed`` bytes free."""
    while not directory.exists() and directory != directory.parent:
        directory = directory.parent
    return shutil.disk_usage(directory).free >= needed


def as_no_space_left(err: BaseException, directory: Path | None, what: str) -> NoSpaceLeft | None:
    """``err``, raised writing ``what`` under ``directory``, as :class:`NoSpaceLeft` if that file
    system is full, else None. Without a directory (a store that may live anywhere) only what
    ``err`` says counts."""
    if disk_full(err) is None and (directory is None or disk_has_room(directory)):
        return None
    where = "" if directory is None else f" on the device of {directory}"
    return NoSpaceLeft(
        f"no space left{where} for {what} ({first_line(err)}); free space or move "
        "the run directory, then rerun the same command: it resumes from the last checkpoints"
    )


class CheckpointStore:
    """The checkpoints of one study: ``<run_dir>/checkpoints/<study>/t<lineage>.pt``."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory

    def path(self, lineage: int) -> Path:
        return self.directory / f"t{lineage}.pt"

    def save(self, lineage: int, state: AdapterState, extra: dict[str, str] | None = None) -> Path:
        """Write the lineage's checkpoint; the previous one stays until the new one is whole.

        Raises:
            NoSpaceLeft: the file system is full (the previous checkpoint is kept).
        """
        final = self.path(lineage)
        partial = final.with_name(f".{final.name}.{os.getpid()}.partial")
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            torch.save({"version": FORMAT_VERSION, "state": state.to_dict(), "extra": extra or {}}, partial)
            os.replace(partial, final)
        except (OSError, RuntimeError) as err:  # torch.save reports a full disk as a RuntimeError
            partial.unlink(missing_ok=True)
            full = as_no_space_left(err, self.directory, "a checkpoint")
            if full is None:
                raise
            raise full from err
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
