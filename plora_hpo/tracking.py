"""MLflow: one parent run per sweep, one child run per trial (adapter).

Everything goes through ``MlflowClient`` with explicit run ids, because trials of a pack are
logged from several threads and the fluent API's "active run" is thread-global.

Tracking outages (HTTP tracking servers only)
---------------------------------------------
Training never waits for MLflow. While the server answers, every call is delivered at once, in
the calling thread. When a call fails and the server's ``/health`` does not answer either, the
tracker enters *outage mode*: that call and every later one (run creation, params, metrics, tags,
artifacts, termination) is appended to one in-memory queue and returns at once; a background
thread probes ``/health`` (1 s, doubling to 15 s) and, once the server is back, delivers the queue
in order, then returns to direct delivery. HTTP calls are bounded (``MLFLOW_HTTP_REQUEST_*``
defaults below: one retry, 15 s timeout), so discovering an outage costs seconds, not MLflow's
default ~4 minutes of retries.

Run ids: a run created during an outage gets a placeholder id ``pending-<hex>`` at once; every
later call may use it. :meth:`SweepTracker.resolve` maps it to the server's id once delivered (it
returns the id unchanged until then). Every run also carries the tag ``plora.local_run_id`` with
that placeholder, so a placeholder stored elsewhere (e.g. an Optuna user attr written while the
server was down) can always be found with
``search_runs(filter_string="tags.`plora.local_run_id` = 'pending-…'")`` in the server or in the
fallback store. Runs created while the server is up get their real id synchronously.

Exactly once: metrics carry the timestamp of the original call (MLflow's SQL store ignores an
identical re-sent metric), params are re-sent with identical values, tags and termination are
idempotent, artifacts overwrite the same paths, and a run creation that may have reached the
server before the connection broke is looked up by its ``plora.local_run_id`` tag before it is
created again.

Fallback: :meth:`SweepTracker.finish` waits up to ``finish_grace_s`` for the queue to drain. If the
server is still away, every run with undelivered data (and the sweep's parent run) is written
*complete* — all its params, tags, metrics, artifacts and status, also what the server already
got — to a local MLflow store, ``<fallback_dir>/mlflow.db`` with artifacts in
``<fallback_dir>/mlartifacts`` (``fallback_dir`` defaults to ``<artifact_root>/mlflow-fallback``).
Copies carry ``plora.server_run_id`` when the server knows the run. :attr:`fallback_uri` and
:meth:`delivery_note` report it, and a warning is logged. Artifacts are queued by path: the
adapter directory must stay in place until delivered. The queue lives in memory: a process killed
during an outage loses what was queued.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
import time
import urllib.request
import uuid
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
# MLflow retries an HTTP call 7 times with exponential backoff (minutes) by default; the queue below
# retries instead, so a dead server costs one short attempt. Users can still override these.
os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "1")
os.environ.setdefault("MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR", "1")
os.environ.setdefault("MLFLOW_HTTP_REQUEST_BACKOFF_JITTER", "0.5")
os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "15")

from mlflow.entities import Metric, Param, RunTag, ViewType
from mlflow.tracking import MlflowClient

from plora_hpo.errors import PloraError, first_line

DEFAULT_RUN_DIR = Path("plora_runs")
PLACEHOLDER_PREFIX = "pending-"
LOCAL_ID_TAG = "plora.local_run_id"
_MAX_FAILURES = 3  # a call the (healthy) server rejects this often is dropped with a warning

log = logging.getLogger(__name__)


def default_tracking_uri(run_dir: Path = DEFAULT_RUN_DIR) -> str:
    """A local sqlite store next to the Optuna study: ``sqlite:///plora_runs/mlflow.db``."""
    return f"sqlite:///{(run_dir / 'mlflow.db').resolve()}"


def _now_ms() -> int:
    return int(time.time() * 1000)


def _chunks(items: list, size: int) -> Iterable[list]:
    for start in range(0, len(items), size):
        yield items[start : start + size]


