"""MLflow facade of a sweep: one parent run per sweep, one child run per trial (adapter).

Boundary: what callers see (:class:`SweepTracker`: experiments, runs, params, metrics, tags,
artifacts) and how each call is applied to the tracking server. Everything goes through
``MlflowClient`` with explicit run ids, because trials of a pack are logged from several threads and
the fluent API's "active run" is thread-global. A local store's client (sqlite, a folder, a database
URL) runs in a process of its own (``_mlflow_process``), so that MLflow's Python does not hold the
interpreter lock that the training and evaluation threads need.

Training never waits for an HTTP tracking server: while it is away, calls are queued and delivered
in order once it is back (``_mlflow_queue``); a run created meanwhile gets a placeholder id that
:meth:`SweepTracker.resolve` maps to the server's id once delivered (``_mlflow_ids``). HTTP calls are
bounded for this tracker's client only (``_mlflow_http``: one retry, 15 s timeout), so discovering an
outage costs seconds, not MLflow's default ~4 minutes of retries. If the server is still away when the
sweep ends, every run with undelivered calls (and the parent run) is written complete to a local
store, ``<fallback_dir>/mlflow.db`` with artifacts in ``<fallback_dir>/mlartifacts``
(``_mlflow_journal``); :attr:`SweepTracker.fallback_uri` and :meth:`SweepTracker.delivery_note`
report it. Runs a killed earlier process left open are closed or continued by ``_mlflow_resume``.

Every call is safe to deliver twice (see ``_mlflow_ops``), and a run creation that may have reached
the server before the connection broke is looked up by its placeholder tag before it is created
again, so each call lands exactly once.
"""

from __future__ import annotations

import logging
import threading
import urllib.request
from collections.abc import Iterable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from mlflow.entities import Metric, Param, RunTag, ViewType
from mlflow.tracking import MlflowClient
from mlflow.utils.mlflow_tags import MLFLOW_PARENT_RUN_ID
from mlflow.utils.time import get_current_time_millis

from plora_hpo._mlflow_adapter_store import keep_in_store, local_artifact_dir
from plora_hpo._mlflow_http import BoundedClient
from plora_hpo._mlflow_ids import LOCAL_ID_TAG, PLACEHOLDER_PREFIX, RunIds, find_by_local_id, new_placeholder
from plora_hpo._mlflow_journal import Journal
from plora_hpo._mlflow_ops import Op, replay
from plora_hpo._mlflow_process import ProcessClient
from plora_hpo._mlflow_queue import DeliveryQueue
from plora_hpo._mlflow_resume import close_orphans, reopen
from plora_hpo.errors import PloraError, first_line

__all__ = [
    "DEFAULT_RUN_DIR",
    "LOCAL_ID_TAG",
    "PLACEHOLDER_PREFIX",
    "SweepTracker",
    "default_store_file",
    "default_tracking_uri",
]

DEFAULT_RUN_DIR = Path("plora_runs")

log = logging.getLogger(__name__)


def default_store_file(run_dir: Path = DEFAULT_RUN_DIR) -> Path:
    """The file of a run directory's own MLflow store: ``plora_runs/mlflow.db``."""
    return run_dir / "mlflow.db"


def default_tracking_uri(run_dir: Path = DEFAULT_RUN_DIR) -> str:
    """A local sqlite store next to the Optuna study: ``sqlite:///plora_runs/mlflow.db``."""
    return f"sqlite:///{default_store_file(run_dir).resolve()}"


def _experiment_id(client: MlflowClient, name: str, artifact_root: Path | None) -> str:
    """The id of experiment ``name``, created if missing with its artifacts in ``<artifact_root>/mlartifacts``.

    Without a root, a sqlite store keeps them beside its file (not in the cwd) and a server decides.
    """
    found = client.get_experiment_by_name(name)
    if found is not None:
        return found.experiment_id
    uri = client.tracking_uri
    if artifact_root is None and uri.startswith("sqlite:///"):
        artifact_root = Path(uri.removeprefix("sqlite:///")).parent
    location = None if artifact_root is None else (artifact_root / "mlartifacts").resolve().as_uri()
    return client.create_experiment(name, artifact_location=location)


