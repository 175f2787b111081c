"""MLflow: one parent run per sweep, one child run per trial (adapter).

Everything goes through ``MlflowClient`` with explicit run ids, because trials of a pack are
logged from several threads and the fluent API's "active run" is thread-global.
"""

from __future__ import annotations

import functools
import os
import time
import urllib.request
from collections.abc import Iterable
from pathlib import Path
from typing import Any

os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")

from mlflow.entities import Metric, Param, RunTag
from mlflow.tracking import MlflowClient

from plora_hpo.errors import PloraError

DEFAULT_RUN_DIR = Path("plora_runs")


def default_tracking_uri(run_dir: Path = DEFAULT_RUN_DIR) -> str:
    """A local sqlite store next to the Optuna study: ``sqlite:///plora_runs/mlflow.db``."""
    return f"sqlite:///{(run_dir / 'mlflow.db').resolve()}"


class SweepTracker:
    """Logs a sweep to MLflow; open with :meth:`start`, close with :meth:`finish`."""

    def __init__(self, tracking_uri: str, experiment: str, artifact_root: Path | None = None) -> None:
        self.tracking_uri = tracking_uri
        self.experiment = experiment
        self.artifact_root = artifact_root
        self.parent_run_id: str | None = None
        self.experiment_id: str | None = None

    @functools.cached_property
    def client(self) -> MlflowClient:
        """Created on first use: a sqlite store is only written once the sweep is known to be valid."""
        return MlflowClient(tracking_uri=self.tracking_uri)

    def check_reachable(self) -> None:
        """Fail early (before any study or run exists) if the tracking store cannot be used.

        HTTP servers are probed once at ``/health`` (MLflow's client would retry for minutes).
        """
        try:
            if self.tracking_uri.startswith(("http://", "https://")):
                with urllib.request.urlopen(f"{self.tracking_uri.rstrip('/')}/health", timeout=10):
                    pass
            self.client.search_experiments(max_results=1)
        except Exception as err:  # MLflow raises many types for a dead store
            first = str(err).splitlines()[0][:200]
            raise PloraError(
                f"cannot reach the MLflow tracking store {self.tracking_uri!r} ({first}); "
                "start the server or pass --mlflow-uri with a reachable store"
            ) from None

    def _experiment_id(self) -> str:
        found = self.client.get_experiment_by_name(self.experiment)
        if found is not None:
            return found.experiment_id
        root = self.artifact_root
        if root is None and self.tracking_uri.startswith("sqlite:///"):
            root = Path(self.tracking_uri.removeprefix("sqlite:///")).parent  # beside the store, not in cwd
        location = None if root is None else (root / "mlartifacts").resolve().as_uri()
        return self.client.create_experiment(self.experiment, artifact_location=location)

    def start(self, sweep_name: str, params: dict[str, Any], tags: dict[str, str] | None = None) -> str:
        self.experiment_id = self._experiment_id()
        run = self.client.create_run(
            self.experiment_id,
            run_name=sweep_name,
            tags={"plora.kind": "sweep", **(tags or {})},
        )
        self.parent_run_id = run.info.run_id
        self._log_params(self.parent_run_id, params)
        return self.parent_run_id

    def start_trial(self, run_name: str, params: dict[str, Any], tags: dict[str, str]) -> str:
        assert self.experiment_id is not None and self.parent_run_id is not None, "call start() first"
        run = self.client.create_run(
            self.experiment_id,
            run_name=run_name,
            tags={"mlflow.parentRunId": self.parent_run_id, "plora.kind": "trial", **tags},
        )
        self._log_params(run.info.run_id, params)
        return run.info.run_id

    def _log_params(self, run_id: str, params: dict[str, Any]) -> None:
        self.client.log_batch(run_id, params=[Param(k, str(v)[:6000]) for k, v in params.items()])

    def log_metrics(self, run_id: str, rows: Iterable[tuple[str, float, int]]) -> None:
        """Log ``(key, value, step)`` rows in batches of ≤ 1000 (MLflow's per-call limit)."""
        now = int(time.time() * 1000)
        metrics = [Metric(k, float(v), now, int(s)) for k, v, s in rows]
        for start in range(0, len(metrics), 1000):
            self.client.log_batch(run_id, metrics=metrics[start : start + 1000])

    def set_tags(self, run_id: str, tags: dict[str, str]) -> None:
        self.client.log_batch(run_id, tags=[RunTag(k, str(v)) for k, v in tags.items()])

    def log_adapter(self, run_id: str, adapter_dir: Path) -> None:
        """The PEFT adapter directory becomes the run's ``adapter/`` artifact."""
        self.client.log_artifacts(run_id, str(adapter_dir), artifact_path="adapter")

    def end_trial(self, run_id: str, status: str = "FINISHED") -> None:
        self.client.set_terminated(run_id, status=status)

    def finish(self, status: str = "FINISHED") -> None:
        if self.parent_run_id is not None:
            self.client.set_terminated(self.parent_run_id, status=status)
