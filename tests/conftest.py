"""Shared fixtures: real data location, a real MLflow server and a PostgreSQL server on 127.0.0.1."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import torch

from .net import free_port

os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)  # one thread per xdist worker: oversubscribed OpenMP threads spin-wait
if not torch.cuda.is_available():  # before anything imports triton: kernels run on its CPU interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")

REPO = Path(__file__).resolve().parents[1]


def child_pythonpath() -> str:
    """``PYTHONPATH`` for a test's child interpreter: the repository, then the caller's own (where an
    environment such as the GPU image keeps the packages it added)."""
    return os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])


class FakeClock:
    """A clock a test moves by hand (``clock.now += seconds``)."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


def test_data_dir() -> Path | None:
    """The real GSM8K/GLUE copies: $PLORA_HPO_TEST_DATA, else ../shared/data beside the repo."""
    path = Path(os.environ.get("PLORA_HPO_TEST_DATA", REPO.parent / "shared" / "data")).resolve()
    return path if path.is_dir() else None


@pytest.fixture(scope="session")
def data_dir() -> Path:
    path = test_data_dir()
    if path is None:
        pytest.skip("real task data not found: set PLORA_HPO_TEST_DATA to the shared/data folder")
    return path


class MlflowServer:
    """A real ``mlflow server`` (sqlite backend) that tests can stop and restart."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.port = free_port()
        self.uri = f"http://127.0.0.1:{self.port}"
        self.process: subprocess.Popen | None = None

    def start(self, timeout: float = 90.0) -> None:
        self.process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "mlflow",
                "server",
                "--backend-store-uri",
                f"sqlite:///{self.root / 'mlflow.db'}",
                "--artifacts-destination",
                str(self.root / "artifacts"),
                "--host",
                "127.0.0.1",
                "--port",
                str(self.port),
                "--workers",
                "1",
            ],
            stdout=subprocess.DEVNULL,
            start_new_session=True,  # its own process group, so stop() ends the workers too
            stderr=open(self.root / "server.log", "ab"),  # noqa: SIM115
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(f"{self.uri}/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                time.sleep(0.5)
        raise RuntimeError(f"mlflow server did not start; see {self.root / 'server.log'}")

    def stop(self) -> None:
        """Kill the server and its workers at once (a dead server is what outage tests want)."""
        if self.process is not None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(timeout=30)
            self.process = None


@pytest.fixture(scope="session")
def mlflow_server(tmp_path_factory) -> MlflowServer:
    server = MlflowServer(tmp_path_factory.mktemp("mlflow-server"))
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def postgres():
    """A PostgreSQL server on 127.0.0.1 for this test session; ``postgres.new_database()`` gives a URL."""
    import shutil
    import tempfile

    from .postgres import PostgresServer

    base = Path(tempfile.mkdtemp(prefix="plora-pg-"))  # pytest's tmp dirs are closed to the postgres user
    server = PostgresServer(base)
    yield server
    server.stop()
    shutil.rmtree(base, ignore_errors=True)
