"""A local MLflow store served from a child process answers as the store itself would, in order,
from any thread, and fails loudly, never silently or by hanging, when the child is gone."""

from __future__ import annotations

import errno
import os
import pickle
import signal
import subprocess
import sys
import threading
import time

import pytest
from mlflow.entities import Metric, Param, RunTag
from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient

from plora_hpo._mlflow_process import ProcessClient, StoreProcessError, _portable, _rebuilt
from plora_hpo.errors import PloraError, disk_full
from plora_hpo.tracking import SweepTracker
from tests.conftest import REPO


@pytest.fixture
def store(tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = ProcessClient(uri)
    yield uri, client
    client.close()


def test_calls_return_what_the_store_holds(store):
    uri, client = store
    experiment = client.create_experiment("e")
    run = client.create_run(experiment, run_name="r", tags={"t": "1"})
    rows = [Metric("loss", 1.0 / (step + 1), 1000 + step, step) for step in range(1500)]
    client.log_batch(run.info.run_id, metrics=rows, params=[Param("rank", "8")], tags=[RunTag("state", "ok")])
    client.set_terminated(run.info.run_id, "FINISHED")

    direct = MlflowClient(uri)  # the same store, read in this process
    seen = client.get_run(run.info.run_id)
    assert seen.to_dictionary() == direct.get_run(run.info.run_id).to_dictionary()
    assert seen.info.status == "FINISHED" and seen.data.params == {"rank": "8"} and seen.data.tags["state"] == "ok"
    history = client.get_metric_history(run.info.run_id, "loss")
    assert [(m.step, m.value) for m in history] == [(m.step, m.value) for m in rows]
    assert [r.info.run_id for r in client.search_runs([experiment])] == [run.info.run_id]


def test_the_store_s_error_is_raised_with_its_type_and_message(store):
    uri, client = store
    with pytest.raises(MlflowException) as direct:
        MlflowClient(uri).get_run("0" * 32)
    with pytest.raises(MlflowException) as served:
        client.get_run("0" * 32)
    assert str(served.value) == str(direct.value)
    client.create_experiment("still answering")  # one error does not end the child


def test_calls_from_many_threads_all_land_in_the_order_each_thread_sent_them(store):
    uri, client = store
    run_id = client.create_run(client.create_experiment("e")).info.run_id
    errors: list[BaseException] = []

    def log(thread: int) -> None:
        try:
            for step in range(40):
                client.log_batch(run_id, metrics=[Metric(f"m{thread}", float(step), 1, step)])
        except BaseException as err:  # reported below
            errors.append(err)

    threads = [threading.Thread(target=log, args=(t,)) for t in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    for thread in range(6):
        history = MlflowClient(uri).get_metric_history(run_id, f"m{thread}")
        assert sorted(m.step for m in history) == list(range(40))


def test_submit_goes_on_at_once_and_wait_collects_in_any_order(store):
    _, client = store
    first = client.submit("create_experiment", "a")
    second = client.submit("create_experiment", "a")  # the store refuses a second one
    with pytest.raises(MlflowException, match="already exists"):
        client.wait(second)  # collects the first reply on the way
    assert first.done() and client.get_experiment(client.wait(first)).name == "a"


def test_an_argument_that_cannot_travel_fails_its_own_call_only(store):
    _, client = store
    run_id = client.create_run(client.create_experiment("e")).info.run_id
    with pytest.raises((pickle.PicklingError, AttributeError, TypeError)):
        client.log_batch(run_id, metrics=[lambda: 0])
    answers: list = []
    later = threading.Thread(target=lambda: answers.append(client.get_run(run_id)), daemon=True)
    later.start()
    later.join(30)  # a reply matched to the wrong call would leave this one waiting for ever
    assert not later.is_alive() and answers[0].info.run_id == run_id


def test_close_applies_what_was_sent_and_later_calls_fail(tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = ProcessClient(uri)
    run_id = client.create_run(client.create_experiment("e")).info.run_id
    client.submit("set_terminated", run_id, "KILLED")  # nobody waits for it
    client.close()
    assert client._process.returncode == 0
    assert MlflowClient(uri).get_run(run_id).info.status == "KILLED"
    with pytest.raises(StoreProcessError, match="closed"):
        client.get_run(run_id)
    client.close()  # idempotent


def test_a_killed_child_fails_the_waiting_and_the_later_calls(store):
    _, client = store
    client.create_experiment("e")
    os.kill(client._process.pid, signal.SIGKILL)  # fault injection
    client._process.wait(10)
    started = time.monotonic()
    with pytest.raises(StoreProcessError, match=r"ended \(exit code -9\)"):
        client.search_experiments()
    with pytest.raises(StoreProcessError, match="ended"):
        client.create_experiment("f")
    assert time.monotonic() - started < 5


def test_a_store_that_cannot_be_opened_fails_each_call_and_the_child_answers_on():
    client = ProcessClient("nosuchscheme://x")
    try:
        with pytest.raises(MlflowException) as direct:
            MlflowClient("nosuchscheme://x")
        for _ in range(2):  # made by the first call, the client's error is that call's, then the next one's
            with pytest.raises(StoreProcessError) as served:
                client.search_experiments()
            assert str(served.value) == f"{type(direct.value).__name__}: {direct.value}"
        assert client._process.poll() is None
    finally:
        client.close()


class _Unpicklable(Exception):
    def __init__(self, code: int, message: str) -> None:  # pickling keeps args, not this signature
        super().__init__(message)
        self.code = code


def test_an_error_that_cannot_travel_keeps_its_type_name_and_its_causes_messages():
    try:
        try:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        except OSError as cause:
            raise _Unpicklable(3, "writing the run failed") from cause
    except _Unpicklable as err:
        rebuilt = _rebuilt(*_portable(err))
    assert isinstance(rebuilt, StoreProcessError)
    assert str(rebuilt) == "_Unpicklable: writing the run failed"
    assert disk_full(rebuilt) == os.strerror(errno.ENOSPC)  # a full disk is still told as one


def test_the_tracker_opens_a_local_store_in_its_own_process_and_reports_a_bad_one(tmp_path):
    good = SweepTracker(f"sqlite:///{tmp_path / 'mlflow.db'}", "e", artifact_root=tmp_path)
    good.open_store()
    assert isinstance(good.client, ProcessClient) and good.client._process.pid != os.getpid()
    good.check_reachable()
    good.close()
    good.close()
    with pytest.raises(RuntimeError, match="closed"):
        good.client  # noqa: B018 - the property is the call under test

    (tmp_path / "file").write_text("")
    bad = SweepTracker(f"sqlite:///{tmp_path / 'file' / 'mlflow.db'}", "e")  # a folder that is a file
    bad.open_store()
    with pytest.raises(PloraError, match="cannot reach the MLflow tracking store"):
        bad.check_reachable()
    bad.close()


def test_a_script_without_a_main_guard_is_not_run_again_by_the_store_process(tmp_path):
    script = tmp_path / "script.py"
    script.write_text(  # as a bare checkout's script finds the package (the child must find it too)
        f"import sys; sys.path.insert(0, {str(REPO)!r})\n"
        "from pathlib import Path\n"
        "from plora_hpo.tracking import SweepTracker\n"
        f"tracker = SweepTracker('sqlite:///{tmp_path / 'mlflow.db'}', 'e', artifact_root=Path({str(tmp_path)!r}))\n"
        "tracker.start('sweep', {'n': 1})\n"
        "tracker.finish()\n"
        "tracker.close()\n"
        "print('ran')\n"
    )
    out = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["ran"]
    (run,) = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}").search_runs(["1"])
    assert run.info.status == "FINISHED"
