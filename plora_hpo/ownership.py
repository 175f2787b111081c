"""One live owner per run directory: an exclusive lock that a second sweep is refused by.

The owner holds ``fcntl.flock`` on ``<run_dir>/.owner`` for as long as it runs; the kernel drops
the lock when the process ends in any way (exit, crash, ``kill -9``), so a rerun after a crash
takes the directory over at once while a rerun beside a live sweep is refused, naming the live
owner (pid, host, start time) it found in the file. The lock is local to one machine's file
system: put a run directory shared between machines on storage that honours flock, or give each
machine its own.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import time
from pathlib import Path

from plora_hpo.errors import PloraError

OWNER_FILE = ".owner"


class RunDirInUse(PloraError):
    """Another live process owns the run directory."""


class RunDirOwner:
    """Hold ``run_dir`` for this process; use as a context manager or :meth:`acquire`/:meth:`release`."""

    def __init__(self, run_dir: Path) -> None:
        self.path = run_dir / OWNER_FILE
        self._fd: int | None = None

    def acquire(self) -> None:
        """Take the lock (the directory must exist).

        Raises:
            RunDirInUse: another live process holds it.
        """
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            owner = _describe(os.read(fd, 4096))
            os.close(fd)
            raise RunDirInUse(
                f"{self.path.parent} is in use by {owner}; wait for that sweep to finish or stop it, "
                "or pass another --run-dir"
            ) from None
        os.ftruncate(fd, 0)
        record = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.strftime("%Y-%m-%d %H:%M:%S")}
        os.pwrite(fd, json.dumps(record).encode(), 0)
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> RunDirOwner:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def _describe(raw: bytes) -> str:
    try:
        record = json.loads(raw.decode())
        return f"pid {record['pid']} on {record['host']} (started {record['started']})"
    except (ValueError, KeyError, TypeError):
        return "another process"
