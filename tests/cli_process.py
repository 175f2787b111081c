"""``python -m plora_hpo.cli`` as a child process, for tests that run several, signal or kill them."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


def start_cli(argv: list[str], log: Path, **env: str) -> subprocess.Popen:
    """``plora-hpo argv`` in its own process group (a kill reaches its workers too), one CPU
    thread, stdout and stderr to ``log``; ``env`` adds to the environment."""
    return subprocess.Popen(
        [sys.executable, "-m", "plora_hpo.cli", *argv],
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
        env={**os.environ, "OMP_NUM_THREADS": "1", **env},
    )
