"""Work off the training loop: jobs that run in order on one daemon thread, failures handed back.

A device's checkpoint writes (:class:`~plora_hpo.checkpoint_writer.CheckpointWriter`) and the
recording of its finished trials (the adapter's files, its MLflow run, its trial's result) each
take seconds the GPU would otherwise wait through; the training loop queues them here and trains
on. A job that raises keeps its error for the loop, which decides at its next
:meth:`JobThread.raise_failure` or :meth:`JobThread.drain` as it would for an error of its own; the
jobs behind it still run unless a subclass drops them (:meth:`JobThread._failed`).

Boundary: the order, the thread and the hand-back of failures; what a job does is its caller's.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable

log = logging.getLogger(__name__)


class JobThread:
    """A queue of jobs run by one daemon thread named ``name``, in the order submitted.

    ``nbytes`` of a job: the host memory it holds until it has run. A job waits to be queued
    while its bytes would take the queue (the running job included) past ``max_queued_bytes``,
    unless nothing is queued: the training loop then waits for the thread instead of filling
    host memory.
    """

    def __init__(self, name: str, max_queued_bytes: int) -> None:
        self.max_queued_bytes = max_queued_bytes
        self._jobs: deque[tuple[Callable[[], object], int]] = deque()
        self.queued_bytes = 0
        self._busy = False
        self._error: BaseException | None = None
        self._changed = threading.Condition()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, job: Callable[[], object], nbytes: int = 0) -> None:
        """Queue ``job`` (after waiting for room); it runs after every job submitted before it."""
        with self._changed:
            self._wait_for_room(nbytes)
            self._put(job, nbytes)

    def has_room(self, nbytes: int) -> bool:
        """Whether a job of ``nbytes`` would be queued now without waiting (see the class)."""
        with self._changed:
            return not self._must_wait(nbytes)

    def idle(self) -> bool:
        """Whether no job runs and none waits."""
        with self._changed:
            return not self._jobs and not self._busy

    def raise_failure(self) -> None:
        """Raise the first error a job raised since the last look, if any (once); waits for nothing."""
        with self._changed:
            self._raise_failure()

    def drain(self) -> None:
        """Wait until every job submitted so far has run; then :meth:`raise_failure`."""
        with self._changed:
            while self._jobs or self._busy:
                self._changed.wait()
            self._raise_failure()

    # --- for subclasses, with the lock (``self._changed``) held ------------------------------------
    def _wait_for_room(self, nbytes: int, *, raising: bool = False) -> None:
        """Wait while ``nbytes`` more would exceed the bound; ``raising``: a failure ends the wait."""
        while self._must_wait(nbytes):
            self._changed.wait()
            if raising:
                self._raise_failure()

    def _must_wait(self, nbytes: int) -> bool:
        return bool(self.queued_bytes) and self.queued_bytes + nbytes > self.max_queued_bytes

    def _put(self, job: Callable[[], object], nbytes: int) -> None:
        self._jobs.append((job, nbytes))
        self.queued_bytes += nbytes
        self._changed.notify_all()

    def _raise_failure(self) -> None:
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def _failed(self) -> None:
        """After a job failed, before its error is handed back: a subclass may drop queued jobs
        (and their :attr:`queued_bytes`) here."""

    def _run(self) -> None:
        while True:
            with self._changed:
                while not self._jobs:
                    self._changed.wait()
                job, nbytes = self._jobs.popleft()
                self._busy = True
            failed: BaseException | None = None
            try:
                job()
            except BaseException as err:  # handed to the training loop, which decides
                failed = err
            del job  # what it holds (host copies of adapters, their page-locked buffers) goes back now
            with self._changed:
                self._busy = False
                self.queued_bytes -= nbytes
                if failed is not None:
                    self._failed()
                    if self._error is None:
                        self._error = failed
                    else:
                        log.info("a queued job failed after an earlier failure not yet handed back: %s", failed)
                self._changed.notify_all()
