"""Tracking outages against a real ``mlflow server``: queue while it is down, deliver in order when it
returns, or write everything to a local fallback store when it never does."""

from __future__ import annotations

import json
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from mlflow.entities import ViewType
from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient

from plora_hpo.tracking import LOCAL_ID_TAG, PLACEHOLDER_PREFIX, SweepTracker
from tests.conftest import MlflowServer

pytestmark = pytest.mark.server

MAX_CALL_SECONDS = 5.0  # no tracking call may hold training up longer than this during an outage


@pytest.fixture
def server(tmp_path):
    root = tmp_path / "server"
    root.mkdir()
    srv = MlflowServer(root)
    srv.start()
    yield srv
    srv.stop()


def _adapter(tmp_path: Path, name: str) -> Path:
    path = tmp_path / "adapters" / name
    path.mkdir(parents=True)
    (path / "adapter_config.json").write_text(json.dumps({"name": name}))
    return path


def _loss(i: int, step: int) -> float:
    return 10.0 * i + 1.0 / step


def _runs(client: MlflowClient, experiment: str) -> list:
    exp = client.get_experiment_by_name(experiment)
    return client.search_runs([exp.experiment_id], run_view_type=ViewType.ALL, max_results=1000)


class _Timed:
    """Wraps a tracker so every call's duration is recorded (thread-safe)."""

    def __init__(self, tracker: SweepTracker) -> None:
        self.tracker = tracker
        self.durations: list[tuple[str, float]] = []
        self._lock = threading.Lock()

    def __getattr__(self, name):
        method = getattr(self.tracker, name)

        def timed(*args, **kwargs):
            start = time.monotonic()
            try:
                return method(*args, **kwargs)
            finally:
                with self._lock:
                    self.durations.append((name, time.monotonic() - start))

        return timed


def _log_trial(t: _Timed, tmp_path: Path, i: int, run_id: str | None, first_step: int) -> str:
    """A trial as a pack logs it: (create), metrics in small calls, tags twice, adapter, end."""
    if run_id is None:
        run_id = t.start_trial(f"t{i}", {"rank": 8 * (i + 1), "trial": i}, {"plora.trial_number": str(i)})
    for start in range(first_step, 101, 10):
        t.log_metrics(run_id, [("train_loss", _loss(i, s), s) for s in range(start, min(start + 10, 101))])
    t.set_tags(run_id, {"plora.phase": "first"})
    t.set_tags(run_id, {"plora.phase": "last"})  # order matters: the later value must win
    t.log_adapter(run_id, _adapter(tmp_path, f"t{i}"))
    t.end_trial(run_id)
    return run_id


