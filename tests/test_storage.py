"""The sweep's Optuna storage: heartbeats survive a storage error on Optuna's heartbeat thread, and
each heartbeat write is a phase of the timeline."""

from __future__ import annotations

import json
import logging
import time

import optuna
import sqlalchemy.exc
from optuna.storages import RDBStorage
from optuna.storages._heartbeat import HeartbeatThread

from plora_hpo.storage import open_storage
from plora_hpo.timeline import ENV


def last_heartbeat(storage: RDBStorage, trial_id: int):
    with storage.engine.connect() as conn:
        row = conn.execute(
            sqlalchemy.text("SELECT heartbeat FROM trial_heartbeats WHERE trial_id = :t"), {"t": trial_id}
        ).first()
    return None if row is None else row[0]


def test_a_failed_heartbeat_is_logged_and_the_thread_keeps_recording(tmp_path, monkeypatch, caplog):
    storage = open_storage(f"sqlite:///{tmp_path / 'optuna.db'}", heartbeat=1)
    study = optuna.create_study(study_name="s", storage=storage)
    trial_id = study.ask()._trial_id
    real = RDBStorage.record_heartbeat
    failures = []

    def disk_full_once(self, tid):  # the fault: the first write meets a full disk
        if not failures:
            failures.append(tid)
            raise sqlalchemy.exc.OperationalError("UPDATE trial_heartbeats", {}, Exception("database or disk is full"))
        real(self, tid)

    monkeypatch.setattr(RDBStorage, "record_heartbeat", disk_full_once)
    thread = HeartbeatThread(trial_id, storage)
    with caplog.at_level(logging.WARNING, logger="plora_hpo.storage"):
        thread.start()
        deadline = time.monotonic() + 10
        while last_heartbeat(storage, trial_id) is None and time.monotonic() < deadline:
            time.sleep(0.1)
        thread.join()

    assert failures == [trial_id]
    assert last_heartbeat(storage, trial_id) is not None  # the thread lived on and recorded the next one
    [record] = [r for r in caplog.records if r.name == "plora_hpo.storage"]
    assert "heartbeat not recorded" in record.getMessage() and "disk is full" in record.getMessage()


def test_heartbeats_are_timeline_phases_of_optuna_s_thread(tmp_path, monkeypatch):
    path = tmp_path / "timeline.jsonl"
    monkeypatch.setenv(ENV, str(path))
    storage = open_storage(f"sqlite:///{tmp_path / 'optuna.db'}", heartbeat=1)
    trial_id = optuna.create_study(study_name="s", storage=storage).ask()._trial_id
    thread = HeartbeatThread(trial_id, storage)
    thread.start()
    deadline = time.monotonic() + 10
    while last_heartbeat(storage, trial_id) is None and time.monotonic() < deadline:
        time.sleep(0.05)
    thread.join()

    beats = [row for row in map(json.loads, path.read_text().splitlines()) if row["phase"] == "heartbeat"]
    assert beats and all(row["start"] <= row["end"] for row in beats)
    assert {row["thread"] for row in beats} != {"MainThread"}  # Optuna's own thread, beside the training loop
