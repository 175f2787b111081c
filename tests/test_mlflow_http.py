"""The sweep's MLflow client gives up quickly on a dead server without changing the process's environment."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import pytest
from mlflow.exceptions import MlflowException

from plora_hpo._mlflow_http import REQUEST_LIMITS, BoundedClient, bounded_requests
from plora_hpo.tracking import SweepTracker
from tests.conftest import child_pythonpath
from tests.net import free_port

DEAD_SERVER_SECONDS = 10.0  # MLflow's defaults (7 retries, backoff factor 2) take minutes here


def _mlflow_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k.startswith("MLFLOW_HTTP_")}


def test_importing_the_tracker_leaves_the_environment_unchanged():
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")}
    script = (
        "import os; before = dict(os.environ); import plora_hpo.tracking, plora_hpo.cli; "
        "print(sorted(set(os.environ.items()) ^ set(before.items())))"
    )
    out = subprocess.run(
        [sys.executable, "-c", script],
        env={**env, "PYTHONPATH": child_pythonpath()},
        capture_output=True,
        text=True,
        check=True,
    )
    assert out.stdout.strip() == "[('MLFLOW_DISABLE_TELEMETRY', 'true')]"  # the CLI program's own choice only


def test_the_sweep_client_gives_up_quickly_on_a_dead_server_and_leaves_no_trace():
    before = _mlflow_env()
    tracker = SweepTracker(f"http://127.0.0.1:{free_port()}", "nowhere")
    assert isinstance(tracker.client, BoundedClient)
    start = time.monotonic()
    with pytest.raises(MlflowException):
        tracker.client.search_experiments(max_results=1)
    assert time.monotonic() - start < DEAD_SERVER_SECONDS
    assert _mlflow_env() == before


def test_limits_hold_while_any_bounded_call_runs_and_user_values_win(monkeypatch):
    for name in REQUEST_LIMITS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "99")
    inside, release = threading.Event(), threading.Event()

    def other_thread() -> None:
        with bounded_requests():
            inside.set()
            release.wait(5)

    worker = threading.Thread(target=other_thread)
    worker.start()
    assert inside.wait(5)
    with bounded_requests():
        pass  # this thread's call ends first: the other thread's limits stay
    assert os.environ["MLFLOW_HTTP_REQUEST_MAX_RETRIES"] == REQUEST_LIMITS["MLFLOW_HTTP_REQUEST_MAX_RETRIES"]
    assert os.environ["MLFLOW_HTTP_REQUEST_TIMEOUT"] == "99"
    release.set()
    worker.join()
    assert _mlflow_env() == {"MLFLOW_HTTP_REQUEST_TIMEOUT": "99"}
