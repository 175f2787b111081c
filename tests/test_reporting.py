"""MlflowReporter: the loss curve reaches MLflow while a trial trains, each step once."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from mlflow.tracking import MlflowClient

from plora_hpo.adapter import AdapterConfig
from plora_hpo.engine import PackStats
from plora_hpo.reporting import MlflowReporter
from plora_hpo.tracking import SweepTracker, default_tracking_uri
from plora_hpo.trials import TrialRequest


@dataclass
class _Record:
    request: TrialRequest
    run_id: str
    curve: list = field(default_factory=list)
    intermediate: list = field(default_factory=list)
    resumed_from: int = 0


def test_curve_is_live_while_training_and_logged_once(tmp_path: Path):
    tracker = SweepTracker(default_tracking_uri(tmp_path), "live", artifact_root=tmp_path)
    tracker.start("live", {})
    reporter = MlflowReporter(tracker, lambda request: {"rank": request.config.rank})
    request = TrialRequest("synthetic", 0, AdapterConfig(16, 16.0, 2e-4, 2))
    record = _Record(request, reporter.trial_started(request, None, "pack-0"))
    client = MlflowClient(tracker.tracking_uri)

    record.curve += [(s, 3.0 - 0.1 * s, 2e-4) for s in (1, 2, 3)]
    reporter.trial_progress(record)
    tracker.flush()
    assert client.get_run(record.run_id).info.status == "RUNNING"
    assert [m.step for m in client.get_metric_history(record.run_id, "train_loss")] == [1, 2, 3]

    record.curve += [(s, 3.0 - 0.1 * s, 2e-4) for s in (4, 5)]
    reporter.trial_progress(record)
    record.curve.append((6, 2.4, 2e-4))
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text("{}")
    reporter.trial_completed(record, "pack-0", {"acc,none": 0.5}, adapter, PackStats())
    tracker.finish()
    tracker.flush()
    assert [m.step for m in client.get_metric_history(record.run_id, "train_loss")] == [1, 2, 3, 4, 5, 6]
    assert client.get_run(record.run_id).info.status == "FINISHED"
