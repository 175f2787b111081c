"""HTTP limits of the sweep's own MLflow calls.

Boundary: how long one MLflow request of a sweep may try before it fails, and nothing else.
MLflow retries an HTTP call 7 times with exponential backoff by default (minutes against a dead
server); a sweep's delivery queue retries on its own, so each of its requests gets one short
attempt instead. MLflow 3 takes these limits only from ``MLFLOW_HTTP_REQUEST_*`` environment
variables, read when a request is made, and offers no per-client setting; so the limits are set
while a call of :class:`BoundedClient` runs and removed when the last such call returns. Variables
the user set keep the user's values, and MLflow calls made outside a sweep's client (before, after,
or from the user's own code) use MLflow's defaults, except one that overlaps a sweep's call in time.
"""

from __future__ import annotations

import functools
import os
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from mlflow.tracking import MlflowClient

__all__ = ["REQUEST_LIMITS", "BoundedClient", "bounded_requests"]

REQUEST_LIMITS: dict[str, str] = {
    "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "1",
    "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
    "MLFLOW_HTTP_REQUEST_BACKOFF_JITTER": "0.5",
    "MLFLOW_HTTP_REQUEST_TIMEOUT": "15",
}

_lock = threading.Lock()
_active = 0  # bounded calls running now, in any thread
_set_by_us: dict[str, str] = {}  # the variables the outermost call set (the user had not)


@contextmanager
def bounded_requests() -> Iterator[None]:
    """Within this block (in any thread, nested or concurrent), MLflow requests use :data:`REQUEST_LIMITS`."""
    global _active
    with _lock:
        if _active == 0:
            for name, value in REQUEST_LIMITS.items():
                if name not in os.environ:
                    os.environ[name] = value
                    _set_by_us[name] = value
        _active += 1
    try:
        yield
    finally:
        with _lock:
            _active -= 1
            if _active == 0:
                for name, value in _set_by_us.items():
                    if os.environ.get(name) == value:  # changed meanwhile by someone else: theirs now
                        del os.environ[name]
                _set_by_us.clear()


class BoundedClient(MlflowClient):
    """An ``MlflowClient`` whose every public call runs within :func:`bounded_requests`."""

    def __getattribute__(self, name: str) -> Any:
        attr = super().__getattribute__(name)
        if name.startswith("_") or not callable(attr):
            return attr
        return _bounded(attr)


def _bounded(method: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(method)
    def call(*args: Any, **kwargs: Any) -> Any:
        with bounded_requests():
            return method(*args, **kwargs)

    return call
