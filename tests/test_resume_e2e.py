"""``kill -9`` a running sweep, rerun it: finished work is kept, in-flight adapters resume from
their checkpoints, and the result equals an uninterrupted run."""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import optuna
import pytest
import torch
from mlflow.tracking import MlflowClient
from optuna.trial import TrialState

from plora_hpo.checkpoints import read_checkpoint
from plora_hpo.cli import main

from .test_sweep_e2e import REPO, small_sweep

pytestmark = pytest.mark.slow

STEPS, EVERY = 12, 3


def load(run_dir, name="crash"):
    return optuna.load_study(study_name=f"{name}-synthetic", storage=f"sqlite:///{run_dir / 'optuna.db'}")


@pytest.fixture(autouse=True)
def one_thread(monkeypatch):
    """Every sweep here, killed subprocess or in-process rerun, computes with one CPU thread: the
    same arithmetic, so a resumed trial's numbers can equal an uninterrupted one's bit for bit."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_kill_9_then_rerun_resumes_in_flight_trials_from_checkpoints(tmp_path):
    sweep_file = small_sweep(
        tmp_path, name="crash", budget={"steps": STEPS}, train={"lr_schedule": "cosine", "checkpoint_every": EVERY}
    )
    reference_dir, run_dir = tmp_path / "reference", tmp_path / "runs"
    assert main(["sweep", str(sweep_file), "--run-dir", str(reference_dir)]) == 0

    checkpoints = run_dir / "checkpoints" / "crash-synthetic"
    run_until_killed(sweep_file, run_dir, tmp_path / "killed.log", lambda: len(list(checkpoints.glob("t*.pt"))) >= 4)
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
        assert retry.user_attrs["final_train_loss"] == same.user_attrs["final_train_loss"]  # bitwise
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


def completed(run_dir) -> int:
    """COMPLETE trials in the run's study, read straight from its sqlite file while a sweep writes."""
    with sqlite3.connect(run_dir / "optuna.db", timeout=30) as db:
        try:
            return db.execute("SELECT count(*) FROM trials WHERE state = 'COMPLETE'").fetchone()[0]
        except sqlite3.OperationalError:  # the sweep has not created its tables yet
            return 0


def run_until_killed(sweep_file, run_dir, log_path, ready, *flags: str, timeout=300.0) -> None:
    """Start the CLI sweep in its own process group and ``kill -9`` the group once ``ready()``."""
    argv = ["-m", "plora_hpo.cli", "sweep", str(sweep_file), "--run-dir", str(run_dir), *flags]
    kill_9_when_ready(argv, log_path, ready, timeout=timeout)


def kill_9_when_ready(argv: list[str], log_path, ready, *, timeout: float = 300.0) -> None:
    """Run ``python argv`` in its own process group; ``kill -9`` the group once ``ready()``."""
    with log_path.open("w") as log:
        proc = subprocess.Popen(
            [sys.executable, *argv],
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env={**os.environ, "OMP_NUM_THREADS": "1"},  # the test process's thread count (conftest)
        )
        try:
            deadline = time.monotonic() + timeout
            while not ready():
                assert proc.poll() is None, f"it ended before it could be killed: {log_path.read_text()}"
                assert time.monotonic() < deadline, f"not ready after {timeout} s"
                time.sleep(0.05)
        finally:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def assert_each_grid_point_held_once(run_dir, name) -> None:
    """No two live or finished trials share a grid point (a retried original and its retry share one)."""
    trials = load(run_dir, name).trials
    retried = {t.user_attrs["retry_of"] for t in trials if "retry_of" in t.user_attrs}
    held = [t.system_attrs["grid_id"] for t in trials if t.number not in retried and "grid_id" in t.system_attrs]
    assert len(held) == len(set(held)), f"grid ids {held}"


