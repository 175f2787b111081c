"""The outage queue without a server: direct delivery while up, in-order delivery after an outage,
rejected calls raised or dropped."""

from __future__ import annotations

import threading

import pytest

from plora_hpo._mlflow_ids import NeverCreated, RunIds
from plora_hpo._mlflow_journal import Journal
from plora_hpo._mlflow_ops import Op
from plora_hpo._mlflow_queue import DeliveryQueue


class FakeServer:
    """Records what it receives; ``up`` false makes every call and health probe fail."""

    def __init__(self) -> None:
        self.up = True
        self.reject: set[str] = set()  # runs whose calls a healthy server refuses
        self.received: list[tuple[str, str]] = []
        self.threads: set[str] = set()

    def send(self, op: Op) -> None:
        if not self.up:
            raise ConnectionError("connection refused")
        if op.run in self.reject:
            raise ValueError(f"invalid run {op.run}")
        if op.run.startswith("pending-"):
            raise NeverCreated(op.run)
        self.threads.add(threading.current_thread().name)
        self.received.append((op.kind, op.run))

    def healthy(self) -> bool:
        return self.up


def _queue(server: FakeServer) -> DeliveryQueue:
    return DeliveryQueue(
        server.send,
        server.healthy,
        Journal(RunIds(), active=True),
        server="fake",
        retry_interval_s=0.01,
        max_retry_interval_s=0.05,
    )


def test_calls_are_sent_in_the_calling_thread_while_the_server_answers():
    server = FakeServer()
    queue = _queue(server)
    queue.submit(Op("batch", "r1"))
    assert server.received == [("batch", "r1")] and server.threads == {threading.current_thread().name}
    assert queue.pending == 0 and not queue.in_outage


def test_an_outage_queues_calls_and_delivers_them_in_order_once_the_server_is_back():
    server = FakeServer()
    queue = _queue(server)
    server.up = False
    for i in range(5):
        queue.submit(Op("batch", f"r{i}"))
    assert queue.in_outage and queue.pending == 5 and not queue.flush(timeout=0.2)
    server.up = True
    queue.submit(Op("terminate", "r0"))  # behind the queued ones, not before them
    assert queue.flush(timeout=10)
    assert server.received == [("batch", f"r{i}") for i in range(5)] + [("terminate", "r0")]
    assert not queue.in_outage and queue.dropped == []


def test_a_call_the_healthy_server_rejects_is_raised_when_direct_and_dropped_when_queued():
    server = FakeServer()
    queue = _queue(server)
    server.reject.add("bad")
    with pytest.raises(ValueError, match="invalid run"):
        queue.submit(Op("batch", "bad"))

    server.up = False
    queue.submit(Op("batch", "bad"))
    queue.submit(Op("batch", "pending-never"))  # its run's creation never reached the server
    queue.submit(Op("batch", "good"))
    server.up = True
    assert queue.flush(timeout=10)
    assert server.received == [("batch", "good")]
    assert [d.split(":")[0] for d in queue.dropped] == ["batch of run bad", "batch of run pending-never"]


def test_abandon_empties_the_queue_and_says_whether_calls_were_left():
    server = FakeServer()
    queue = _queue(server)
    assert not queue.abandon()
    server.up = False
    queue.submit(Op("batch", "r1"))
    assert queue.abandon() and queue.pending == 0 and not queue.in_outage
