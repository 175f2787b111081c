"""JobThread: jobs off the training loop, in order on one thread, with failures handed back."""

from __future__ import annotations

import threading
import time

import pytest

from plora_hpo.job_thread import JobThread


def test_jobs_run_in_order_on_their_thread_while_the_caller_goes_on():
    jobs = JobThread("plora-test-finishing", max_queued_bytes=1 << 20)
    assert jobs.idle()
    gate, seen = threading.Event(), []
    jobs.submit(lambda: (gate.wait(10), seen.append((1, threading.current_thread().name))))
    jobs.submit(lambda: seen.append((2, threading.current_thread().name)))
    assert seen == [] and not jobs.idle()  # submit returned while the first job waits at its gate
    gate.set()
    jobs.drain()
    assert seen == [(1, "plora-test-finishing"), (2, "plora-test-finishing")] and jobs.idle()


def test_a_failed_job_is_raised_once_and_the_jobs_behind_it_still_run():
    jobs = JobThread("plora-test-finishing", max_queued_bytes=1 << 20)
    ran = []

    def fail():
        raise OSError("No space left on device")

    jobs.submit(fail)
    jobs.submit(lambda: ran.append("after"))
    with pytest.raises(OSError, match="No space left"):
        jobs.drain()
    assert ran == ["after"]
    jobs.drain()  # raised once: the thread serves on
    jobs.submit(lambda: ran.append("later"))
    jobs.drain()
    assert ran == ["after", "later"]


def test_raise_failure_reports_a_failed_job_without_waiting_for_the_rest():
    jobs = JobThread("plora-test-finishing", max_queued_bytes=1 << 20)
    gate = threading.Event()

    def fail():
        raise RuntimeError("the tracking server rejected the run")

    jobs.submit(fail)
    jobs.submit(lambda: gate.wait(30))  # still running when the failure is looked at
    deadline = time.monotonic() + 10
    with pytest.raises(RuntimeError, match="rejected"):
        while time.monotonic() < deadline:
            jobs.raise_failure()
            time.sleep(0.01)
    gate.set()
    jobs.drain()


def test_a_job_waits_to_be_queued_while_the_queue_holds_too_many_bytes():
    jobs = JobThread("plora-test-finishing", max_queued_bytes=100)
    gate = threading.Event()
    jobs.submit(lambda: gate.wait(30), nbytes=60)  # running, holding 60 bytes
    jobs.submit(lambda: None, nbytes=30)  # 90 bytes held: still room
    third = threading.Thread(target=jobs.submit, args=(lambda: None,), kwargs={"nbytes": 30})
    third.start()
    third.join(0.5)
    assert third.is_alive()  # 120 bytes would be held: it waits
    gate.set()
    third.join(10)
    assert not third.is_alive()
    jobs.drain()
    assert jobs.queued_bytes == 0
    jobs.submit(lambda: None, nbytes=500)  # larger than the bound, into an empty queue: goes alone
    jobs.drain()
