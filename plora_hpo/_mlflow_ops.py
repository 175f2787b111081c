"""A tracking call as data, and applying it to an MLflow store.

Boundary: what one call to a run is (:class:`Op`) and how it is replayed on a store, whether the
tracking server (once the run exists there) or the local fallback store. Creating the run itself is
store-specific and left to the callers. Replaying is safe to repeat: metrics carry the timestamp of
the original call (MLflow's SQL store ignores an identical re-sent metric), params are re-sent with
identical values, tags and termination are idempotent and artifacts overwrite the same paths.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from mlflow.tracking import MlflowClient

log = logging.getLogger(__name__)


@dataclass(eq=False)  # one call: two identical calls are two ops, removed from the journal one by one
class Op:
    """One tracking call, kept until delivered (and, for fallback copies, until its run is done)."""

    kind: Literal["create", "batch", "artifacts", "terminate"]
    run: str  # the server id, or a placeholder while the run is undelivered
    payload: dict[str, Any] = field(default_factory=dict)
    attempts: int = 0  # sends tried, failed ones included
    failures: int = 0  # sends a healthy server rejected


def replay(store: MlflowClient, run_id: str, op: Op) -> None:
    """Apply a ``batch``, ``artifacts`` or ``terminate`` call to run ``run_id`` of ``store`` (``create``: no-op)."""
    p = op.payload
    if op.kind == "batch":
        store.log_batch(run_id, metrics=p.get("metrics", []), params=p.get("params", []), tags=p.get("tags", []))
    elif op.kind == "artifacts":
        if Path(p["path"]).is_dir():
            store.log_artifacts(run_id, p["path"], artifact_path=p["artifact_path"])
        elif Path(p["path"]).is_file():
            store.log_artifact(run_id, p["path"], artifact_path=p["artifact_path"])
        else:
            log.warning("artifact %s is gone; run %s does not get it", p["path"], run_id)
    elif op.kind == "terminate":
        store.set_terminated(run_id, status=p["status"], end_time=p["end_time"])
