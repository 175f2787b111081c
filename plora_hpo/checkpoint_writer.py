"""Checkpoint writes off the training loop: a device's saves and deletes, in order, on one thread.

A save costs the training loop only the copy of the adapter's state to host memory (the
caller's :func:`~plora_hpo.engine.adapter_state.capture`); serialising and writing it — seconds
for a large adapter — overlaps the next steps. Saves and deletes of a lineage happen in the
order they were asked for, so a finished trial's delete never races its last save.

Host memory is bounded: a save waits while more than ``max_pending_bytes`` of states are queued
(the device's checkpoint share then counts the wait, and the pacer saves less often). A failed
write (a full disk) is raised in the training loop at its next save, delete or :meth:`flush`;
the saves queued behind it are dropped (each lineage keeps its previous file), deletes still run.

Boundary: this module orders and runs :class:`~plora_hpo.checkpoints.CheckpointStore` calls; it
decides nothing about when to save.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable

from plora_hpo.checkpoints import CheckpointStore
from plora_hpo.engine.adapter_state import AdapterState
from plora_hpo.timeline import phase

log = logging.getLogger(__name__)

MAX_PENDING_BYTES = 4 << 30
"""Host bytes of captured states a device may queue before a save waits for the writer."""


def state_bytes(state: AdapterState) -> int:
    """Host bytes a captured state holds (weights and optimizer moments)."""
    tensors = [*state.weights.values(), *(t for moments in state.optimizer_state for t in moments.values())]
    return sum(t.numel() * t.element_size() for t in tensors)


class CheckpointWriter:
    """One device's queue of checkpoint writes and deletes, run by a daemon thread."""

    def __init__(self, name: str, max_pending_bytes: int = MAX_PENDING_BYTES) -> None:
        self.max_pending_bytes = max_pending_bytes
        self._jobs: deque[tuple[Callable[[], object], int]] = deque()
        self._pending_bytes = 0
        self._busy = False
        self._error: BaseException | None = None
        self._changed = threading.Condition()
        self._thread = threading.Thread(target=self._run, name=f"{name}-checkpoints", daemon=True)
        self._thread.start()

    def save(self, store: CheckpointStore, lineage: int, state: AdapterState, extra: dict[str, str]) -> None:
        """Queue ``state`` as the lineage's checkpoint; waits while the queue holds too many bytes."""
        size = state_bytes(state)
        with self._changed:
            self._raise_failure()
            while self._pending_bytes and self._pending_bytes + size > self.max_pending_bytes:
                self._changed.wait()
                self._raise_failure()
            self._put(lambda: store.save(lineage, state, extra), size)

    def delete(self, store: CheckpointStore, lineage: int) -> None:
        """Queue the removal of the lineage's checkpoint (after its queued saves)."""
        with self._changed:
            self._raise_failure()
            self._put(lambda: store.delete(lineage), 0)

    def flush(self) -> None:
        """Wait until everything queued is on disk; raises the first failed write."""
        with self._changed:
            while self._jobs or self._busy:
                self._changed.wait()
            self._raise_failure()

    def _put(self, job: Callable[[], object], size: int) -> None:
        self._jobs.append((job, size))
        self._pending_bytes += size
        self._changed.notify_all()

    def _raise_failure(self) -> None:
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def _run(self) -> None:
        while True:
            with self._changed:
                while not self._jobs:
                    self._changed.wait()
                job, size = self._jobs.popleft()
                self._busy = True
            failed: BaseException | None = None
            try:
                with phase("checkpoint-write"):  # on this thread, overlapping the training loop's phases
                    job()
            except BaseException as err:  # handed to the training loop, which decides
                failed = err
            del job  # the state it holds goes back now: its page-locked buffers are what later captures reuse
            with self._changed:
                self._busy = False
                self._pending_bytes -= size
                if failed is not None:
                    dropped = [(j, s) for j, s in self._jobs if s]
                    log.info("a checkpoint write failed; dropping the %d saves queued after it", len(dropped))
                    self._error = failed
                    self._pending_bytes -= sum(s for _, s in dropped)
                    self._jobs = deque((j, s) for j, s in self._jobs if not s)
                self._changed.notify_all()
