"""The journal: what is kept per run until it is complete on the server, and the complete copies
written from it to a local store."""

from __future__ import annotations

from mlflow.entities import Metric, Param, ViewType
from mlflow.tracking import MlflowClient

from plora_hpo._mlflow_ids import LOCAL_ID_TAG, RunIds
from plora_hpo._mlflow_journal import Journal
from plora_hpo._mlflow_ops import Op


def _create(placeholder: str, name: str, parent: str | None = None) -> Op:
    tags = {LOCAL_ID_TAG: placeholder} | ({} if parent is None else {"mlflow.parentRunId": parent})
    return Op("create", placeholder, {"run_name": name, "tags": tags, "start_time": 1_000})


def _terminate(run: str, status: str = "FINISHED") -> Op:
    return Op("terminate", run, {"status": status, "end_time": 2_000})


def _metric(run: str, step: int) -> Op:
    return Op("batch", run, {"metrics": [Metric("loss", float(step), 1_500, step)]})


def test_runs_the_server_got_only_in_part_are_copied_complete(tmp_path):
    ids = RunIds()
    journal = Journal(ids, active=True)
    parent = _create("pending-p", "sweep")
    journal.record(parent)
    ids.bind("pending-p", "server-p")  # the parent reached the server...
    journal.keep_to_end("pending-p")
    journal.record(Op("batch", "server-p", {"params": [Param("model", "m")]}))

    journal.record(_create("pending-done", "done", parent="pending-p"))
    ids.bind("pending-done", "server-done")
    journal.record(_metric("server-done", 1))
    journal.delivered(_terminate("server-done"))  # complete on the server: nothing to copy
    journal.record(_create("pending-half", "half", parent="pending-p"))
    ids.bind("pending-half", "server-half")
    for step in (1, 2):
        journal.record(_metric("server-half", step))
    journal.record(_create("pending-never", "never", parent="pending-p"))  # never on the server
    rejected = _metric("pending-never", 9)
    journal.record(rejected)
    journal.forget(rejected)
    journal.record(_terminate("pending-never", "FAILED"))
    journal.delivered(_terminate("server-p"))  # ...and its end too: kept anyway, its trials point to it

    store = MlflowClient(f"sqlite:///{tmp_path / 'fallback.db'}")
    experiment_id = store.create_experiment("fallback")
    copies = journal.copy_to(store, experiment_id)

    assert sorted(copies) == ["pending-half", "pending-never", "pending-p"]
    runs = {r.info.run_name: r for r in store.search_runs([experiment_id], run_view_type=ViewType.ALL)}
    assert runs["sweep"].data.tags["plora.server_run_id"] == "server-p" and runs["sweep"].data.params == {"model": "m"}
    half, never = runs["half"], runs["never"]
    assert half.data.tags["plora.server_run_id"] == "server-half"
    assert half.data.tags["mlflow.parentRunId"] == copies["pending-p"] == never.data.tags["mlflow.parentRunId"]
    assert [m.step for m in store.get_metric_history(half.info.run_id, "loss")] == [1, 2]
    assert "plora.server_run_id" not in never.data.tags and never.info.status == "FAILED"
    assert store.get_metric_history(never.info.run_id, "loss") == []
    assert journal.copy_to(store, experiment_id) == {}  # emptied


def test_an_inactive_journal_keeps_nothing(tmp_path):
    journal = Journal(RunIds(), active=False)
    journal.record(_create("pending-a", "a"))
    assert journal.copy_to(MlflowClient(f"sqlite:///{tmp_path / 'unused.db'}"), "0") == {}
