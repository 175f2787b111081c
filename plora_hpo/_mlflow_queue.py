"""The outage queue: tracking calls are delivered in order, and never make training wait.

Boundary: when and in which order calls reach the tracking server, not what they do there (the
caller's ``send``) nor what is kept for a fallback copy (the :class:`Journal`). While the server
answers, every call is sent at once, in the calling thread. When a call fails and the server's health
probe fails too, *outage mode* begins: that call and every later one is appended to one in-memory
queue and returns at once; a background thread probes the server (``retry_interval_s``, doubling up
to ``max_retry_interval_s``) and, once it answers, delivers the queue in order, then returns to
direct delivery. A call that a healthy server rejects is raised to the caller when sent directly,
and dropped with a warning after a few tries when queued. The queue lives in memory: a process
killed during an outage loses what was queued, and artifact folders are queued by path, so they must
stay in place until delivered.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable

from plora_hpo._mlflow_ids import NeverCreated
from plora_hpo._mlflow_journal import Journal
from plora_hpo._mlflow_ops import Op
from plora_hpo.errors import first_line

_MAX_FAILURES = 3  # a queued call the (healthy) server rejects this often is dropped with a warning

log = logging.getLogger(__name__)


class DeliveryQueue:
    """Sends calls through ``send``; queues them while ``healthy`` says the server is away."""

    def __init__(
        self,
        send: Callable[[Op], None],
        healthy: Callable[[], bool],
        journal: Journal,
        *,
        server: str,
        retry_interval_s: float,
        max_retry_interval_s: float,
    ) -> None:
        self._send = send
        self._healthy = healthy
        self._journal = journal
        self._server = server  # for log messages
        self.retry_interval_s = retry_interval_s
        self.max_retry_interval_s = max_retry_interval_s
        self._state = threading.Lock()  # the queue and the outage flag; never held across network calls
        self._send_lock = threading.Lock()  # one delivery at a time, so calls arrive in order
        self._queue: deque[Op] = deque()
        self._outage_since: float | None = None
        self._thread: threading.Thread | None = None
        self._wake = threading.Event()
        self._stop = threading.Event()
        self.dropped: list[str] = []  # descriptions of calls the server rejected (not outages)

    @property
    def in_outage(self) -> bool:
        with self._state:
            return self._outage_since is not None

    @property
    def pending(self) -> int:
        with self._state:
            return len(self._queue)

    def submit(self, op: Op) -> None:
        """Send ``op`` now, or queue it behind earlier calls or during an outage.

        Raises what the server raises when it answers and rejects the call.
        """
        self._journal.record(op)
        if self._enqueue_if_waiting(op):
            return
        with self._send_lock:
            if self._enqueue_if_waiting(op):  # an outage began while we waited
                return
            try:
                self._send(op)
            except NeverCreated:  # already reported when its run's creation was dropped
                self._journal.forget(op)
                return
            except Exception:
                if self._healthy():  # the store rejected the call: the caller's problem
                    self._journal.forget(op)
                    raise
                with self._state:
                    self._begin_outage()
                    self._enqueue(op)
                return
            self._journal.delivered(op)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued call is delivered (True) or ``timeout`` seconds pass (False)."""
        self._wake.set()  # probe the server now rather than after the current back-off
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            with self._state:
                if not self._queue:
                    return True
            if deadline is not None and time.monotonic() >= deadline:
                return False
            time.sleep(0.05)

    def abandon(self) -> bool:
        """Stop delivering and empty the queue; whether any call was left undelivered."""
        self._stop.set()
        self._wake.set()
        thread = self._thread
        if thread is not None:
            thread.join(timeout=60)
        with self._send_lock, self._state:
            if not self._queue:  # delivered after all while stopping
                return False
            self._queue.clear()
            self._outage_since = None
            return True

    def _enqueue_if_waiting(self, op: Op) -> bool:
        """Queue ``op`` if earlier calls wait or the server is away; whether it was queued."""
        with self._state:
            if not self._queue and self._outage_since is None:
                return False
            self._enqueue(op)
            return True

    def _enqueue(self, op: Op) -> None:
        self._queue.append(op)
        if self._thread is None:
            self._stop.clear()
            self._thread = threading.Thread(target=self._deliver_loop, name="plora-mlflow-delivery", daemon=True)
            self._thread.start()

    def _begin_outage(self) -> None:
        if self._outage_since is None:
            self._outage_since = time.time()
            log.warning(
                "MLflow server %s is unreachable; training goes on and tracking calls are queued until it returns",
                self._server,
            )

    def _deliver_loop(self) -> None:
        delay = self.retry_interval_s
        while not self._stop.is_set():
            with self._state:
                if not self._queue:
                    self._thread = None
                    return
            if not self._healthy():
                self._wake.wait(delay)
                self._wake.clear()
                delay = min(delay * 2, self.max_retry_interval_s)
                continue
            delay = self.retry_interval_s
            self._drain()
        with self._state:
            self._thread = None

    def _drain(self) -> None:
        """Deliver queued calls in order while the server answers."""
        delivered = 0
        while not self._stop.is_set():
            with self._send_lock:
                with self._state:
                    if not self._queue:
                        if self._outage_since is not None:
                            log.warning(
                                "MLflow server %s is back; delivered %d queued tracking calls", self._server, delivered
                            )
                        self._outage_since = None
                        return
                    op = self._queue[0]
                try:
                    self._send(op)
                except NeverCreated:
                    self._drop(op, "its run was never created on the server")
                    continue
                except Exception as err:
                    if not self._healthy():
                        return  # still (or again) away: back to probing
                    op.failures += 1
                    if op.failures >= _MAX_FAILURES:
                        self._drop(op, first_line(err))
                    continue
                with self._state:
                    self._queue.popleft()
                self._journal.delivered(op)
                delivered += 1

    def _drop(self, op: Op, why: str) -> None:
        with self._state:
            self._queue.popleft()
            self.dropped.append(f"{op.kind} of run {op.run}: {why}")
        self._journal.forget(op)
        log.warning("MLflow rejected a queued %s call for run %s (%s); dropped it", op.kind, op.run, why)