class SweepTracker:
    """Logs a sweep to MLflow; open with :meth:`start` (or :meth:`resume`), close with :meth:`finish`."""

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
        self.fallback_ids: dict[str, str] = {}  # placeholder → run id in the fallback store
        self.fallback_runs = 0
        self.finish_grace_s = finish_grace_s
        self._remote = tracking_uri.startswith(("http://", "https://"))
        self._client: MlflowClient | ProcessClient | None = None
        self._client_lock = threading.Lock()
        self._closed = False
        self._opening: Future | None = None  # open_store's call, until check_reachable waits for it
        self._parent_local: str | None = None
        self._continued = False  # the parent run is an earlier process's (resume), so trial runs may exist
        self._attached = False  # the parent run is another live process's (a joined worker)
        self._ids = RunIds()
        self._journal = Journal(self._ids, active=self._remote)  # only a server can go away
        self._queue = DeliveryQueue(
            self._send,
            self._healthy,
            self._journal,
            server=tracking_uri,
            retry_interval_s=retry_interval_s,
            max_retry_interval_s=max_retry_interval_s,
        )

    @property
    def client(self) -> MlflowClient | ProcessClient:
        """Created on first use: a sqlite store is only written once the sweep is known to be valid.

        A server's client gives up on an HTTP request after one short retry; the delivery queue
        retries instead. Any other store (sqlite, a database, a folder) is MLflow's Python running
        in the caller: it is served from a process of its own (``_mlflow_process``), so that
        logging does not hold the interpreter lock the training and evaluation threads need.
        """
        with self._client_lock:
            if self._client is None:
                if self._closed:
                    raise RuntimeError(f"the tracker of {self.tracking_uri} is closed")
                uri = self.tracking_uri
                self._client = BoundedClient(tracking_uri=uri) if self._remote else ProcessClient(uri)
            return self._client

    def open_store(self) -> None:
        """Start opening a local store now (its process starts and creates the tables) while the
        caller goes on; :meth:`check_reachable` waits for it. A server is only probed by that."""
        if not self._remote and self._opening is None:
            client = self.client
            assert isinstance(client, ProcessClient)
            self._opening = client.submit("search_experiments", max_results=1)

    def close(self) -> None:
        """Stop a local store's process once it has applied every call sent; idempotent. Call it
        after :meth:`finish`: the tracker takes no calls after this."""
        with self._client_lock:
            client, self._client, self._closed = self._client, None, True
        if isinstance(client, ProcessClient):
            client.close()

    # --- reachability -----------------------------------------------------------------------
    def check_reachable(self) -> None:
        """Fail early (before any study or run exists) if the tracking store cannot be used.

        HTTP servers are probed once at ``/health`` (MLflow's client would retry for minutes).
        """
        opening, self._opening = self._opening, None
        try:
            if self._remote:
                with urllib.request.urlopen(self._health_url, timeout=10):
                    pass
            client = self.client
            if opening is not None:
                assert isinstance(client, ProcessClient)  # open_store's call, sent to a local store
                client.wait(opening)
            else:
                client.search_experiments(max_results=1)
        except Exception as err:  # MLflow raises many types for a dead store
            raise PloraError(
                f"cannot reach the MLflow tracking store {self.tracking_uri!r} ({first_line(err)}); "
                "start the server or pass --mlflow-uri with a reachable store"
            ) from None

    @property
    def _health_url(self) -> str:
        return f"{self.tracking_uri.rstrip('/')}/health"

    def _healthy(self) -> bool:
        """Whether an HTTP server answers ``/health`` within 2 s (local stores are always healthy)."""
        if not self._remote:
            return True
        try:
            with urllib.request.urlopen(self._health_url, timeout=2) as r:
                return r.status == 200
        except Exception:
            return False

    @property
    def in_outage(self) -> bool:
        """Whether calls are being queued because the server stopped answering."""
        return self._queue.in_outage

    @property
    def pending(self) -> int:
        """Calls queued for delivery."""
        return self._queue.pending

    @property
    def dropped(self) -> list[str]:
        """Descriptions of queued calls the server rejected (not outages)."""
        return self._queue.dropped

    # --- ids --------------------------------------------------------------------------------
    @property
    def parent_run_id(self) -> str | None:
        """The sweep's parent run: the server id once known, else its placeholder."""
        return None if self._parent_local is None else self.resolve(self._parent_local)

    def resolve(self, run_id: str) -> str:
        """The server's id for ``run_id`` (a placeholder from an outage), or ``run_id`` itself until delivered."""
        return self._ids.resolve(run_id)

    def _ensure_experiment(self) -> str:
        if self.experiment_id is None:
            self.experiment_id = _experiment_id(self.client, self.experiment, self.artifact_root)
        return self.experiment_id

    # --- public logging API -------------------------------------------------------------------
    def start(self, sweep_name: str, params: dict[str, Any], tags: dict[str, str] | None = None) -> str:
        if self._remote:
            try:
                self._ensure_experiment()
            except Exception:
                if self._healthy():
                    raise
                # created with the parent run once the server is back
        self._set_parent(self._create(sweep_name, {"plora.kind": "sweep", **(tags or {})}))
        run_id = self.resolve(self._parent_local)
        self._log_params(run_id, params)
        return run_id

    def start_trial(self, run_name: str, params: dict[str, Any], tags: dict[str, str]) -> str:
        assert self._parent_local is not None, "call start() first"
        run_id = self.resolve(
            self._create(run_name, {MLFLOW_PARENT_RUN_ID: self._parent_local, "plora.kind": "trial", **tags})
        )  # the server id when created synchronously
        self._log_params(run_id, params)
        return run_id

    def find_trial_run(self, run_name: str) -> str | None:
        """This sweep's trial run named ``run_name`` that an earlier, killed process created, if any.

        A process killed after creating a trial's run but before the study or a checkpoint
        recorded its id leaves that run behind; the retry continues it instead of adding a second
        run for the same adapter. None if there is none or the store cannot say.
        """
        if self._parent_local is None or not self._continued:  # a new sweep has no runs to find
            return None
        parent = self.resolve(self._parent_local)
        query = f"tags.`{MLFLOW_PARENT_RUN_ID}` = '{parent}' and attributes.run_name = '{run_name}'"
        try:
            runs = self.client.search_runs([self._ensure_experiment()], filter_string=query, max_results=1)
        except Exception as err:  # the server is away: the retry starts a new run
            log.warning("cannot look up MLflow run %s (%s)", run_name, type(err).__name__)
            return None
        return runs[0].info.run_id if runs else None

    def _set_parent(self, run_id: str) -> None:
        self._parent_local = run_id
        self._journal.keep_to_end(run_id)

    def _create(self, run_name: str, tags: dict[str, str]) -> str:
        placeholder = new_placeholder()
        payload = {
            "run_name": run_name,
            "tags": {LOCAL_ID_TAG: placeholder, **tags},
            "start_time": get_current_time_millis(),
        }
        self._queue.submit(Op("create", placeholder, payload))
        return placeholder

    def _log_params(self, run_id: str, params: dict[str, Any]) -> None:
        self._log_batch(run_id, params=[Param(k, str(v)) for k, v in params.items()])

    def log_metrics(
        self, run_id: str, rows: Iterable[tuple[str, float, int]], tags: dict[str, str] | None = None
    ) -> None:
        """Log ``(key, value, step)`` rows, stamped now, and ``tags`` with them, in one call to the
        store (MLflow's client splits it into calls it accepts)."""
        now = get_current_time_millis()
        self._log_batch(
            run_id,
            metrics=[Metric(k, float(v), now, int(s)) for k, v, s in rows],
            tags=[RunTag(k, str(v)) for k, v in (tags or {}).items()],
        )

    def set_tags(self, run_id: str, tags: dict[str, str]) -> None:
        self._log_batch(run_id, tags=[RunTag(k, str(v)) for k, v in tags.items()])

    def _log_batch(self, run_id: str, **items: list[Param] | list[Metric] | list[RunTag]) -> None:
        payload = {kind: entries for kind, entries in items.items() if entries}
        if payload:  # an empty call would still wait in the queue during an outage
            self._queue.submit(Op("batch", run_id, payload))

    def log_adapter(self, run_id: str, adapter_dir: Path) -> Path:
        """The PEFT adapter folder becomes the run's ``adapter/`` artifact; returns where the adapter is kept.

        The adapter is stored once. A run whose artifact store is a folder on this machine (the
        default sqlite store's ``mlartifacts``) gets the folder itself, and ``adapter_dir`` becomes a
        link to it (``_mlflow_adapter_store``); the returned path is the artifact folder. A remote
        store gets an upload and this machine keeps ``adapter_dir``, the path returned.
        """
        stored = self._local_artifact_dir(run_id)
        if stored is None:
            self.log_folder(run_id, adapter_dir, "adapter")
            return adapter_dir
        return keep_in_store(adapter_dir, stored / "adapter")

    def _local_artifact_dir(self, run_id: str) -> Path | None:
        """The run's artifact folder if it is on this machine; None if remote or the run is not on the server yet."""
        run_id = self.resolve(run_id)
        if run_id.startswith(PLACEHOLDER_PREFIX) or self.in_outage:
            return None
        try:
            return local_artifact_dir(self.client.get_run(run_id).info.artifact_uri)
        except Exception as err:  # the server went away: the upload is queued instead
            log.warning("cannot read the artifact location of MLflow run %s (%s)", run_id, type(err).__name__)
            return None

    def log_folder(self, run_id: str, folder: Path, artifact_path: str) -> None:
        """Every file of ``folder`` (or the one file ``folder``) becomes an artifact of the run
        under ``artifact_path``.

        During an outage it is queued by path: it must stay in place until delivered.
        """
        self._queue.submit(Op("artifacts", run_id, {"path": str(folder), "artifact_path": artifact_path}))

    def end_trial(self, run_id: str, status: str = "FINISHED") -> None:
        self._queue.submit(Op("terminate", run_id, {"status": status, "end_time": get_current_time_millis()}))

    def finish(self, status: str = "FINISHED") -> None:
        """End the parent run; wait up to ``finish_grace_s`` for queued calls, else write the fallback store."""
        if self._parent_local is None:
            return
        if self._attached:
            if self._remote and not self.flush(self.finish_grace_s):
                self._write_fallback()
            return
        self.end_trial(self._parent_local, status)  # the parent run ends as a trial's does
        if self._remote and not self.flush(self.finish_grace_s):
            self._write_fallback()

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued call is delivered (True) or ``timeout`` seconds pass (False)."""
        return self._queue.flush(timeout)

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

    # --- runs of a killed earlier process -----------------------------------------------------
    def close_orphan_runs(self, keep: set[str], reason: str | None = None) -> list[str]:
        """Close runs of this experiment left RUNNING by a killed sweep process; returns their ids.

        Runs in ``keep`` (ids or placeholders) and every run this tracker created stay open. Closed
        runs get status KILLED and the tag ``plora.closed_reason``. Call it once at the start of a
        rerun, after :meth:`start`; with the server away it logs a warning and closes nothing.
        """
        keep_ids = {self.resolve(k) for k in keep} | set(keep) | self._ids.known()
        if self.parent_run_id is not None:
            keep_ids.add(self.parent_run_id)
        reason = reason or (
            "left RUNNING by a sweep process that ended without closing it (killed?); "
            f"closed by the rerun {self.parent_run_id or ''}".rstrip()
        )
        try:
            return close_orphans(self.client, self._ensure_experiment(), keep_ids, reason)
        except Exception:
            if self._healthy():
                raise
            log.warning("MLflow server %s unreachable: runs left open by a killed sweep stay open", self.tracking_uri)
            return []

    def resume(self, run_id: str) -> bool:
        """Continue an earlier process's parent run (set RUNNING again) instead of :meth:`start`.

        False if it cannot be continued (another experiment or store, deleted, an outage placeholder that
        never reached the server, or the server is away): the caller starts a new one.
        """
        if not self._reopen(run_id):
            return False
        self._set_parent(run_id)
        self._continued = True
        return True

    def attach(self, run_id: str) -> None:
        """Log trial runs under another process's parent run ``run_id`` (a worker joining a sweep):
        the parent stays that process's to end, so :meth:`finish` only delivers what is queued."""
        self._set_parent(run_id)
        self._continued = True
        self._attached = True

    def resume_trial(self, run_id: str, tags: dict[str, str]) -> bool:
        """Continue a trial's run (a crashed predecessor's) with updated tags; False as for :meth:`resume`."""
        if not self._reopen(run_id):
            return False
        self.set_tags(run_id, tags)
        return True

    def logged_steps(self, run_id: str) -> dict[str, int]:
        """The last step of every metric ``run_id`` already holds on the server (empty if it cannot say).

        A retried trial trains again the steps its predecessor logged before it was killed; its
        reporter logs only what is new, so every metric keeps one point per step.
        """
        try:
            run = self.client.get_run(self.resolve(run_id))
            return {
                key: max(m.step for m in self.client.get_metric_history(run.info.run_id, key))
                for key in run.data.metrics
            }
        except Exception as err:  # the server is away or the run never reached it: log everything
            log.warning("cannot read the metrics of MLflow run %s (%s)", run_id, type(err).__name__)
            return {}

    def _reopen(self, run_id: str) -> bool:
        try:
            return reopen(self.client, self._ensure_experiment(), self._ids, run_id)
        except Exception as err:  # gone, or the server is away: a new run is created instead
            log.warning("cannot continue MLflow run %s (%s); starting a new one", run_id, type(err).__name__)
            return False

    # --- delivery -------------------------------------------------------------------------------
    def _send(self, op: Op) -> None:
        """Apply ``op`` to the tracking server; raises what the server (or the connection) raises."""
        op.attempts += 1
        if op.kind != "create":
            replay(self.client, self._ids.on_server(op.run), op)
            return
        p = op.payload
        tags = dict(p["tags"])
        if MLFLOW_PARENT_RUN_ID in tags:
            tags[MLFLOW_PARENT_RUN_ID] = self._ids.on_server(tags[MLFLOW_PARENT_RUN_ID])
        experiment_id = self._ensure_experiment()
        run_id = None
        if op.attempts > 1:  # the last attempt may have created it before the connection broke
            run_id = find_by_local_id(self.client, experiment_id, op.run, ViewType.ALL)
        if run_id is None:
            run = self.client.create_run(experiment_id, start_time=p["start_time"], tags=tags, run_name=p["run_name"])
            run_id = run.info.run_id
        self._ids.bind(op.run, run_id)

    def _write_fallback(self) -> None:
        """Copy every run with undelivered calls, complete, to a local sqlite MLflow store."""
        if not self._queue.abandon():  # delivered after all while stopping
            return
        self.fallback_dir.mkdir(parents=True, exist_ok=True)
        uri = default_tracking_uri(self.fallback_dir)
        store = MlflowClient(tracking_uri=uri)
        copies = self._journal.copy_to(store, _experiment_id(store, self.experiment, None))
        self.fallback_ids.update(copies)
        self.fallback_uri = uri
        self.fallback_runs = len(copies)
        log.warning("%s", self.delivery_note())
