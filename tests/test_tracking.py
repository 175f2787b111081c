"""MLflow tracking against a real server: parent/child runs, per-step metrics, PEFT artifacts."""

from __future__ import annotations

import pytest
from mlflow.tracking import MlflowClient

from plora_hpo.errors import PloraError
from plora_hpo.tracking import SweepTracker, default_tracking_uri

pytestmark = pytest.mark.server


def test_parent_and_child_runs_on_a_real_server(mlflow_server, tmp_path):
    tracker = SweepTracker(mlflow_server.uri, "tracking-test")
    tracker.check_reachable()
    parent = tracker.start("sweep-1", {"model": "smollm2-135m", "seq_len": 64})
    child = tracker.start_trial("synthetic-t0", {"rank": 16, "alpha": 16.0}, {"plora.pack_id": "pack-0"})
    rows = [("train_loss", 3.0 - 0.1 * s, s) for s in range(1, 1501)]  # > 1000 rows
    tracker.log_metrics(child, rows, {"plora.state": "COMPLETE"})  # tags ride along in the same call
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text("{}")
    tracker.log_adapter(child, adapter)
    tracker.end_trial(child)
    tracker.finish()

    client = MlflowClient(mlflow_server.uri)
    run = client.get_run(child)
    assert run.data.tags["mlflow.parentRunId"] == parent
    assert run.data.params["rank"] == "16"
    assert run.data.tags["plora.state"] == "COMPLETE"
    history = client.get_metric_history(child, "train_loss")
    assert [m.step for m in history] == list(range(1, 1501))
    assert [a.path for a in client.list_artifacts(child, "adapter")] == ["adapter/adapter_config.json"]
    assert client.get_run(parent).info.status == "FINISHED" and run.info.status == "FINISHED"


def test_unreachable_server_is_one_clear_error():
    tracker = SweepTracker("http://127.0.0.1:9", "nowhere")
    with pytest.raises(PloraError, match="cannot reach the MLflow tracking store") as info:
        tracker.check_reachable()
    assert "\n" not in str(info.value)


def test_default_store_is_a_local_sqlite_file(tmp_path):
    uri = default_tracking_uri(tmp_path)
    assert uri.startswith("sqlite:///") and uri.endswith("mlflow.db")
