"""Where a sweep's wall time goes: phases (training, evaluation, export, checkpoints, tracking, planner) per worker.

Off by default and then free (one ``if`` per phase). Set ``PLORA_HPO_TIMELINE`` to a file path and
every phase a worker thread enters is appended there as one JSON line::

    {"phase": "train", "start": 1764680000.12, "end": 1764680000.35, "thread": "plora-cuda:0"}

with wall-clock seconds (``time.time()``), so a benchmark in another process can place the phases
on its own clock. Phases nest (an MLflow call inside evaluation is still ``mlflow``): readers
should count the innermost phase at each instant. The GPU work of a phase is inside it because
the training step and evaluation read their results back to the host before they return.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

ENV = "PLORA_HPO_TIMELINE"
_lock = threading.Lock()
_files: dict[str, object] = {}


def record(name: str, start: float, end: float) -> None:
    """Append one finished phase (wall-clock seconds) to the timeline file, if one is set."""
    path = os.environ.get(ENV)
    if not path:
        return
    line = json.dumps({"phase": name, "start": start, "end": end, "thread": threading.current_thread().name})
    with _lock:
        handle = _files.get(path)
        if handle is None:
            handle = _files[path] = open(path, "a", buffering=1)  # noqa: SIM115 - kept open for the process
        handle.write(line + "\n")


@contextmanager
def phase(name: str) -> Iterator[None]:
    """Time the enclosed block as phase ``name`` when the timeline is on."""
    if not os.environ.get(ENV):
        yield
        return
    start = time.time()
    try:
        yield
    finally:
        record(name, start, time.time())