def test_outage_is_queued_and_delivered_in_order_when_the_server_returns(server, tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger="plora_hpo")
    tracker = SweepTracker(
        server.uri, "outage", artifact_root=tmp_path / "run", retry_interval_s=0.2, max_retry_interval_s=0.5
    )
    tracker.check_reachable()
    parent = tracker.start("sweep", {"model": "smollm2-135m"})
    early = tracker.start_trial("t0", {"rank": 8, "trial": 0}, {"plora.trial_number": "0"})
    assert not early.startswith(PLACEHOLDER_PREFIX)  # created synchronously while the server is up
    tracker.log_metrics(early, [("train_loss", _loss(0, s), s) for s in range(1, 51)])
    with pytest.raises(MlflowException):  # a call the healthy server rejects is an error, not an outage
        tracker.log_metrics(early, [("bad" * 100, 1.0, 0)])
    assert tracker.pending == 0 and not tracker.in_outage

    server.stop()
    timed = _Timed(tracker)
    with ThreadPoolExecutor(4) as pool:  # packs log from worker threads
        futures = [pool.submit(_log_trial, timed, tmp_path, 0, early, 51)]
        futures += [pool.submit(_log_trial, timed, tmp_path, i, None, 1) for i in (1, 2, 3)]
        runs = [f.result(timeout=120) for f in futures]
    slowest = max(timed.durations, key=lambda d: d[1])
    assert slowest[1] < MAX_CALL_SECONDS, f"{slowest[0]} blocked {slowest[1]:.1f} s during the outage"
    assert tracker.in_outage and tracker.pending > 0
    assert all(r.startswith(PLACEHOLDER_PREFIX) for r in runs[1:])  # created while the server was away
    assert tracker.resolve(runs[1]) == runs[1]  # not delivered yet
    assert any("unreachable" in r.message for r in caplog.records)

    server.start()  # same port, same backend
    assert tracker.flush(timeout=60), "queued calls were not delivered after the server returned"
    assert not tracker.in_outage
    tracker.finish()
    assert tracker.fallback_uri is None and tracker.delivery_note() is None
    assert not (tmp_path / "run" / "mlflow-fallback").exists()
    assert any("is back" in r.message for r in caplog.records)

    client = MlflowClient(server.uri)
    assert tracker.parent_run_id == parent
    ids = [tracker.resolve(r) for r in runs]
    assert not any(i.startswith(PLACEHOLDER_PREFIX) for i in ids)
    assert sorted(r.info.run_id for r in _runs(client, "outage")) == sorted([parent, *ids])  # nothing twice
    for i, run_id in enumerate(ids):
        run = client.get_run(run_id)
        assert run.info.status == "FINISHED"
        assert run.data.tags["mlflow.parentRunId"] == parent
        assert run.data.tags["plora.phase"] == "last"
        assert run.data.params == {"rank": str(8 * (i + 1)), "trial": str(i)}
        history = client.get_metric_history(run_id, "train_loss")
        assert [m.step for m in history] == list(range(1, 101))
        assert [m.value for m in history] == [_loss(i, s) for s in range(1, 101)]
        assert [a.path for a in client.list_artifacts(run_id, "adapter")] == ["adapter/adapter_config.json"]
        local = client.download_artifacts(run_id, "adapter/adapter_config.json", str(tmp_path / f"dl{i}"))
        assert json.loads(Path(local).read_text()) == {"name": f"t{i}"}
    for placeholder in runs[1:]:  # a placeholder stored elsewhere can still be found by its tag
        found = client.search_runs(
            [client.get_experiment_by_name("outage").experiment_id],
            filter_string=f"tags.`{LOCAL_ID_TAG}` = '{placeholder}'",
        )
        assert [r.info.run_id for r in found] == [tracker.resolve(placeholder)]
    assert client.get_run(parent).info.status == "FINISHED"


def test_server_that_never_returns_leaves_everything_in_a_local_fallback_store(server, tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger="plora_hpo")
    run_dir = tmp_path / "run"
    tracker = SweepTracker(server.uri, "gone", artifact_root=run_dir, finish_grace_s=2.0, retry_interval_s=0.2)
    tracker.check_reachable()
    parent = tracker.start("sweep", {"model": "smollm2-135m"})
    complete = tracker.start_trial("t0", {"rank": 8}, {"plora.trial_number": "0"})  # all on the server
    tracker.log_metrics(complete, [("train_loss", _loss(0, s), s) for s in range(1, 11)])
    tracker.end_trial(complete)
    half = tracker.start_trial("t1", {"rank": 16}, {"plora.trial_number": "1"})  # half on the server
    tracker.log_metrics(half, [("train_loss", _loss(1, s), s) for s in range(1, 6)])

    server.stop()
    started = time.monotonic()
    tracker.log_metrics(half, [("train_loss", _loss(1, s), s) for s in range(6, 11)])
    tracker.log_adapter(half, _adapter(tmp_path, "t1"))
    tracker.end_trial(half)
    failed = tracker.start_trial("t2", {"rank": 32}, {"plora.trial_number": "2"})  # never on the server
    tracker.log_metrics(failed, [("train_loss", _loss(2, s), s) for s in range(1, 4)])
    tracker.set_tags(failed, {"plora.fail_reason": "non-finite loss"})
    tracker.end_trial(failed, "FAILED")
    assert time.monotonic() - started < 4 * MAX_CALL_SECONDS
    finish_started = time.monotonic()
    tracker.finish()
    assert time.monotonic() - finish_started < 30

    fallback = run_dir / "mlflow-fallback"
    assert tracker.fallback_uri == f"sqlite:///{(fallback / 'mlflow.db').resolve()}"
    note = tracker.delivery_note()
    assert note is not None and tracker.fallback_uri in note and "\n" not in note
    assert any(tracker.fallback_uri in r.message for r in caplog.records)  # reported at the end

    store = MlflowClient(tracker.fallback_uri)
    by_name = {r.info.run_name: r for r in _runs(store, "gone")}
    assert sorted(by_name) == ["sweep", "t1", "t2"]  # t0 reached the server complete: not copied
    copy_parent = by_name["sweep"]
    assert copy_parent.data.tags["plora.server_run_id"] == parent
    assert copy_parent.data.params == {"model": "smollm2-135m"}
    assert copy_parent.info.status == "FINISHED"

    t1 = by_name["t1"]
    assert t1.data.tags["plora.server_run_id"] == half
    assert t1.data.tags["mlflow.parentRunId"] == copy_parent.info.run_id
    assert t1.data.params == {"rank": "16"} and t1.info.status == "FINISHED"
    history = store.get_metric_history(t1.info.run_id, "train_loss")
    assert [(m.step, m.value) for m in history] == [(s, _loss(1, s)) for s in range(1, 11)]  # complete copy
    assert [a.path for a in store.list_artifacts(t1.info.run_id, "adapter")] == ["adapter/adapter_config.json"]
    assert (fallback / "mlartifacts").is_dir()

    t2 = by_name["t2"]
    assert "plora.server_run_id" not in t2.data.tags
    assert t2.data.tags[LOCAL_ID_TAG] == failed and tracker.fallback_ids[failed] == t2.info.run_id
    assert t2.data.tags["plora.fail_reason"] == "non-finite loss" and t2.info.status == "FAILED"
    assert [m.step for m in store.get_metric_history(t2.info.run_id, "train_loss")] == [1, 2, 3]

    server.start()  # what the server got before the outage is still there, and nothing more
    client = MlflowClient(server.uri)
    assert client.get_run(complete).info.status == "FINISHED"
    assert [m.step for m in client.get_metric_history(half, "train_loss")] == [1, 2, 3, 4, 5]


