"""Run ids that outlive an outage: placeholders, and the server ids they stand for.

Boundary: which local id names which server run, and finding a run by its placeholder tag. A run
created while the server is away gets a placeholder ``pending-<hex>`` at once, so callers can log to
it before the server knows it; once its creation is delivered the placeholder is bound to the
server's id. Every run carries its placeholder in the tag :data:`LOCAL_ID_TAG`, so a placeholder
stored elsewhere (an Optuna user attr, a later process) can always be looked up with
:func:`find_by_local_id`. Nothing here talks to the server except that lookup.
"""

from __future__ import annotations

import threading
import uuid

from mlflow.entities import ViewType
from mlflow.tracking import MlflowClient

PLACEHOLDER_PREFIX = "pending-"
LOCAL_ID_TAG = "plora.local_run_id"


class NeverCreated(Exception):
    """The run a call belongs to was never created on the server (its creation was rejected or is undelivered)."""


def new_placeholder() -> str:
    return f"{PLACEHOLDER_PREFIX}{uuid.uuid4().hex}"


def find_by_local_id(
    client: MlflowClient, experiment_id: str, placeholder: str, view: int = ViewType.ACTIVE_ONLY
) -> str | None:
    """The id of the run of ``experiment_id`` tagged with ``placeholder``, or None if there is none."""
    found = client.search_runs(
        [experiment_id], filter_string=f"tags.`{LOCAL_ID_TAG}` = '{placeholder}'", run_view_type=view, max_results=1
    )
    return found[0].info.run_id if found else None


class RunIds:
    """Placeholder ↔ server run id, shared by the threads that log (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._server: dict[str, str] = {}  # placeholder → server run id
        self._local: dict[str, str] = {}  # server run id → placeholder

    def bind(self, placeholder: str, server_id: str) -> None:
        with self._lock:
            self._server[placeholder] = server_id
            self._local[server_id] = placeholder

    def server_id(self, run_id: str) -> str | None:
        """The server's id for ``run_id``: itself unless a placeholder; None for an unbound placeholder."""
        if not run_id.startswith(PLACEHOLDER_PREFIX):
            return run_id
        with self._lock:
            return self._server.get(run_id)

    def on_server(self, run_id: str) -> str:
        """The server's id for ``run_id``; raises :class:`NeverCreated` for an unbound placeholder."""
        server_id = self.server_id(run_id)
        if server_id is None:
            raise NeverCreated(run_id)
        return server_id

    def resolve(self, run_id: str) -> str:
        """The server's id for ``run_id`` once known, else ``run_id`` unchanged."""
        return self.server_id(run_id) or run_id

    def local_of(self, run_id: str) -> str:
        """The id this process first knew the run by: its placeholder if it had one, else ``run_id``."""
        with self._lock:
            return self._local.get(run_id, run_id)

    def known(self) -> set[str]:
        """Every placeholder and server id bound so far."""
        with self._lock:
            return set(self._server) | set(self._local)
