"""Runs a killed sweep process left behind: orphans closed on the rerun, runs continued by it."""

from __future__ import annotations

from mlflow.tracking import MlflowClient

from plora_hpo.tracking import SweepTracker


def test_close_orphan_runs_of_a_killed_sweep(tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    killed = SweepTracker(uri, "demo")
    killed.start("demo", {})
    orphan = killed.start_trial("t0", {"rank": 8}, {})  # the process dies here: nothing is closed
    done = killed.start_trial("t1", {"rank": 8}, {})
    killed.end_trial(done)
    elsewhere = SweepTracker(uri, "another-sweep")
    elsewhere.start("another", {})

    rerun = SweepTracker(uri, "demo")
    parent = rerun.start("demo", {})
    live = rerun.start_trial("t2", {"rank": 8}, {})
    kept = killed.start_trial("t3", {"rank": 8}, {})
    closed = rerun.close_orphan_runs(keep={kept})

    assert sorted(closed) == sorted([killed.parent_run_id, orphan])
    client = MlflowClient(uri)
    for run_id in closed:
        run = client.get_run(run_id)
        assert run.info.status == "KILLED"
        assert "killed" in run.data.tags["plora.closed_reason"] and parent in run.data.tags["plora.closed_reason"]
    assert client.get_run(done).info.status == "FINISHED"
    for run_id in (parent, live, kept, elsewhere.parent_run_id):  # this sweep's own, kept, other experiments
        assert client.get_run(run_id).info.status == "RUNNING"
    assert rerun.close_orphan_runs(keep={kept}) == []


def test_a_rerun_continues_a_run_found_by_its_placeholder(tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    killed = SweepTracker(uri, "demo")
    killed.start("demo", {})
    trial = killed.start_trial("t0", {"rank": 8}, {})
    placeholder = MlflowClient(uri).get_run(trial).data.tags["plora.local_run_id"]  # as an outage left it
    killed.end_trial(trial, "FAILED")

    rerun = SweepTracker(uri, "demo")
    assert rerun.resume(killed.parent_run_id) and rerun.parent_run_id == killed.parent_run_id
    assert rerun.resume_trial(placeholder, {"plora.attempt": "2"})
    assert rerun.resolve(placeholder) == trial
    run = MlflowClient(uri).get_run(trial)
    assert run.info.status == "RUNNING" and run.data.tags["plora.attempt"] == "2"
    assert not rerun.resume_trial("pending-never-delivered", {})
    assert not SweepTracker(uri, "another-sweep").resume(killed.parent_run_id)  # another experiment
