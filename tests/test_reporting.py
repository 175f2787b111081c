"""MlflowReporter: the loss curve reaches MLflow while a trial trains, each step once."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from mlflow.tracking import MlflowClient

from plora_hpo.adapter import AdapterConfig
from plora_hpo.engine import PackStats
from plora_hpo.reporting import LIVE_SHARE, MlflowReporter
from plora_hpo.tracking import SweepTracker, default_tracking_uri
from plora_hpo.trials import TrialRequest


@dataclass
class _Record:
    request: TrialRequest
    run_id: str
    curve: list = field(default_factory=list)
    intermediate: list = field(default_factory=list)
    resumed_from: int = 0


def _one_trial(
    tmp_path: Path, clock: Callable[[], float] = time.monotonic
) -> tuple[SweepTracker, MlflowReporter, _Record, MlflowClient]:
    """A parent run on a real sqlite store, a reporter and one started trial run."""
    tracker = SweepTracker(default_tracking_uri(tmp_path), "live", artifact_root=tmp_path)
    tracker.start("live", {})
    reporter = MlflowReporter(tracker, lambda request: {"rank": request.config.rank}, clock=clock)
    request = TrialRequest("synthetic", 0, AdapterConfig(16, 16.0, 2e-4, 2))
    record = _Record(request, reporter.trial_started(request, None, "pack-0"))
    client = MlflowClient(tracker.tracking_uri)
    return tracker, reporter, record, client


def _adapter(tmp_path: Path) -> Path:
    """A folder for a finished trial's adapter."""
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text("{}")
    return adapter


def test_curve_is_live_while_training_and_logged_once(tmp_path: Path):
    tracker, reporter, record, client = _one_trial(tmp_path)

    record.curve += [(s, 3.0 - 0.1 * s, 2e-4) for s in (1, 2, 3)]
    reporter.trial_progress(record)  # handed to the reporter's thread: the training loop goes on
    reporter.flush()
    tracker.flush()
    assert client.get_run(record.run_id).info.status == "RUNNING"
    assert [m.step for m in client.get_metric_history(record.run_id, "train_loss")] == [1, 2, 3]

    record.curve += [(s, 3.0 - 0.1 * s, 2e-4) for s in (4, 5)]
    reporter.trial_progress(record)
    record.curve.append((6, 2.4, 2e-4))
    reporter.trial_completed(record, "pack-0", {"acc,none": 0.5}, _adapter(tmp_path), PackStats())
    tracker.finish()
    tracker.flush()
    assert [m.step for m in client.get_metric_history(record.run_id, "train_loss")] == [1, 2, 3, 4, 5, 6]
    assert client.get_run(record.run_id).info.status == "FINISHED"
    reporter.close()


def test_a_live_curve_s_delivery_is_a_timeline_phase_of_its_own_thread(tmp_path: Path, monkeypatch):
    """The thread shares the GIL with the training loop: the timeline shows when it works."""
    import json

    from plora_hpo.timeline import ENV

    timeline = tmp_path / "timeline.jsonl"
    monkeypatch.setenv(ENV, str(timeline))
    tracker, reporter, record, _ = _one_trial(tmp_path)
    record.curve += [(s, 3.0 - 0.1 * s, 2e-4) for s in (1, 2, 3)]
    handed = time.time()
    reporter.trial_progress(record)
    reporter.flush()
    rows = [r for r in map(json.loads, timeline.read_text().splitlines()) if r["phase"] == "mlflow-live"]
    assert len(rows) == 1 and rows[0]["thread"] == "mlflow-live-curves"
    assert handed <= rows[0]["start"] <= rows[0]["end"]
    reporter.close()
    tracker.finish()


def test_live_curves_leave_the_training_thread_and_a_finished_run_waits_for_one_in_flight(tmp_path: Path):
    tracker, reporter, record, client = _one_trial(tmp_path)

    sending, release, senders = threading.Event(), threading.Event(), []
    log_metrics = tracker.log_metrics

    def slow_store(run_id, rows, tags=None):  # the fault: a tracking store that takes its time
        senders.append(threading.current_thread().name)
        if threading.current_thread().name == "mlflow-live-curves" and not release.is_set():
            sending.set()
            assert release.wait(30)
        log_metrics(run_id, rows, tags)

    tracker.log_metrics = slow_store
    record.curve += [(s, 3.0 - 0.1 * s, 2e-4) for s in (1, 2, 3)]
    reporter.trial_progress(record)  # returns at once although the store is slow
    assert sending.wait(30)
    assert senders == ["mlflow-live-curves"]

    record.curve.append((4, 2.6, 2e-4))
    finisher = threading.Thread(
        target=reporter.trial_completed, args=(record, "pack-0", {"acc,none": 0.5}, _adapter(tmp_path), PackStats())
    )
    finisher.start()
    finisher.join(0.5)
    assert finisher.is_alive()  # the run's last report waits for the live curve being sent
    release.set()
    finisher.join(30)
    reporter.close()
    tracker.finish()
    tracker.flush()
    assert [m.step for m in client.get_metric_history(record.run_id, "train_loss")] == [1, 2, 3, 4]
    assert client.get_run(record.run_id).info.status == "FINISHED"