@dataclass
class _Op:
    """One tracking call, kept until delivered (and, for fallback copies, until its run is done)."""

    kind: str  # "create" | "batch" | "artifacts" | "terminate"
    run: str  # local run id: the server id, or a placeholder while undelivered
    payload: dict[str, Any] = field(default_factory=dict)
    attempts: int = 0
    failures: int = 0
    delivered: bool = False


class _Dropped(Exception):
    """The run this call belongs to was never created on the server (its creation was rejected)."""


class SweepTracker:
    """Logs a sweep to MLflow; open with :meth:`start`, close with :meth:`finish`."""

    def __init__(
        self,
        tracking_uri: str,
        experiment: str,
        artifact_root: Path | None = None,
        *,
        fallback_dir: Path | None = None,
        finish_grace_s: float = 30.0,
        retry_interval_s: float = 1.0,
        max_retry_interval_s: float = 15.0,
    ) -> None:
        self.tracking_uri = tracking_uri
        self.experiment = experiment
        self.artifact_root = artifact_root
        self.experiment_id: str | None = None
        self.fallback_dir = fallback_dir or (artifact_root or DEFAULT_RUN_DIR) / "mlflow-fallback"
        self.fallback_uri: str | None = None
        self.finish_grace_s = finish_grace_s
        self.retry_interval_s = retry_interval_s
        self.max_retry_interval_s = max_retry_interval_s
        self._remote = tracking_uri.startswith(("http://", "https://"))
        self._parent_local: str | None = None
        self._state = threading.RLock()  # queue, journal, id map; never held across network calls
        self._send_lock = threading.Lock()  # one delivery at a time, so calls arrive in order
        self._queue: deque[_Op] = deque()
        self._journal: dict[str, list[_Op]] = {}  # local run id → its calls, until the run is delivered
        self._ids: dict[str, str] = {}  # placeholder → server run id
        self._local: dict[str, str] = {}  # server run id → placeholder (the journal's key)
        self.fallback_ids: dict[str, str] = {}  # placeholder → run id in the fallback store
        self._dead_runs: set[str] = set()
        self._outage_since: float | None = None
        self._thread: threading.Thread | None = None
        self._wake = threading.Event()
        self._stop = threading.Event()
        self.dropped: list[str] = []  # descriptions of calls the server rejected (not outages)
        self.fallback_runs = 0

    @functools.cached_property
    def client(self) -> MlflowClient:
        """Created on first use: a sqlite store is only written once the sweep is known to be valid."""
        return MlflowClient(tracking_uri=self.tracking_uri)

    # --- reachability -----------------------------------------------------------------------
    def check_reachable(self) -> None:
        """Fail early (before any study or run exists) if the tracking store cannot be used.

        HTTP servers are probed once at ``/health`` (MLflow's client would retry for minutes).
        """
        try:
            if self._remote:
                with urllib.request.urlopen(f"{self.tracking_uri.rstrip('/')}/health", timeout=10):
                    pass
            self.client.search_experiments(max_results=1)
        except Exception as err:  # MLflow raises many types for a dead store
            raise PloraError(
                f"cannot reach the MLflow tracking store {self.tracking_uri!r} ({first_line(err)}); "
                "start the server or pass --mlflow-uri with a reachable store"
            ) from None

    def _healthy(self) -> bool:
        """Whether an HTTP server answers ``/health`` within 2 s (local stores are always healthy)."""
        if not self._remote:
            return True
        try:
            with urllib.request.urlopen(f"{self.tracking_uri.rstrip('/')}/health", timeout=2) as r:
                return r.status == 200
        except Exception:
            return False

    @property
    def in_outage(self) -> bool:
        """Whether calls are being queued because the server stopped answering."""
        with self._state:
            return self._outage_since is not None

    @property
    def pending(self) -> int:
        """Calls queued for delivery."""
        with self._state:
            return len(self._queue)

    # --- ids --------------------------------------------------------------------------------
    @property
    def parent_run_id(self) -> str | None:
        """The sweep's parent run: the server id once known, else its placeholder."""
        return None if self._parent_local is None else self.resolve(self._parent_local)

    def resolve(self, run_id: str) -> str:
        """The server's id for ``run_id`` (a placeholder from an outage), or ``run_id`` itself until delivered."""
        with self._state:
            return self._ids.get(run_id, run_id)

    def _ensure_experiment(self) -> str:
        if self.experiment_id is not None:
            return self.experiment_id
        self.experiment_id = self._get_or_create_experiment(self.client, self.experiment, self._artifact_location())
        return self.experiment_id

    def _artifact_location(self) -> str | None:
        root = self.artifact_root
        if root is None and self.tracking_uri.startswith("sqlite:///"):
            root = Path(self.tracking_uri.removeprefix("sqlite:///")).parent  # beside the store, not in cwd
        return None if root is None else (root / "mlartifacts").resolve().as_uri()

    @staticmethod
    def _get_or_create_experiment(client: MlflowClient, name: str, location: str | None) -> str:
        found = client.get_experiment_by_name(name)
        if found is not None:
            return found.experiment_id
        return client.create_experiment(name, artifact_location=location)

    # --- public logging API -------------------------------------------------------------------
    def start(self, sweep_name: str, params: dict[str, Any], tags: dict[str, str] | None = None) -> str:
        if self._remote:
            try:
                self._ensure_experiment()
            except Exception:
                if self._healthy():
                    raise
                # created with the parent run once the server is back
        self._parent_local = self._create(sweep_name, {"plora.kind": "sweep", **(tags or {})})
        run_id = self.resolve(self._parent_local)
        self._log_params(run_id, params)
        return run_id

    def start_trial(self, run_name: str, params: dict[str, Any], tags: dict[str, str]) -> str:
        assert self._parent_local is not None, "call start() first"
        run_id = self.resolve(
            self._create(run_name, {"mlflow.parentRunId": self._parent_local, "plora.kind": "trial", **tags})
        )  # the server id when created synchronously
        self._log_params(run_id, params)
        return run_id

    def _create(self, run_name: str, tags: dict[str, str]) -> str:
        placeholder = f"{PLACEHOLDER_PREFIX}{uuid.uuid4().hex}"
        op = _Op(
            "create",
            placeholder,
            {"run_name": run_name, "tags": {LOCAL_ID_TAG: placeholder, **tags}, "start_time": _now_ms()},
        )
        self._submit(op)
        return placeholder

    def _log_params(self, run_id: str, params: dict[str, Any]) -> None:
        items = [Param(k, str(v)[:6000]) for k, v in params.items()]
        for part in _chunks(items, 100):  # MLflow's per-call limit for params
            self._submit(_Op("batch", run_id, {"params": part}))

    def log_metrics(self, run_id: str, rows: Iterable[tuple[str, float, int]]) -> None:
        """Log ``(key, value, step)`` rows in batches of ≤ 1000 (MLflow's per-call limit)."""
        now = _now_ms()
        metrics = [Metric(k, float(v), now, int(s)) for k, v, s in rows]
        for part in _chunks(metrics, 1000):
            self._submit(_Op("batch", run_id, {"metrics": part}))

    def set_tags(self, run_id: str, tags: dict[str, str]) -> None:
        items = [RunTag(k, str(v)) for k, v in tags.items()]
        for part in _chunks(items, 100):
            self._submit(_Op("batch", run_id, {"tags": part}))

    def log_adapter(self, run_id: str, adapter_dir: Path) -> None:
        """The PEFT adapter directory becomes the run's ``adapter/`` artifact."""
        self.log_folder(run_id, adapter_dir, "adapter")

    def log_folder(self, run_id: str, folder: Path, artifact_path: str) -> None:
        """Every file of ``folder`` becomes an artifact of the run under ``artifact_path``."""
        self._submit(_Op("artifacts", run_id, {"path": str(folder), "artifact_path": artifact_path}))

    def end_trial(self, run_id: str, status: str = "FINISHED") -> None:
        self._submit(_Op("terminate", run_id, {"status": status, "end_time": _now_ms()}))

    def finish(self, status: str = "FINISHED") -> None:
        """End the parent run; wait up to ``finish_grace_s`` for queued calls, else write the fallback store."""
        if self._parent_local is None:
            return
        self._submit(_Op("terminate", self._parent_local, {"status": status, "end_time": _now_ms()}))
        if self._remote and not self.flush(self.finish_grace_s):
            self._write_fallback()

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued call is delivered (True) or ``timeout`` seconds pass (False)."""
        self._wake.set()  # probe the server now rather than after the current back-off
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            with self._state:
                if not self._queue:
                    return True
            if deadline is not None and time.monotonic() >= deadline:
                return False
            time.sleep(0.05)

    def delivery_note(self) -> str | None:
        """One line for the end-of-sweep output when tracking data did not reach the server, else None."""
        if self.fallback_uri is None:
            return None
        return (
            f"MLflow server {self.tracking_uri} was unreachable at the end of the sweep: {self.fallback_runs} "
            f"run(s) were saved complete to the local store {self.fallback_uri} "
            f"(artifacts in {self.fallback_dir / 'mlartifacts'}); "
            f"view them with `mlflow ui --backend-store-uri {self.fallback_uri}`"
        )

    def close_orphan_runs(self, keep: set[str], reason: str | None = None) -> list[str]:
        """Close runs of this experiment left RUNNING by a killed sweep process; returns their ids.

        Runs in ``keep`` (ids or placeholders) and every run this tracker created stay open. Closed
        runs get status KILLED and the tag ``plora.closed_reason``. Call it once at the start of a
        rerun, after :meth:`start`; with the server away it logs a warning and closes nothing.
        """
        with self._state:
            own = set(self._ids.values()) | set(self._ids)
        keep_ids = {self.resolve(k) for k in keep} | set(keep) | own
        if self.parent_run_id is not None:
            keep_ids.add(self.parent_run_id)
        reason = reason or (
            "left RUNNING by a sweep process that ended without closing it (killed?); "
            f"closed by the rerun {self.parent_run_id or ''}".rstrip()
        )
        try:
            experiment_id = self._ensure_experiment()
            orphans: list[str] = []
            token = None
            while True:  # collect first: closing runs while paging a status filter would skip some
                page = self.client.search_runs(
                    [experiment_id],
                    filter_string="attributes.status = 'RUNNING'",
                    run_view_type=ViewType.ACTIVE_ONLY,
                    max_results=1000,
                    page_token=token,
                )
                orphans += [
                    r.info.run_id
                    for r in page
                    if r.info.run_id not in keep_ids and r.data.tags.get(LOCAL_ID_TAG) not in keep_ids
                ]
                token = page.token
                if not token:
                    break
            for run_id in orphans:
                self.client.set_tag(run_id, "plora.closed_reason", reason)
                self.client.set_terminated(run_id, status="KILLED")
        except Exception:
            if self._healthy():
                raise
            log.warning("MLflow server %s unreachable: runs left open by a killed sweep stay open", self.tracking_uri)
            return []
        return orphans

    # --- continuing runs of a killed process -------------------------------------------------------
    def resume(self, run_id: str) -> bool:
        """Continue an earlier process's parent run (set RUNNING again) instead of :meth:`start`.

        False if it cannot be continued (another experiment or store, deleted, an outage placeholder that
        never reached the server, or the server is away): the caller starts a new one.
        """
        if not self._reopen(run_id):
            return False
        self._parent_local = run_id
        return True

    def resume_trial(self, run_id: str, tags: dict[str, str]) -> bool:
        """Continue a trial's run (a crashed predecessor's) with updated tags; False as for :meth:`resume`."""
        if not self._reopen(run_id):
            return False
        self.set_tags(run_id, tags)
        return True

    def _reopen(self, run_id: str) -> bool:
        try:
            if run_id.startswith(PLACEHOLDER_PREFIX) and run_id not in self._ids:
                # created during an outage by an earlier process: find it by its tag (None if never delivered)
                found = self.client.search_runs(
                    [self._ensure_experiment()], filter_string=f"tags.`{LOCAL_ID_TAG}` = '{run_id}'", max_results=1
                )
                if not found:
                    return False
                with self._state:
                    self._ids[run_id] = found[0].info.run_id
                    self._local[found[0].info.run_id] = run_id
            run = self.client.get_run(self.resolve(run_id))
            if run.info.experiment_id != self._ensure_experiment() or run.info.lifecycle_stage != "active":
                return False
            self.client.update_run(run.info.run_id, status="RUNNING")
        except Exception as err:  # gone, or the server is away: a new run is created instead
            log.warning("cannot continue MLflow run %s (%s); starting a new one", run_id, type(err).__name__)
            return False
        return True

    # --- delivery -------------------------------------------------------------------------------
    def _submit(self, op: _Op) -> None:
        with self._state:
            if self._remote:  # only a server can go away and need the local fallback copy
                self._journal.setdefault(self._local.get(op.run, op.run), []).append(op)
            if self._queue or self._outage_since is not None:
                self._enqueue(op)
                return
        with self._send_lock:
            with self._state:
                if self._queue or self._outage_since is not None:  # an outage began while we waited
                    self._enqueue(op)
                    return
            try:
                self._send(op)
            except _Dropped:  # already reported when its run's creation was dropped
                with self._state:
                    self._unjournal(op)
                return
            except Exception:
                if not self._remote or self._healthy():  # the store rejected the call: the caller's problem
                    with self._state:
                        self._unjournal(op)
                    raise
                with self._state:
                    self._begin_outage()
                    self._enqueue(op)
                return
            with self._state:
                self._delivered(op)

    def _enqueue(self, op: _Op) -> None:
        self._queue.append(op)
        if self._thread is None:
            self._stop.clear()
            self._thread = threading.Thread(target=self._deliver_loop, name="plora-mlflow-delivery", daemon=True)
            self._thread.start()

    def _begin_outage(self) -> None:
        if self._outage_since is None:
            self._outage_since = time.time()
            log.warning(
                "MLflow server %s is unreachable; training goes on and tracking calls are queued until it returns",
                self.tracking_uri,
            )

    def _unjournal(self, op: _Op) -> None:
        key = self._local.get(op.run, op.run)
        ops = self._journal.get(key, [])
        if op in ops:
            ops.remove(op)
        if not ops:
            self._journal.pop(key, None)

    def _delivered(self, op: _Op) -> None:
        op.delivered = True
        key = self._local.get(op.run, op.run)
        if op.kind == "terminate" and key != self._parent_local:
            self._journal.pop(key, None)  # the run is complete on the server: no fallback copy needed

    def _server_id(self, local: str) -> str:
        with self._state:
            if local in self._dead_runs:
                raise _Dropped(local)
            if local.startswith(PLACEHOLDER_PREFIX):
                if local not in self._ids:
                    raise _Dropped(local)
                return self._ids[local]
            return local

    def _send(self, op: _Op) -> None:
        op.attempts += 1
        client = self.client
        if op.kind == "create":
            p = op.payload
            tags = dict(p["tags"])
            if "mlflow.parentRunId" in tags:
                tags["mlflow.parentRunId"] = self._server_id(tags["mlflow.parentRunId"])
            experiment_id = self._ensure_experiment()
            run_id = None
            if op.attempts > 1:  # the last attempt may have created it before the connection broke
                found = client.search_runs(
                    [experiment_id],
                    filter_string=f"tags.`{LOCAL_ID_TAG}` = '{op.run}'",
                    run_view_type=ViewType.ALL,
                    max_results=1,
                )
                run_id = found[0].info.run_id if found else None
            if run_id is None:
                run = client.create_run(experiment_id, start_time=p["start_time"], tags=tags, run_name=p["run_name"])
                run_id = run.info.run_id
            with self._state:
                self._ids[op.run] = run_id
                self._local[run_id] = op.run
            return
        self._replay(client, self._server_id(op.run), op)

    def _deliver_loop(self) -> None:
        delay = self.retry_interval_s
        while not self._stop.is_set():
            with self._state:
                if not self._queue:
                    self._thread = None
                    return
            if not self._healthy():
                self._wake.wait(delay)
                self._wake.clear()
                delay = min(delay * 2, self.max_retry_interval_s)
                continue
            delay = self.retry_interval_s
            self._drain()
        with self._state:
            self._thread = None

    def _drain(self) -> None:
        """Deliver queued calls in order while the server answers."""
        delivered = 0
        while not self._stop.is_set():
            with self._send_lock:
                with self._state:
                    if not self._queue:
                        if self._outage_since is not None:
                            log.warning(
                                "MLflow server %s is back; delivered %d queued tracking calls",
                                self.tracking_uri,
                                delivered,
                            )
                        self._outage_since = None
                        return
                    op = self._queue[0]
                try:
                    self._send(op)
                except _Dropped:
                    self._drop(op, "its run was never created on the server")
                    continue
                except Exception as err:
                    if not self._healthy():
                        return  # still (or again) away: back to probing
                    op.failures += 1
                    if op.failures >= _MAX_FAILURES:
                        self._drop(op, first_line(err))
                    continue
                with self._state:
                    self._queue.popleft()
                    self._delivered(op)
                    delivered += 1

    def _drop(self, op: _Op, why: str) -> None:
        with self._state:
            self._queue.popleft()
            self._unjournal(op)
            if op.kind == "create":
                self._dead_runs.add(op.run)
            self.dropped.append(f"{op.kind} of run {op.run}: {why}")
        log.warning("MLflow rejected a queued %s call for run %s (%s); dropped it", op.kind, op.run, why)

    @staticmethod
    def _replay(store: MlflowClient, run_id: str, op: _Op) -> None:
        p = op.payload
        if op.kind == "batch":
            store.log_batch(run_id, metrics=p.get("metrics", []), params=p.get("params", []), tags=p.get("tags", []))
        elif op.kind == "artifacts":
            if Path(p["path"]).is_dir():
                store.log_artifacts(run_id, p["path"], artifact_path=p["artifact_path"])
            else:
                log.warning("artifact folder %s is gone; not copied to the fallback store", p["path"])
        elif op.kind == "terminate":
            store.set_terminated(run_id, status=p["status"], end_time=p["end_time"])

    # --- fallback -------------------------------------------------------------------------------
    def _write_fallback(self) -> None:
        """Write every run with undelivered calls, complete, to a local sqlite MLflow store."""
        self._stop.set()
        self._wake.set()
        thread = self._thread
        if thread is not None:
            thread.join(timeout=60)
        with self._send_lock, self._state:
            if not self._queue:  # delivered after all while stopping
                return
            runs = {local: list(ops) for local, ops in self._journal.items()}
            self._queue.clear()
            self._outage_since = None
        self.fallback_dir.mkdir(parents=True, exist_ok=True)
        uri = f"sqlite:///{(self.fallback_dir / 'mlflow.db').resolve()}"
        store = MlflowClient(tracking_uri=uri)
        experiment_id = self._get_or_create_experiment(
            store, self.experiment, (self.fallback_dir / "mlartifacts").resolve().as_uri()
        )
        copies: dict[str, str] = {}
        for local, ops in runs.items():
            server_id = self._ids.get(local) if local.startswith(PLACEHOLDER_PREFIX) else local
            create = next((o for o in ops if o.kind == "create"), None)
            if create is not None:
                tags = dict(create.payload["tags"])
                parent = tags.get("mlflow.parentRunId")
                if parent is not None:
                    tags["mlflow.parentRunId"] = copies.get(parent, self._ids.get(parent, parent))
                run_name, start_time = create.payload["run_name"], create.payload["start_time"]
            else:  # calls for a run already complete on the server (e.g. a second end_trial)
                tags, run_name, start_time = {}, f"continuation of {server_id}", None
            if server_id is not None:
                tags["plora.server_run_id"] = server_id
            tags["plora.fallback"] = "true"
            run = store.create_run(experiment_id, start_time=start_time, tags=tags, run_name=run_name)
            copies[local] = run.info.run_id
            for op in ops:
                self._replay(store, run.info.run_id, op)
        with self._state:
            self.fallback_ids.update(copies)
            self._journal.clear()
        self.fallback_uri = uri
        self.fallback_runs = len(copies)
        log.warning("%s", self.delivery_note())
