"""Several processes serve one sweep through a shared PostgreSQL storage: ``plora-hpo sweep`` and
``plora-hpo worker`` processes train its trials together, a worker killed with ``kill -9`` has its
trials re-run from their checkpoints by the others, a preempted one (SIGTERM) hands them back."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import optuna
import pytest
from mlflow.tracking import MlflowClient
from optuna.trial import TrialState

from plora_hpo.cli import main

from .cli_process import start_cli
from .test_sweep_e2e import small_sweep

pytestmark = pytest.mark.slow

SPACE = {
    "rank": {"choices": [8, 16]},
    "alpha_multiplier": {"choices": [1]},
    "learning_rate": {"choices": [2e-5, 1e-4, 4e-4]},
    "batch_size": {"choices": [2]},
}  # 6 grid points


def wait_for(ready, proc: subprocess.Popen, log: Path, timeout: float = 300.0) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        assert proc.poll() is None, f"it ended early: {log.read_text()[-3000:]}"
        assert time.monotonic() < deadline, f"not ready after {timeout} s: {log.read_text()[-3000:]}"
        time.sleep(0.2)


def trials(storage: str, name: str) -> list[optuna.trial.FrozenTrial]:
    try:
        return optuna.load_study(study_name=f"{name}-synthetic", storage=storage).get_trials(deepcopy=False)
    except KeyError:  # not created yet
        return []


def finish(proc: subprocess.Popen, log: Path, timeout: float = 600.0) -> int:
    try:
        return proc.wait(timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        raise AssertionError(f"still running after {timeout} s: {log.read_text()[-3000:]}") from None


def table(ts: list[optuna.trial.FrozenTrial]) -> list[tuple]:
    """What a failed assertion shows of the trials."""
    return [(t.number, t.state.name, t.system_attrs.get("grid_id"), t.user_attrs.get("retry_of"),
             t.user_attrs.get("pack_id")) for t in ts]  # fmt: skip


def assert_each_grid_point_completed_once(done: list[optuna.trial.FrozenTrial]) -> None:
    grid_ids = sorted(t.system_attrs["grid_id"] for t in done)
    assert grid_ids == list(range(6)), grid_ids


def assert_runs_closed(mlflow_db: Path, name: str, n_children: int) -> None:
    client = MlflowClient(f"sqlite:///{mlflow_db}")
    runs = client.search_runs([client.get_experiment_by_name(name).experiment_id])
    parents = [r for r in runs if r.data.tags.get("plora.kind") == "sweep"]
    children = [r for r in runs if r.data.tags.get("plora.kind") == "trial"]
    assert len(parents) == 1 and parents[0].info.status == "FINISHED"
    assert len(children) == n_children and {r.info.status for r in children} == {"FINISHED"}
    assert {r.data.tags["mlflow.parentRunId"] for r in children} == {parents[0].info.run_id}  # one parent


def test_workers_on_a_shared_postgresql_storage_train_each_trial_once(tmp_path, postgres):
    storage, name = postgres.new_database(), "shared"
    # the sweep's own pack holds 2 of the 6 trials for 12 steps: time for the workers to load and join
    sweep_file = small_sweep(tmp_path, name=name, space=SPACE, budget={"steps": 12}, pack={"size": 2})
    run_dir = tmp_path / "runs"
    # no process dies here: heartbeats every 5 s, so that only 30 s without one would count a live
    # worker's trial as stale and retry it (a loaded 2-core machine has stalled past the 12 s of 2-s ones)
    sweep = start_cli(["sweep", str(sweep_file), "--run-dir", str(run_dir), "--storage", storage, "--device", "cpu",
                   "--heartbeat", "5"], tmp_path / "sweep.log")  # fmt: skip
    wait_for(lambda: len(trials(storage, name)) == 6, sweep, tmp_path / "sweep.log")  # the grid is queued
    join = ["worker", "--storage", storage, "--study", f"{name}-synthetic", "--heartbeat", "5"]
    workers = [start_cli(join, tmp_path / f"worker{i}.log") for i in range(2)]
    for proc, log in [(sweep, "sweep.log"), (workers[0], "worker0.log"), (workers[1], "worker1.log")]:
        assert finish(proc, tmp_path / log) == 0, (tmp_path / log).read_text()[-3000:]

    done = trials(storage, name)
    assert len(done) == 6 and {t.state for t in done} == {TrialState.COMPLETE}, table(done)[4:]  # no retries, extras
    assert_each_grid_point_completed_once(done)
    trained_by = {t.user_attrs["pack_id"].partition("@")[2] for t in done}
    assert len(trained_by) >= 2, table(done)  # the sweep process ("") and at least one worker took packs
    assert_runs_closed(run_dir / "mlflow.db", name, 6)
    # one record of the sweep's packs and of the joined workers' that had written theirs when it
    # ended (a worker still closing then keeps its own, in packs/<worker>/), on the sweep's clock
    record = json.loads((run_dir / "packs" / "packs.json").read_text())
    merged = {d.partition("@")[2] for d in record["summary"]["devices"]}
    assert "" in merged and merged <= trained_by
    assert all(s["start"] >= 0 for s in record["segments"])
    for label in trained_by - {""}:
        assert (run_dir / "packs" / label / "packs.json").is_file()


def test_a_killed_worker_s_trials_are_re_run_from_their_checkpoints(tmp_path, postgres):
    storage, name = postgres.new_database(), "killed"
    sweep_file = small_sweep(
        tmp_path, name=name, space=SPACE, budget={"steps": 12}, pack={"size": 2, "gather_seconds": 2},
        train={"checkpoint_every": 3},
    )  # fmt: skip
    run_dir = tmp_path / "runs"
    checkpoints = run_dir / "checkpoints" / f"{name}-synthetic"
    sweep = start_cli(["sweep", str(sweep_file), "--run-dir", str(run_dir), "--storage", storage, "--device", "cpu",
                   "--heartbeat", "1"], tmp_path / "sweep.log")  # fmt: skip
    wait_for(lambda: len(trials(storage, name)) == 6, sweep, tmp_path / "sweep.log")
    join = ["worker", "--storage", storage, "--study", f"{name}-synthetic", "--heartbeat", "1"]
    worker = start_cli(join, tmp_path / "worker.log")

    def worker_checkpointed() -> bool:  # both processes train a pack and the worker's has saved
        running = [t for t in trials(storage, name) if t.state == TrialState.RUNNING]
        return len(running) == 4 and len(list(checkpoints.glob("t*.pt"))) >= 4

    wait_for(worker_checkpointed, worker, tmp_path / "worker.log")
    os.killpg(worker.pid, signal.SIGKILL)
    worker.wait()
    assert finish(sweep, tmp_path / "sweep.log") == 0, (tmp_path / "sweep.log").read_text()[-3000:]

    all_trials = trials(storage, name)
    done = [t for t in all_trials if t.state == TrialState.COMPLETE]
    assert_each_grid_point_completed_once(done)
    retries = [t for t in done if "retry_of" in t.user_attrs]
    assert retries, "the killed worker's trials were not re-run"
    for retry in retries:
        original = next(t for t in all_trials if t.number == retry.user_attrs["retry_of"])
        assert original.state == TrialState.FAIL  # failed by heartbeat, never told twice
        assert retry.user_attrs["lineage"] == original.user_attrs["lineage"]
        assert retry.user_attrs["resumed_from_step"] > 0  # from its checkpoint, not from scratch
    assert_runs_closed(run_dir / "mlflow.db", name, 6)


def stopped_mid_sweep(tmp_path: Path, name: str, stop: signal.Signals, *, group: bool) -> tuple[Path, Path]:
    """A 12-step sweep of six trials in the CLI, sent ``stop`` (to its whole process group with
    ``group``, as a terminal's Ctrl-C is) once three checkpoints exist. It must exit 128 + ``stop``
    saying so, without a traceback, with no MLflow run left RUNNING. Returns its sweep file and run
    directory."""
    sweep_file = small_sweep(
        tmp_path, name=name, space=SPACE, budget={"steps": 12}, pack={"size": 3}, train={"checkpoint_every": 3}
    )
    run_dir = tmp_path / "runs"
    checkpoints = run_dir / "checkpoints" / f"{name}-synthetic"
    log = tmp_path / "sweep.log"
    sweep = start_cli(["sweep", str(sweep_file), "--run-dir", str(run_dir)], log)
    wait_for(lambda: len(list(checkpoints.glob("t*.pt"))) >= 3, sweep, log)
    (os.killpg if group else os.kill)(sweep.pid, stop)
    assert finish(sweep, log, timeout=120) == 128 + stop
    output = log.read_text()
    assert f"stopped by {stop.name}" in output and "Traceback" not in output, output[-3000:]
    client = MlflowClient(f"sqlite:///{run_dir / 'mlflow.db'}")
    runs = client.search_runs([client.get_experiment_by_name(name).experiment_id])
    assert runs and "RUNNING" not in {r.info.status for r in runs}  # trial runs KILLED, the sweep's too
    return sweep_file, run_dir


def test_sigterm_checkpoints_queues_and_closes_then_a_rerun_finishes(tmp_path):
    name = "preempted"
    sweep_file, run_dir = stopped_mid_sweep(tmp_path, name, signal.SIGTERM, group=False)
    storage = f"sqlite:///{run_dir / 'optuna.db'}"
    stopped = trials(storage, name)
    interrupted = [t for t in stopped if t.user_attrs.get("interrupted")]
    assert interrupted and all(t.state == TrialState.FAIL for t in interrupted)
    waiting = {
        t.user_attrs["retry_of"] for t in stopped if t.state == TrialState.WAITING and "retry_of" in t.user_attrs
    }
    assert waiting == {t.number for t in interrupted}  # each queued to resume

    assert main(["sweep", str(sweep_file), "--run-dir", str(run_dir)]) == 0
    done = [t for t in trials(storage, name) if t.state == TrialState.COMPLETE]
    assert_each_grid_point_completed_once(done)
    assert all(t.user_attrs["resumed_from_step"] > 0 for t in done if "retry_of" in t.user_attrs)
    assert_runs_closed(run_dir / "mlflow.db", name, 6)


def test_ctrl_c_reaches_the_whole_process_group_and_the_sweep_still_closes_its_runs(tmp_path):
    """A terminal's Ctrl-C signals every process of the foreground group: the sweep's helper
    processes (its MLflow store's) keep serving it while it checkpoints and closes its runs."""
    stopped_mid_sweep(tmp_path, "ctrl-c", signal.SIGINT, group=True)


@pytest.mark.parametrize("problem", ["unreachable", "no such study", "not a sweep", "other sweep file"])
def test_a_worker_refuses_bad_input_in_one_line(tmp_path, postgres, capsys, problem):
    storage = postgres.new_database()
    study = "mine-synthetic"
    argv = ["worker", "--storage", storage, "--study", study]
    if problem == "unreachable":
        argv[2] = "postgresql+psycopg2://nobody@127.0.0.1:9/none"
    elif problem == "not a sweep":
        optuna.create_study(study_name=study, storage=storage)
    elif problem == "other sweep file":
        from plora_hpo.cluster import describe_for_workers
        from plora_hpo.config import load_sweep

        config = load_sweep(small_sweep(tmp_path, name="mine", space=SPACE))
        described = optuna.create_study(study_name=study, storage=storage)
        describe_for_workers(described, config, "synthetic", run_dir=tmp_path, data_dir=None)
        described.set_user_attr("plora.n_trials", 6)
        (tmp_path / "other").mkdir()
        argv += ["--sweep-file", str(small_sweep(tmp_path / "other", name="mine", space=SPACE, seq_len=96))]
    before = optuna.get_all_study_names(storage) if problem != "unreachable" else []
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), err
    expected = {
        "unreachable": "cannot open the Optuna storage",
        "no such study": f"study {study!r} does not exist",
        "not a sweep": "was not started by `plora-hpo sweep`",
        "other sweep file": "seq_len is 96 here",
    }[problem]
    assert expected in err[0]
    if problem != "unreachable":
        assert optuna.get_all_study_names(storage) == before  # nothing created
