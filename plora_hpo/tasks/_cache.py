"""Where derived files live (dequantized models, converted datasets), and how they are written.

Everything here is derived from inputs the user already has, so it goes to a per-user cache
(``$PLORA_HPO_CACHE``, else ``~/.cache/plora_hpo``) and never into the repository. Entries are
written into a temporary sibling folder and renamed into place, so a crash or a concurrent
writer never leaves a half-written entry that later runs would trust.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

CACHE_ENV = "PLORA_HPO_CACHE"


def cache_root() -> Path:
    """The cache folder: ``$PLORA_HPO_CACHE`` if set, else ``~/.cache/plora_hpo``."""
    configured = os.environ.get(CACHE_ENV)
    return Path(configured).expanduser() if configured else Path.home() / ".cache" / "plora_hpo"


def build_atomically(target: Path, build: Callable[[Path], None]) -> Path:
    """Create folder ``target`` by calling ``build(tmp_dir)`` and renaming; reuse it if it exists.

    The rename is atomic on one file system, so ``target`` either does not exist or is complete.
    When two processes race, the loser discards its copy and uses the winner's.
    """
    if target.is_dir():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent))
    try:
        build(tmp)
        try:
            os.rename(tmp, target)
        except OSError:
            if not target.is_dir():  # a real failure, not a lost race
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target
