"""A local MLflow store served from a process of its own: :class:`ProcessClient`.

Boundary: carrying ``MlflowClient`` calls to a child process, and their results or errors back;
not which calls a sweep makes, nor when (:mod:`plora_hpo.tracking`).

MLflow applies a call to a sqlite, database or file store inside the calling process, in Python
(validation, SQLAlchemy, file writes): logging a loss curve of a few thousand rows holds the
interpreter lock for about a tenth of a second, and the thread that launches the training steps or
the evaluation batches waits for it, the GPU idle meanwhile. Served from a child process, that work
runs on another core while the calling thread waits on a socket with the lock released.

A call still returns only once the store has applied it, with the store's result, or raises the
store's error: the exception itself when it survives pickling, else a :class:`StoreProcessError`
with its type and message. The messages of its causes come along as its ``__cause__``, so a full
disk is still recognised as one. Calls are applied one at a time, in the order they were sent.

The child is a fresh run of this interpreter with this environment that imports this module (from
where this process did, if nothing else provides it) and serves; multiprocessing's spawn would
import the caller's script again, which a script without a ``__main__`` guard does not survive. It
takes the levels this process set on MLflow's loggers, so it logs what MLflow would have logged
here. It runs in a session of its own and ignores SIGINT and SIGTERM: a Ctrl-C or a scheduler's
stop is the caller's to handle, and the caller still logs while it stops (its runs end KILLED). It
exits when its socket closes, so it never outlives the process that started it.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import pickle
import signal
import socket
import subprocess
import sys
import threading
from collections import deque
from concurrent.futures import Future
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

__all__ = ["ProcessClient", "StoreProcessError"]

_CLOSE_TIMEOUT_S = 30.0  # what the child may take to apply the calls sent before close()
# The child's program: this module from wherever the interpreter finds it, else from where the parent
# did (appended, so an installed copy and the standard library come first).
_CHILD = f"import sys; sys.path.append(sys.argv[1]); from {__name__} import _main; _main(sys.argv[2:])"
_CAUSES_KEPT = 8


class StoreProcessError(RuntimeError):
    """The store process raised an error that does not survive pickling, or ended."""


class ProcessClient:
    """An ``MlflowClient`` for ``tracking_uri`` whose calls run in a child process, started at once.

    Any public ``MlflowClient`` method is called as on the client itself (``client.get_run(run_id)``)
    and waits for its result; :meth:`submit` sends a call without waiting, :meth:`wait` collects
    it. Safe to call from several threads. :meth:`close` stops the child.
    """

    def __init__(self, tracking_uri: str) -> None:
        self.tracking_uri = tracking_uri
        ours, theirs = socket.socketpair()
        package_root = str(Path(__file__).resolve().parents[1])
        levels = json.dumps(_mlflow_log_levels())
        try:
            self._process = subprocess.Popen(
                [sys.executable, "-c", _CHILD, package_root, str(theirs.fileno()), tracking_uri, levels],
                pass_fds=(theirs.fileno(),),
                start_new_session=True,  # a terminal's Ctrl-C signals the caller's process group, not it
            )
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        self._conn = Connection(ours.detach())
        self._send_lock = threading.Lock()  # a call's request and its place among the pending ones
        self._recv_lock = threading.Lock()  # one reader at a time; replies come in request order
        self._pending: deque[Future] = deque()
        self._ended: StoreProcessError | None = None

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        return functools.partial(self.call, name)

    def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """``MlflowClient.<method>(*args, **kwargs)`` in the child: its result, or its error raised."""
        return self.wait(self.submit(method, *args, **kwargs))

    def submit(self, method: str, *args: Any, **kwargs: Any) -> Future:
        """Send the call and return at once; :meth:`wait` on the future gives its result."""
        future: Future = Future()
        request = pickle.dumps((method, args, kwargs))  # an argument that cannot travel raises here, unsent
        with self._send_lock:
            if self._ended is None:
                self._pending.append(future)
                try:
                    self._conn.send_bytes(request)
                except (OSError, ValueError):  # the child is gone (or this client was closed)
                    self._end()
            if self._ended is not None and not future.done():
                future.set_exception(self._ended)
        return future

    def wait(self, future: Future) -> Any:
        """The result of a call :meth:`submit` sent (raising its error)."""
        with self._recv_lock:
            while not future.done():
                try:
                    ok, value = self._conn.recv()
                except (EOFError, OSError):
                    self._end()
                    break
                except Exception as err:  # a reply read whole that does not unpickle here: still the head's
                    ok, value = False, (None, [f"{type(err).__name__}: the store's reply cannot be read ({err})"])
                try:
                    head = self._pending.popleft()
                except IndexError:  # its call was already failed: the child ended meanwhile
                    continue
                if head.done():
                    continue
                if ok:
                    head.set_result(value)
                else:
                    head.set_exception(_rebuilt(*value))
        return future.result()

    def close(self) -> None:
        """Stop the child once it has applied every call sent so far. Idempotent."""
        with self._send_lock:
            if self._ended is None:
                with contextlib.suppress(OSError, ValueError):
                    self._conn.send(None)
        while self._pending:  # replies to calls nobody waits for any more
            with contextlib.suppress(Exception):
                self.wait(self._pending[-1])
        try:
            self._process.wait(_CLOSE_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()
        with self._send_lock:
            if self._ended is None:
                self._ended = StoreProcessError(f"the MLflow store process for {self.tracking_uri} was closed")
            self._conn.close()

    def _end(self) -> None:
        """The child is gone: every call waiting, and every later one, fails with that."""
        if self._ended is None:
            code = self._process.poll()
            self._ended = StoreProcessError(
                f"the MLflow store process for {self.tracking_uri} ended"
                + ("" if code is None else f" (exit code {code})")
            )
        while True:
            try:
                future = self._pending.popleft()
            except IndexError:
                return
            if not future.done():
                future.set_exception(self._ended)


def _portable(err: BaseException) -> tuple[BaseException | None, list[str]]:
    """``err`` as it can cross to the parent: itself if it survives pickling, and the messages of
    it and its causes."""
    chain, seen = [], err
    while seen is not None and len(chain) < _CAUSES_KEPT:
        chain.append(f"{type(seen).__name__}: {seen}")
        seen = seen.__cause__ or seen.__context__
    try:
        copy = pickle.loads(pickle.dumps(err))
    except Exception:
        copy = None
    return copy, chain


def _rebuilt(copy: BaseException | None, chain: list[str]) -> BaseException:
    err = copy if isinstance(copy, Exception) else StoreProcessError(chain[0])
    if len(chain) > 1:
        err.__cause__ = StoreProcessError("; from ".join(chain[1:]))
    return err


def _mlflow_log_levels() -> dict[str, int]:
    """The levels set in this process on MLflow's loggers (``mlflow`` and those below it)."""
    loggers = logging.root.manager.loggerDict
    return {
        name: logger.level
        for name, logger in loggers.items()
        if (name == "mlflow" or name.startswith("mlflow.")) and isinstance(logger, logging.Logger) and logger.level
    }


