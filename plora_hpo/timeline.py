"""Where a sweep's wall time goes: phases (training, evaluation, export, checkpoints, tracking, planner) per worker.

Off by default and then free (one ``if`` per phase). Set ``PLORA_HPO_TIMELINE`` to a file path and
every phase a worker thread enters is appended there as one JSON line::

    {"phase": "train", "start": 1764680000.12, "end": 1764680000.35, "thread": "plora-cuda:0"}

with wall-clock seconds (``time.time()``), so a benchmark in another process can place the phases
on its own clock. Phases nest (an MLflow call inside evaluation is still ``mlflow``): readers
should count the innermost phase at each instant. The GPU work of a phase is inside it because
the training step and evaluation read their results back to the host before they return.

A Triton kernel variant compiled while the timeline is on (after :func:`watch_triton_compiles`)
is a phase too, ``triton-compile``, with the kernel's name in ``kernel``: a step that compiles is
then told apart from a slow one. Variants compiled on a pool of threads (asynchronous compile
mode) are left out; the caller's own phase covers them.

So is a full collection of Python's garbage collector (after :func:`watch_collections`), ``gc``
on the thread that set it off, with ``generation`` and ``collected``; a faster one of a younger
generation is left out. A collection holds every thread of the process, so a training step that
one lands in launches nothing meanwhile.
"""

from __future__ import annotations

import gc
import json
import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

ENV = "PLORA_HPO_TIMELINE"
EXIT_PHASE = "exit"
"""The timeline's record of a ``plora-hpo`` process about to exit: whether it takes Python's
teardown (``teardown``) and which threads that waits for (``waits_for``)."""
_lock = threading.Lock()
_files: dict[str, object] = {}


def record(name: str, start: float, end: float, **details: object) -> None:
    """Append one finished phase (wall-clock seconds, and ``details`` as extra keys) to the
    timeline file, if one is set."""
    path = os.environ.get(ENV)
    if not path:
        return
    row = {"phase": name, "start": start, "end": end, "thread": threading.current_thread().name, **details}
    noted = _collections[:]  # collections seen since the last phase; those this call sets off wait for the next
    del _collections[: len(noted)]
    rows = [json.dumps(r) for r in (row, *noted)]
    with _lock:
        handle = _files.get(path)
        if handle is None:
            handle = _files[path] = open(path, "a", buffering=1)  # noqa: SIM115 - kept open for the process
        handle.write("".join(line + "\n" for line in rows))


def enabled() -> bool:
    """Whether phases are being recorded (what a caller checks before measuring a detail)."""
    return bool(os.environ.get(ENV))


@contextmanager
def phase(name: str) -> Iterator[dict[str, object]]:
    """Time the enclosed block as phase ``name`` when the timeline is on; what the block puts in
    the dict it is given is recorded with the phase."""
    details: dict[str, object] = {}
    if not enabled():
        yield details
        return
    start = time.time()
    try:
        yield details
    finally:
        record(name, start, time.time(), **details)


_compiling: dict[tuple[int, str], float] = {}  # (thread, variant key) -> when its compile started


def watch_triton_compiles() -> None:
    """Record every Triton kernel variant this process compiles from now on as a
    ``triton-compile`` phase, while the timeline is on; a no-op without Triton, or when the
    timeline is off. Hooks that were already installed keep being called first."""
    if not enabled():
        return
    try:
        from triton import knobs
        from triton.runtime import _async_compile
    except ImportError:  # no Triton, or one without compile hooks: nothing compiles that could be shown
        return
    before, after = knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook
    if getattr(before, "plora_timeline", False):
        return

    def variant(kwargs: dict) -> tuple[int, str]:
        return threading.get_ident(), f"{kwargs['fn'].name}:{kwargs['key']}"

    def starting(**kwargs: object) -> bool | None:
        skip = before(**kwargs) if before else None
        if not skip and _async_compile.active_mode.get() is None:
            _compiling[variant(kwargs)] = time.time()
        return skip

    def finished(**kwargs: object) -> bool | None:
        start = _compiling.pop(variant(kwargs), None)
        if start is not None:
            record("triton-compile", start, time.time(), kernel=kwargs["fn"].name)
        return after(**kwargs) if after else None

    starting.plora_timeline = True  # type: ignore[attr-defined]
    knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook = starting, finished


_collections: list[dict[str, object]] = []  # full collections not yet written (record() writes them)
_collection_started = [0.0]
SLOW_COLLECTION_S = 0.01  # a younger generation's collection at least this long is recorded too


def watch_collections() -> None:
    """Record the garbage collector's full collections (and any other taking at least
    ``SLOW_COLLECTION_S``) from now on as ``gc`` phases, while the timeline is on; once per process.

    The collector's callback only notes the collection: it may run inside :func:`record`, whose
    lock it must not take, so the next phase recorded writes it."""
    if enabled() and _on_collection not in gc.callbacks:
        del _collections[:]  # an earlier watch's, in this process (a caller's: a test, a notebook)
        gc.callbacks.append(_on_collection)


def _on_collection(stage: str, info: dict[str, int]) -> None:
    if not enabled():
        return
    now = time.time()
    if stage == "start":
        _collection_started[0] = now  # the GIL is held throughout: one collection at a time
        return
    start = _collection_started[0]
    if info["generation"] == 2 or now - start >= SLOW_COLLECTION_S:
        _collections.append(
            {
                "phase": "gc",
                "start": start,
                "end": now,
                "thread": threading.current_thread().name,
                "generation": info["generation"],
                "collected": info["collected"],
            }
        )
