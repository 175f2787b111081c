"""``kill -9`` a running sweep, rerun it: finished work is kept, in-flight adapters resume from
their checkpoints, and the result equals an uninterrupted run."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import optuna
import pytest
from mlflow.tracking import MlflowClient
from optuna.trial import TrialState

from plora_hpo.cli import main

from .test_sweep_e2e import small_sweep

pytestmark = pytest.mark.slow

STEPS, EVERY = 12, 3


def load(run_dir, name="crash"):
    return optuna.load_study(study_name=f"{name}-synthetic", storage=f"sqlite:///{run_dir / 'optuna.db'}")


def wait_for_checkpoints(directory, n, proc, timeout=300.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, "the sweep ended before it could be killed"
        if len(list(directory.glob("t*.pt"))) >= n:
            return
        time.sleep(0.05)
    raise AssertionError(f"no {n} checkpoints in {directory} after {timeout} s")


def test_kill_9_then_rerun_resumes_in_flight_trials_from_checkpoints(tmp_path):
    sweep_file = small_sweep(
        tmp_path, name="crash", budget={"steps": STEPS}, train={"lr_schedule": "cosine", "checkpoint_every": EVERY}
    )
    reference_dir, run_dir = tmp_path / "reference", tmp_path / "runs"
    assert main(["sweep", str(sweep_file), "--run-dir", str(reference_dir)]) == 0

    log = (tmp_path / "killed.log").open("w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "plora_hpo.cli", "sweep", str(sweep_file), "--run-dir", str(run_dir)],
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        wait_for_checkpoints(run_dir / "checkpoints" / "crash-synthetic", 4, proc)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    assert [t.state for t in load(run_dir).trials] == [TrialState.RUNNING] * 4

    assert main(["sweep", str(sweep_file), "--run-dir", str(run_dir), "--resume"]) == 0

    trials = load(run_dir).trials
    originals, retries = trials[:4], trials[4:]
    assert [t.state for t in originals] == [TrialState.FAIL] * 4  # told FAIL once, never COMPLETE
    assert [t.state for t in retries] == [TrialState.COMPLETE] * 4
    assert not any(t.state == TrialState.RUNNING for t in trials)
    reference = {tuple(sorted(t.params.items())): t for t in load(reference_dir).trials}
    for retry in retries:
        original = originals[retry.user_attrs["retry_of"]]
        assert retry.params == original.params and retry.user_attrs["lineage"] == original.number
        assert retry.user_attrs["resumed_from_step"] in range(EVERY, STEPS, EVERY)  # not from step 0
        same = reference[tuple(sorted(retry.params.items()))]
        assert retry.value == same.value
        # to rounding: the killed subprocess ran its first steps with its own CPU thread count
        assert retry.user_attrs["final_train_loss"] == pytest.approx(same.user_attrs["final_train_loss"], rel=1e-5)
        assert retry.user_attrs["mlflow_run_id"] == original.user_attrs["mlflow_run_id"]  # one run per config

    client = MlflowClient(f"sqlite:///{run_dir / 'mlflow.db'}")
    runs = client.search_runs([client.get_experiment_by_name("crash").experiment_id])
    children = [r for r in runs if r.data.tags.get("plora.kind") == "trial"]
    parents = [r for r in runs if r.data.tags.get("plora.kind") == "sweep"]
    assert len(children) == 4 and {r.info.status for r in children} == {"FINISHED"}
    assert len(parents) == 1 and parents[0].info.status == "FINISHED"  # the killed sweep's run, continued
    for run in children:
        steps = [m.step for m in client.get_metric_history(run.info.run_id, "train_loss")]
        assert steps == list(range(1, STEPS + 1))  # the whole curve, the part before the crash included
    assert not list((run_dir / "checkpoints" / "crash-synthetic").glob("t*.pt"))  # removed once finished