def _serve(fd: int, tracking_uri: str, log_levels: dict[str, int]) -> None:
    """The child: apply each call received to one ``MlflowClient``, send back what it gives."""
    for stop in (signal.SIGINT, signal.SIGTERM):  # the caller decides when to stop; its socket says so
        signal.signal(stop, signal.SIG_IGN)
    from mlflow.tracking import MlflowClient

    for name, level in log_levels.items():  # after MLflow's import has configured its own
        logging.getLogger(name).setLevel(level)
    conn = Connection(fd)
    client = None  # made by the first call, so that an error making it is that call's to raise
    while True:
        try:
            request = conn.recv()
        except EOFError:  # the parent closed its end, or ended
            return
        if request is None:
            return
        method, args, kwargs = request
        try:
            client = client or MlflowClient(tracking_uri=tracking_uri)
            reply = (True, getattr(client, method)(*args, **kwargs))
        except Exception as err:
            reply = (False, _portable(err))
        try:
            conn.send(reply)
        except OSError:  # the parent is gone (killed) while this call ran
            return
        except (pickle.PicklingError, TypeError, AttributeError) as err:  # a result that cannot travel
            conn.send((False, _portable(StoreProcessError(f"{method} returned what cannot be sent back: {err}"))))


def _main(argv: list[str]) -> None:
    """The child's entry: serve on socket ``argv[0]`` for store ``argv[1]`` with logger levels ``argv[2]``."""
    _serve(int(argv[0]), argv[1], json.loads(argv[2]))
    # Every call is applied and answered (the store commits each one): skip the interpreter's
    # teardown of MLflow and SQLAlchemy, most of a second that the sweep's exit would wait for.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