def test_live_curves_keep_to_their_share_of_the_process_time(tmp_path: Path, clock):
    """A store that takes 1 s per live curve: after one, a live update waits until it and the ones
    sent so far fit in LIVE_SHARE of the process's time; the run's last report logs every step."""
    tracker, reporter, record, client = _one_trial(tmp_path, clock=clock)
    log_metrics = tracker.log_metrics

    def slow_store(run_id, rows, tags=None):  # the fault: each call takes a second of the reporter's clock
        clock.now += 1.0
        log_metrics(run_id, rows, tags)

    tracker.log_metrics = slow_store

    def steps() -> list[int]:
        reporter.flush()
        tracker.flush()
        return [m.step for m in client.get_metric_history(record.run_id, "train_loss")]

    record.curve += [(s, 3.0 - 0.1 * s, 2e-4) for s in (1, 2)]
    reporter.trial_progress(record)
    assert steps() == [1, 2]
    record.curve.append((3, 2.7, 2e-4))
    clock.now = 2.0 / LIVE_SHARE - 1.0  # 1 s spent and 1 s more would be 2 s of 199 s: over the share
    reporter.trial_progress(record)
    assert steps() == [1, 2]
    clock.now = 2.0 / LIVE_SHARE + 1.0  # 2 s of 201 s: within it
    reporter.trial_progress(record)
    assert steps() == [1, 2, 3]

    record.curve.append((4, 2.6, 2e-4))
    clock.now += 1.0  # 3 s of 203 s would be over the share, but the last report logs every step
    reporter.trial_progress(record)
    reporter.trial_completed(record, "pack-0", {"acc,none": 0.5}, _adapter(tmp_path), PackStats())
    reporter.close()
    tracker.finish()
    assert steps() == [1, 2, 3, 4]


def test_a_trained_curve_goes_out_beside_its_scoring_whatever_the_share(tmp_path: Path, clock):
    """Once the live curves have used their share, a trial's curve at the end of its training still
    goes out on the live thread (the run's last report would log it anyway, after the scoring); it
    is not charged to the share, and the last report adds only what came after it."""
    tracker, reporter, record, client = _one_trial(tmp_path, clock=clock)
    log_metrics, sent = tracker.log_metrics, []

    def slow_store(run_id, rows, tags=None):  # each call takes a second of the reporter's clock
        sent.append((threading.current_thread().name, sorted({key for key, _, _ in rows})))
        clock.now += 1.0
        log_metrics(run_id, rows, tags)

    tracker.log_metrics = slow_store
    record.curve += [(s, 3.0 - 0.1 * s, 2e-4) for s in (1, 2)]
    reporter.trial_progress(record)
    reporter.flush()
    record.curve += [(s, 3.0 - 0.1 * s, 2e-4) for s in (3, 4)]
    reporter.trial_progress(record)  # the first second went to sending: one more is over the share, skipped
    reporter.flush()
    assert len(sent) == 1

    reporter.trial_trained(record)
    reporter.flush()
    assert [m.step for m in client.get_metric_history(record.run_id, "train_loss")] == [1, 2, 3, 4]
    assert sent[1] == ("mlflow-live-curves", ["learning_rate", "train_loss"])
    clock.now = 2.0 / LIVE_SHARE + 1.0  # 2 s of 201 s: within the share only if the trained curve was not charged
    other = _Record(record.request, reporter.trial_started(record.request, None, "pack-0"))
    other.curve.append((1, 3.0, 2e-4))
    reporter.trial_progress(other)
    reporter.flush()
    assert len(sent) == 3 and sent[2][0] == "mlflow-live-curves"

    reporter.trial_completed(record, "pack-0", {"acc,none": 0.5}, _adapter(tmp_path), PackStats())
    assert sent[3] == ("MainThread", ["acc", "pack_peak_memory_gib", "pack_tokens_per_second"])  # no curve rows
    reporter.close()
    tracker.finish()


def test_a_live_curve_the_store_rejects_is_logged_by_the_run_s_last_report(tmp_path: Path):
    tracker, reporter, record, client = _one_trial(tmp_path)
    log_metrics, rejected = tracker.log_metrics, []

    def rejecting_store(run_id, rows, tags=None):  # the fault: the store rejects the first live curve
        if threading.current_thread().name == "mlflow-live-curves" and not rejected:
            rejected.append(len(rows))
            raise RuntimeError("rejected (injected)")
        log_metrics(run_id, rows, tags)

    tracker.log_metrics = rejecting_store
    record.curve += [(s, 3.0 - 0.1 * s, 2e-4) for s in (1, 2, 3)]
    reporter.trial_progress(record)
    reporter.flush()
    assert rejected == [6]
    reporter.trial_completed(record, "pack-0", {"acc,none": 0.5}, _adapter(tmp_path), PackStats())
    reporter.close()
    tracker.finish()
    tracker.flush()
    assert [m.step for m in client.get_metric_history(record.run_id, "train_loss")] == [1, 2, 3]
