"""Keeping a finished adapter once: in its MLflow run's artifact folder when that folder is on this machine.

Boundary: where an exported adapter folder ends up on disk, not how it is exported (the engine's
PEFT export) nor how a remote store receives it (an upload through the tracker's delivery queue).
A run whose artifact URI is a local folder (``file:``, MLflow's default for sqlite and file
stores) gets the exported folder itself, moved to ``<artifact folder>/<name>``, exactly where
MLflow's ``log_artifacts`` would have copied it; the exported path becomes a relative symbolic link
to it, so the run directory keeps one entry per adapter by name without a second copy of its bytes.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from mlflow.utils.file_utils import local_file_uri_to_path
from mlflow.utils.uri import is_local_uri

__all__ = ["keep_in_store", "local_artifact_dir"]


def local_artifact_dir(artifact_uri: str) -> Path | None:
    """The folder of a local artifact URI (``file:///…`` or a plain path); None for any remote store."""
    if not is_local_uri(artifact_uri):
        return None
    return Path(local_file_uri_to_path(artifact_uri))


def keep_in_store(exported: Path, stored: Path) -> Path:
    """Move folder ``exported`` to ``stored`` (replacing an earlier one) and link ``exported`` to it.

    Returns ``stored``. A retried trial exports again and replaces what its predecessor stored, so a
    run's artifact always holds the adapter its trial finished with.
    """
    stored.parent.mkdir(parents=True, exist_ok=True)
    if stored.exists():
        shutil.rmtree(stored)
    shutil.move(exported, stored)  # a rename on one filesystem
    exported.symlink_to(os.path.relpath(stored, exported.parent), target_is_directory=True)
    return stored
