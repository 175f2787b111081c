"""The worker processes ``plora-hpo sweep`` starts on its own machine: one per device.

A worker process spends its first seconds importing torch, transformers, lm-eval and MLflow,
then loading the base model and the task data. The sweep starts its workers as soon as it knows
its devices (the CLI: once it has read the sweep file, importing torch only to count GPUs), before
it imports the rest, checks its inputs and opens its stores, so that this overlaps the sweep's own
start-up: the sweep writes each process its settings at once (one JSON object on stdin), and the
process imports, loads its :class:`~plora_hpo.replica.Replica` for them, imports what opening
the stores will need, then waits on its stdin for the study to serve
(:meth:`LocalWorkers.serve` writes the arguments of ``plora-hpo worker``, as one JSON list).
Settings the sweep's checks then reject cost nothing but the load: a load that fails is dropped,
and a sweep that stops before giving a study ends its workers (:meth:`LocalWorkers.stop`); one
that dies takes them with it (``PR_SET_PDEATHSIG``).

A worker process tells the sweep it is done — its trials finished or handed back, its records
and MLflow runs closed — on a pipe of its own, with the exit code it is about to exit with
(:func:`report_done`): the sweep then closes (merges the pack records, draws the chart, logs the
summary) while the process exits (a CUDA process gives its GPU back), and only then waits for the
exit (:meth:`LocalWorkers.reap`). A process that dies reports nothing: the end of its pipe says
so, and its exit status is the code.

Each process sees only its GPU (``CUDA_VISIBLE_DEVICES``) or, on the CPU, its share of the
cores; with ``degree`` > 1, each ``degree`` consecutive devices form one tensor-parallel group
with a rendezvous port of its own, set in the environment the way ``torchrun`` sets it.

Boundary: starting and ending the processes and handing them their arguments; what a worker
does is :class:`plora_hpo.cluster.SweepWorker`'s.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib
import json
import logging
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from plora_hpo.config import SweepConfig
    from plora_hpo.replica import Replica

log = logging.getLogger(__name__)

AWAIT_ARGUMENTS = "--await-arguments"
"""``plora-hpo worker --await-arguments``: import first, then read the worker's arguments from stdin."""
AWAIT_STUDY_PHASE = "await-study"
"""The timeline's phase of a worker process that loaded ahead and waits for its study."""
DONE_FD_ENV = "PLORA_HPO_DONE_FD"
"""Environment of a sweep's own worker process: the pipe it reports its exit code on."""

_done_fd: int | None = None  # in a sweep's own worker process: that pipe, taken out of the environment


def report_done(code: int) -> None:
    """In a sweep's own worker process, once everything it opened is closed: tell the sweep the
    exit code it is about to exit with (nothing in any other process)."""
    global _done_fd
    if _done_fd is None:
        return
    with contextlib.suppress(OSError):  # a sweep that is gone reads nothing
        os.write(_done_fd, f"{code}\n".encode())
        os.close(_done_fd)
    _done_fd = None


def _read_done(fd: int) -> int | None:
    """The exit code a worker process reported on its pipe, or None if it closed without one (died)."""
    data = b""
    while not data.endswith(b"\n") and (chunk := os.read(fd, 64)):
        data += chunk
    os.close(fd)
    try:
        return int(data)
    except ValueError:
        return None


def await_arguments() -> tuple[list[str], Replica | None]:
    """In a started worker process: import what a worker uses, load the replica for the sweep's
    settings if it sent them, then wait for the worker's arguments.

    Returns ``plora-hpo worker``'s arguments and the replica (None without settings, or when
    loading failed); exits quietly when the sweep closes stdin first (it stopped before it had a
    study to give).
    """
    global _done_fd
    if (fd := os.environ.pop(DONE_FD_ENV, None)) is not None:  # not for the processes this one starts
        _done_fd = int(fd)
    import lm_eval.evaluator  # noqa: F401  (the imports this process would make anyway, done while it waits)
    import mlflow.tracking  # noqa: F401

    import plora_hpo.cluster
    import plora_hpo.models  # noqa: F401
    from plora_hpo.timeline import phase

    line = sys.stdin.readline()
    replica = None
    if line and isinstance(request := json.loads(line), dict):
        replica = _preload(request)
        _import_stores()
        with phase(AWAIT_STUDY_PHASE):
            line = sys.stdin.readline()
    if not line:
        raise SystemExit(0)
    return ["worker", *json.loads(line)], replica


def _preload(request: dict[str, Any]) -> Replica | None:
    """The replica for the settings the sweep wrote (``config``, ``device``, ``data_dir``), or None."""
    from plora_hpo.config import SweepConfig
    from plora_hpo.devices import resolve_devices
    from plora_hpo.replica import load_replica

    try:
        config = SweepConfig.model_validate(request["config"])
        return load_replica(config, resolve_devices(request["device"])[0], request["data_dir"])
    except Exception as err:  # the sweep's own checks report bad settings; the study's are loaded later
        log.info("loading ahead failed (%s: %s); loading once given the study", type(err).__name__, err)
        return None


