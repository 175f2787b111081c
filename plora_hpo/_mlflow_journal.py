"""The journal of each run's calls, and the complete copies written from it when the server never returns.

Boundary: what is kept so that a run can be rebuilt elsewhere, and rebuilding it in another MLflow
store; not when calls are sent (the delivery queue) nor where that store lives (the tracker). Every
call of a run is kept until the run's termination reaches the server, so a run the server only got
part of can be copied *complete*: all its params, tags, metrics, artifacts and status, also what the
server already got. The sweep's parent run is kept to the end, since every trial copy points to its
copy. Copies carry ``plora.fallback`` and, when the server knows the run, ``plora.server_run_id``.
"""

from __future__ import annotations

import threading

from mlflow.tracking import MlflowClient
from mlflow.utils.mlflow_tags import MLFLOW_PARENT_RUN_ID

from plora_hpo._mlflow_ids import RunIds
from plora_hpo._mlflow_ops import Op, replay


class Journal:
    """Calls by run (keyed by the id the run was first known by), until each run is complete on the server.

    Inactive (keeps nothing) for stores that cannot go away, such as a local sqlite file.
    """

    def __init__(self, ids: RunIds, *, active: bool) -> None:
        self._ids = ids
        self._active = active
        self._lock = threading.Lock()
        self._runs: dict[str, list[Op]] = {}
        self._kept: str | None = None

    def keep_to_end(self, run_id: str) -> None:
        """Keep ``run_id``'s calls even once it is complete on the server (the sweep's parent run)."""
        self._kept = self._ids.local_of(run_id)

    def record(self, op: Op) -> None:
        if self._active:
            with self._lock:
                self._runs.setdefault(self._ids.local_of(op.run), []).append(op)

    def forget(self, op: Op) -> None:
        """``op`` will never reach the server (rejected, or its run was never created): no copy of it either."""
        key = self._ids.local_of(op.run)
        with self._lock:
            ops = self._runs.get(key, [])
            if op in ops:
                ops.remove(op)
            if not ops:
                self._runs.pop(key, None)

    def delivered(self, op: Op) -> None:
        """``op`` reached the server; a termination completes its run there, so no copy is needed."""
        key = self._ids.local_of(op.run)
        if op.kind == "terminate" and key != self._kept:
            with self._lock:
                self._runs.pop(key, None)

    def copy_to(self, store: MlflowClient, experiment_id: str) -> dict[str, str]:
        """Write every journaled run, complete, to ``store`` and empty the journal; returns local id → copy's id."""
        with self._lock:
            runs, self._runs = self._runs, {}
        copies: dict[str, str] = {}
        for local, ops in runs.items():  # in order of first call: a parent before its trials
            server_id = self._ids.server_id(local)
            create = next((o for o in ops if o.kind == "create"), None)
            if create is not None:
                tags = dict(create.payload["tags"])
                parent = tags.get(MLFLOW_PARENT_RUN_ID)
                if parent is not None:
                    tags[MLFLOW_PARENT_RUN_ID] = copies.get(parent, self._ids.resolve(parent))
                run_name, start_time = create.payload["run_name"], create.payload["start_time"]
            else:  # calls for a run already complete on the server (e.g. a second end_trial)
                tags, run_name, start_time = {}, f"continuation of {server_id}", None
            if server_id is not None:
                tags["plora.server_run_id"] = server_id
            tags["plora.fallback"] = "true"
            run = store.create_run(experiment_id, start_time=start_time, tags=tags, run_name=run_name)
            copies[local] = run.info.run_id
            for op in ops:
                replay(store, run.info.run_id, op)
        return copies
