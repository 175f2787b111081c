"""Checkpoint writes off the training loop: a device's saves in order on one thread, deletes beside them.

A save costs the training loop only the copy of the adapter's state to host memory (the
caller's :func:`~plora_hpo.engine.adapter_state.capture`); serialising and writing it — seconds
for a large adapter — overlaps the next steps. Saves and deletes of a lineage happen in the
order they were asked for, so a finished trial's delete never races its last save.

A delete starts once the saves queued before it are written, on a small pool of its own: removing
a checkpoint file of gigabytes takes up to tenths of a second, and the trials of a pack that ends
together finish close together. Removals run in parallel with each other and with the next saves;
a later save of the same lineage waits for its removal.

Host memory is bounded: a save waits while more than ``max_queued_bytes`` of states are queued.
The training loop asks :meth:`~plora_hpo.job_thread.JobThread.has_room` first and takes a save
that would wait at a later step instead. A failed write (a full disk) is raised in the training
loop at its next save or :meth:`flush`; the saves queued behind it are dropped (each lineage
keeps its previous file), deletes still run.

Boundary: this module orders and runs :class:`~plora_hpo.checkpoints.CheckpointStore` calls; it
decides nothing about when to save.
"""

from __future__ import annotations

import logging
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from plora_hpo.checkpoints import CheckpointStore
from plora_hpo.engine.adapter_state import AdapterState
from plora_hpo.job_thread import JobThread
from plora_hpo.timeline import phase

log = logging.getLogger(__name__)

MAX_QUEUED_BYTES = 4 << 30
"""Host bytes of captured states a device may queue before a save waits for the writer."""

DELETE_THREADS = 4
"""Checkpoint files a device removes at once."""


def state_bytes(state: AdapterState) -> int:
    """Host bytes a captured state holds (weights and optimizer moments)."""
    tensors = [*state.weights.values(), *(t for moments in state.optimizer_state for t in moments.values())]
    return sum(t.numel() * t.element_size() for t in tensors)


class CheckpointWriter(JobThread):
    """One device's queue of checkpoint writes, run by a daemon thread, and its removals."""

    def __init__(self, name: str, max_queued_bytes: int = MAX_QUEUED_BYTES) -> None:
        super().__init__(f"{name}-checkpoints", max_queued_bytes)
        self._deleter = ThreadPoolExecutor(DELETE_THREADS, thread_name_prefix=f"{name}-checkpoint-deletes")
        self._removals: dict[Path, Future[None]] = {}  # removals started and not yet waited for, by file

    def save(self, store: CheckpointStore, lineage: int, state: AdapterState, extra: dict[str, str]) -> None:
        """Queue ``state`` as the lineage's checkpoint; waits while the queue holds too many bytes."""
        size = state_bytes(state)

        def write() -> None:
            self._removed(store.path(lineage))  # the lineage's file asked away before this save is gone
            with phase("checkpoint-write"):  # on this thread, overlapping the training loop's phases
                store.save(lineage, state, extra)

        with self._changed:
            self._raise_failure()
            self._wait_for_room(size, raising=True)
            self._put(write, size)

    def delete(self, store: CheckpointStore, lineage: int) -> None:
        """Remove the lineage's checkpoint once its queued saves are written. Any thread may ask;
        a failed write or removal is left for the training loop's next save or :meth:`flush`."""

        def remove() -> None:
            with phase("checkpoint-delete"):
                store.delete(lineage)

        def start() -> None:  # on the writer thread: the saves queued before are on disk
            path = store.path(lineage)
            self._removed(path)
            with self._changed:
                self._removals[path] = self._deleter.submit(remove)

        with self._changed:  # holds no bytes: never waits for room
            self._put(start, 0)

    def flush(self) -> None:
        """Wait until every save queued is on disk and every removal done; raises the first failure."""
        try:
            self.drain()
        finally:
            with self._changed:
                paths = list(self._removals)
            for path in paths:
                self._removed(path)
        self.raise_failure()

    def _removed(self, path: Path) -> None:
        """Wait for the removal of ``path`` started earlier, if any; its failure is kept for the
        training loop as a failed write is."""
        with self._changed:
            removal = self._removals.get(path)
        if removal is None:
            return
        error = removal.exception()
        with self._changed:
            if self._removals.get(path) is removal:
                del self._removals[path]
            if error is not None and self._error is None:
                self._error = error

    def _failed(self) -> None:
        saves = [(job, size) for job, size in self._jobs if size]
        log.info("a checkpoint write failed; dropping the %d saves queued after it", len(saves))
        self.queued_bytes -= sum(size for _, size in saves)
        self._jobs = deque((job, size) for job, size in self._jobs if not size)