def test_three_kill_9s_then_finish_equal_an_uninterrupted_run(tmp_path):
    name, steps = "kills", 12
    space = {
        "rank": {"choices": [8, 16]},
        "alpha_multiplier": {"choices": [1]},
        "learning_rate": {"choices": [2e-5, 4e-4]},
        "batch_size": {"choices": [2, 4]},
    }
    # 8 grid points, 4 at a time; the default cadence checkpoints every 3 of the 12 steps
    sweep_file = small_sweep(tmp_path, name=name, space=space, budget={"steps": steps})
    reference_dir, run_dir = tmp_path / "reference", tmp_path / "runs"
    assert main(["sweep", str(sweep_file), "--run-dir", str(reference_dir)]) == 0
    checkpoints = run_dir / "checkpoints" / f"{name}-synthetic"

    # killed mid-training, again right after the first trial finished, again after one more did
    run_until_killed(sweep_file, run_dir, tmp_path / "1.log", lambda: len(list(checkpoints.glob("t*.pt"))) >= 2)
    assert TrialState.RUNNING in [t.state for t in load(run_dir, name).trials]  # in-flight work to resume
    run_until_killed(sweep_file, run_dir, tmp_path / "2.log", lambda: completed(run_dir) >= 1)
    assert_each_grid_point_held_once(run_dir, name)
    done = completed(run_dir)
    run_until_killed(sweep_file, run_dir, tmp_path / "3.log", lambda: completed(run_dir) > done)
    assert_each_grid_point_held_once(run_dir, name)
    assert main(["sweep", str(sweep_file), "--run-dir", str(run_dir)]) == 0

    trials = load(run_dir, name).trials
    finished = [t for t in trials if t.state == TrialState.COMPLETE]
    assert len(finished) == 8 and sorted(t.system_attrs["grid_id"] for t in finished) == list(range(8))
    assert {t.state for t in trials if t not in finished} <= {TrialState.FAIL}  # each one retried
    reference = {tuple(sorted(t.params.items())): t for t in load(reference_dir, name).trials}
    assert len(reference) == 8
    for trial in finished:
        same = reference.pop(tuple(sorted(trial.params.items())))
        assert trial.value == same.value
        # bitwise, although a resumed adapter trains its later steps next to other pack members
        assert trial.user_attrs["final_train_loss"] == same.user_attrs["final_train_loss"]
    assert not reference  # every grid point trained, none twice

    client = MlflowClient(f"sqlite:///{run_dir / 'mlflow.db'}")
    runs = client.search_runs([client.get_experiment_by_name(name).experiment_id])
    children = {r.info.run_id: r for r in runs if r.data.tags.get("plora.kind") == "trial"}
    assert len(children) == 8 and {r.info.status for r in children.values()} == {"FINISHED"}
    for trial in finished:
        run = children[trial.user_attrs["mlflow_run_id"]]
        # one name per lineage: the run, and the run directory's entry for the adapter it stored
        assert (run_dir / "adapters" / run.info.run_name).resolve() == Path(trial.user_attrs["adapter_dir"])
        history = [m.step for m in client.get_metric_history(run.info.run_id, "train_loss")]
        assert history == list(range(1, steps + 1))  # one point per step across the kills
    assert not list(checkpoints.glob("t*.pt"))


def test_the_shipped_demo_checkpoints_its_trials(tmp_path):
    """The README's main job, killed once its first checkpoints land: each holds the adapter
    after a quarter of its 30 steps (the automatic cadence), ready for a rerun to resume."""
    run_dir = tmp_path / "demo"
    checkpoints = run_dir / "checkpoints" / "demo-synthetic"
    demo = REPO / "search_spaces" / "demo.yaml"
    run_until_killed(demo, run_dir, tmp_path / "demo.log", lambda: any(checkpoints.glob("t*.pt")), "--n-trials", "4")
    saved = [read_checkpoint(path)[0] for path in checkpoints.glob("t*.pt")]
    assert saved and all(state.steps_done == 7 and len(state.curve) == 7 for state in saved)