@pytest.mark.slow
def test_a_sweep_trains_through_an_outage_and_delivers_every_run_when_the_server_returns(server, tmp_path):
    """The server dies as the pack starts: the sweep trains, scores and exports all its trials
    anyway, and once the server is back every run arrives, complete and exactly once."""
    from plora_hpo import PackedObjective, PackedSweep, create_study, load_sweep
    from plora_hpo.trials import PackProgress

    from .test_sweep_e2e import small_sweep

    class KillServerWhenThePackStarts(PackProgress):
        def pack_started(self, pack_id: str, n_adapters: int, total_steps: int) -> None:
            server.stop()

    config = load_sweep(small_sweep(tmp_path, name="outage"))
    tracker = SweepTracker(server.uri, config.name, artifact_root=tmp_path / "runs", finish_grace_s=60)
    tracker.start(config.name, {"sweep": "outage"})
    study = create_study(config, "synthetic", f"sqlite:///{tmp_path / 'optuna.db'}")
    with PackedSweep(
        config, tracker=tracker, run_dir=tmp_path / "runs", progress=KillServerWhenThePackStarts()
    ) as sweep:
        study.optimize(PackedObjective(sweep, "synthetic"), n_trials=4, n_jobs=sweep.concurrency)
    assert [t.state.name for t in study.trials] == ["COMPLETE"] * 4  # training never waited for MLflow
    assert tracker.in_outage and tracker.pending > 0

    server.start()  # same port, same backend
    tracker.finish()
    assert tracker.pending == 0 and tracker.fallback_uri is None

    client = MlflowClient(server.uri)
    children = [r for r in _runs(client, "outage") if r.data.tags.get("plora.kind") == "trial"]
    assert len(children) == 4 and {r.info.status for r in children} == {"FINISHED"}
    by_local = {r.data.tags[LOCAL_ID_TAG]: r for r in children}
    for trial in study.trials:
        run_id = trial.user_attrs["mlflow_run_id"]
        run = by_local.get(run_id) or client.get_run(tracker.resolve(run_id))
        assert [m.step for m in client.get_metric_history(run.info.run_id, "train_loss")] == [1, 2, 3]
        assert run.data.metrics["acc"] == pytest.approx(trial.value)
        assert {a.path for a in client.list_artifacts(run.info.run_id, "adapter")} == {
            "adapter/adapter_config.json",
            "adapter/adapter_model.safetensors",
        }
