"""Checkpoint writes off the training loop: a device's saves and deletes, in order, on one thread.

A save costs the training loop only the copy of the adapter's state to host memory (the
caller's :func:`~plora_hpo.engine.adapter_state.capture`); serialising and writing it — seconds
for a large adapter — overlaps the next steps. Saves and deletes of a lineage happen in the
order they were asked for, so a finished trial's delete never races its last save.

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

from plora_hpo.checkpoints import CheckpointStore
from plora_hpo.engine.adapter_state import AdapterState
from plora_hpo.job_thread import JobThread
from plora_hpo.timeline import phase

log = logging.getLogger(__name__)

MAX_QUEUED_BYTES = 4 << 30
"""Host bytes of captured states a device may queue before a save waits for the writer."""


def state_bytes(state: AdapterState) -> int:
    """Host bytes a captured state holds (weights and optimizer moments)."""
    tensors = [*state.weights.values(), *(t for moments in state.optimizer_state for t in moments.values())]
    return sum(t.numel() * t.element_size() for t in tensors)


class CheckpointWriter(JobThread):
    """One device's queue of checkpoint writes and deletes, run by a daemon thread."""

    def __init__(self, name: str, max_queued_bytes: int = MAX_QUEUED_BYTES) -> None:
        super().__init__(f"{name}-checkpoints", max_queued_bytes)

    def save(self, store: CheckpointStore, lineage: int, state: AdapterState, extra: dict[str, str]) -> None:
        """Queue ``state`` as the lineage's checkpoint; waits while the queue holds too many bytes."""
        size = state_bytes(state)

        def write() -> None:
            with phase("checkpoint-write"):  # on this thread, overlapping the training loop's phases
                store.save(lineage, state, extra)

        with self._changed:
            self._raise_failure()
            self._wait_for_room(size, raising=True)
            self._put(write, size)

    def delete(self, store: CheckpointStore, lineage: int) -> None:
        """Queue the removal of the lineage's checkpoint (after its queued saves). Any thread may
        ask; a failed write is left for the training loop's next save or :meth:`flush`."""

        def remove() -> None:
            with phase("checkpoint-write"):
                store.delete(lineage)

        with self._changed:  # holds no bytes: never waits for room
            self._put(remove, 0)

    def flush(self) -> None:
        """Wait until everything queued is on disk; raises the first failed write."""
        self.drain()

    def _failed(self) -> None:
        saves = [(job, size) for job, size in self._jobs if size]
        log.info("a checkpoint write failed; dropping the %d saves queued after it", len(saves))
        self.queued_bytes -= sum(size for _, size in saves)
        self._jobs = deque((job, size) for job, size in self._jobs if not size)