def _import_stores() -> None:
    """Import what opening the study's stores imports on first use (SQL storages check their
    schema with alembic; MLflow's SQL tracking store is its own module): a second or so that
    would otherwise come between being given the study and the first step."""
    for module in ("alembic.command", "alembic.migration", "mlflow.store.tracking.sqlalchemy_store"):
        with contextlib.suppress(ImportError):  # a store that is not SQL does without
            importlib.import_module(module)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:
    """In the child before exec: the kernel kills it when the sweep process dies (Linux)."""
    with contextlib.suppress(OSError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


class LocalWorkers:
    """One started ``plora-hpo worker`` process per device of this machine, waiting for a study.

    Args:
        devices: one process per entry (``cuda:N`` or ``cpu``), as the sweep names them
            (:attr:`assigned`).
        degree: processes per tensor-parallel group.
        preload: the settings of the study the processes will serve (one task), for each to load
            its base model and data while it waits; None (and with ``degree`` > 1, whose groups
            split the model once formed) to load only when given the study.
        data_dir: the data directory the study's settings will name (as for ``--data-dir``).
    """

    def __init__(
        self,
        devices: Sequence[str],
        *,
        degree: int = 1,
        preload: SweepConfig | None = None,
        data_dir: str | None = None,
    ) -> None:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        gpu_ids = visible.split(",") if visible else None
        cpu_workers = sum(d.startswith("cpu") for d in devices)
        self.assigned = list(devices)
        self.devices: list[str] = []  # each process's device, as it names it
        self.processes: list[subprocess.Popen] = []
        self._done: list[int] = []  # the read end of each process's pipe to report_done()
        self._reported: list[subprocess.Popen] = []  # done serving, exiting
        self._given = False
        port = 0
        try:
            for i, device in enumerate(devices):
                env = dict(os.environ)
                if degree > 1:
                    from plora_hpo.pack_group import group_environment  # torch.distributed: only for groups

                    port = _free_port() if i % degree == 0 else port
                    env.update(group_environment(i % degree, degree, port))
                if device.startswith("cuda"):
                    index = int(device.partition(":")[2] or 0)
                    env["CUDA_VISIBLE_DEVICES"] = gpu_ids[index] if gpu_ids else str(index)
                    device = "cuda:0"
                elif "OMP_NUM_THREADS" not in env:
                    env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // cpu_workers))
                command = [sys.executable, "-m", "plora_hpo.cli", "worker", AWAIT_ARGUMENTS]
                done, child_end = os.pipe()
                self._done.append(done)
                env[DONE_FD_ENV] = str(child_end)
                try:
                    process = subprocess.Popen(
                        command,
                        env=env,
                        stdin=subprocess.PIPE,
                        text=True,
                        preexec_fn=_die_with_parent,
                        pass_fds=(child_end,),
                    )
                finally:
                    os.close(child_end)  # the child's copy alone keeps the pipe open
                self.processes.append(process)
                self.devices.append(device)
                if preload is not None and degree == 1:
                    request = {"config": preload.model_dump(mode="json"), "device": device, "data_dir": data_dir}
                    assert process.stdin is not None
                    with contextlib.suppress(BrokenPipeError):  # one that died at start: serve() finds out
                        process.stdin.write(json.dumps(request) + "\n")
                        process.stdin.flush()
        except BaseException:
            self.stop()
            raise

    @classmethod
    def for_task(cls, config: SweepConfig, task: str, devices: Sequence[str], *, data_dir: str | None) -> LocalWorkers:
        """One process per device for the study of ``task``, loading its base model and data while it waits."""
        preload = config.model_copy(update={"tasks": [task]})
        return cls(devices, degree=config.pack.degree, preload=preload, data_dir=data_dir)

    def serve(
        self,
        storage: str,
        study: str,
        *,
        run_dir: Path,
        data_dir: str | None,
        mlflow_uri: str,
        heartbeat: float,
    ) -> list[subprocess.Popen]:
        """Give every process ``study`` to serve; returns the processes (wait on them)."""
        for process, device in zip(self.processes, self.devices, strict=True):
            argv = ["--storage", storage, "--study", study, "--run-dir", str(run_dir), "--device", device]
            argv += ["--mlflow-uri", mlflow_uri, "--heartbeat", f"{heartbeat:g}"]
            argv += ["--data-dir", data_dir] if data_dir else []
            assert process.stdin is not None
            with contextlib.suppress(BrokenPipeError):  # one that died at start: its exit code says so
                process.stdin.write(json.dumps(argv) + "\n")
                process.stdin.close()
        self._given = True
        return self.processes

    def wait_done(self) -> list[int]:
        """Wait until every process served its study: the exit code each reported, or for one
        that died, its exit status. The processes may still be exiting (:meth:`reap`)."""
        codes = []
        for process, done in zip(self.processes, self._done, strict=True):
            code = _read_done(done)
            codes.append(process.wait() if code is None else code)
            self._reported.append(process)
        self._done = []
        return codes

    def reap(self) -> None:
        """Wait for the processes that reported done to exit (others, still serving when the
        sweep stopped waiting, end with it)."""
        for process in self._reported:
            process.wait()

    def stop(self) -> None:
        """End the processes if they were never given a study (the sweep stopped before)."""
        if self._given:
            return
        for done in self._done:
            os.close(done)
        self._done = []
        for process in self.processes:
            if process.stdin is not None:
                with contextlib.suppress(OSError):
                    process.stdin.close()
            process.kill()
            process.wait()
