"""A sweep's own worker processes: started before their study, ended when the sweep stops first."""

from __future__ import annotations

import subprocess
import sys

import pytest

from plora_hpo import run as run_module
from plora_hpo.config import load_sweep
from plora_hpo.errors import PloraError
from plora_hpo.local_workers import AWAIT_ARGUMENTS, LocalWorkers
from plora_hpo.run import SweepRun

from .test_sweep_e2e import small_sweep


def test_a_started_worker_exits_quietly_when_the_sweep_gives_it_no_study():
    done = subprocess.run(
        [sys.executable, "-m", "plora_hpo.cli", "worker", AWAIT_ARGUMENTS],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert (done.returncode, done.stdout, done.stderr) == (0, "", "")


def test_stop_ends_workers_never_given_a_study_and_leaves_served_ones(tmp_path):
    waiting = LocalWorkers(["cpu", "cpu"])
    assert waiting.devices == ["cpu", "cpu"]
    waiting.stop()
    assert all(p.returncode is not None for p in waiting.processes)

    served = LocalWorkers(["cpu"])
    storage = f"sqlite:///{tmp_path / 'optuna.db'}"
    [process] = served.serve(
        storage, "s", run_dir=tmp_path, data_dir=None, mlflow_uri=f"sqlite:///{tmp_path / 'm.db'}", heartbeat=10
    )
    served.stop()  # no longer the sweep's to end: it serves (here: it stops at the study that is not there)
    assert process.wait(timeout=300) == 2


def test_a_sweep_that_fails_its_checks_leaves_no_worker_process(tmp_path, monkeypatch):
    started: list[LocalWorkers] = []

    class Recorded(LocalWorkers):  # the real class, remembered so the test can look at its processes
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            started.append(self)

    monkeypatch.setattr(run_module, "LocalWorkers", Recorded)
    config = load_sweep(small_sweep(tmp_path, model=str(tmp_path / "no-such-model")))
    sweep = SweepRun(config, run_dir=tmp_path / "runs", device="cpu,cpu", processes=True)
    with pytest.raises(PloraError, match="no-such-model"):
        sweep.open()
    [workers] = started
    assert len(workers.processes) == 2 and all(p.poll() is not None for p in workers.processes)
    assert not (tmp_path / "runs").exists()
