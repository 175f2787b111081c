"""A sweep whose run directory fills up stops with one ``error:`` line (no tracebacks), and a rerun
once there is room finishes every trial, resuming from the checkpoints that were written."""

from __future__ import annotations

import os
import shutil
import sqlite3
import subprocess
import sys
from pathlib import Path

import optuna
import pytest
from optuna.trial import TrialState

from .test_sweep_e2e import small_sweep

pytestmark = pytest.mark.slow


@pytest.fixture
def small_disk(tmp_path):
    """A 256 MB tmpfs (needs root, as CI has); unmounted afterwards."""
    mount = tmp_path / "disk"
    mount.mkdir()
    made = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256m", "tmpfs", str(mount)], capture_output=True)
    if made.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {made.stderr.decode().strip()}")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=False)


def sweep(sweep_file, run_dir) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "plora_hpo.cli", "sweep", str(sweep_file), "--run-dir", str(run_dir)],
        capture_output=True,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        timeout=600,
    )


def stops_with_one_line(sweep_file, run_dir, capsys) -> str:
    """Run the sweep in this process (where the faults are injected): exit 2, one ``error: no space
    left`` line, no traceback. Returns that line."""
    from plora_hpo.cli import main

    code = main(["sweep", str(sweep_file), "--run-dir", str(run_dir)])
    out = capsys.readouterr()
    assert code == 2, out.err[-3000:]
    errors = [line for line in out.err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "no space left" in errors[0], out.err[-3000:]
    assert "Traceback" not in out.err + out.out
    return errors[0]


def rerun_trains_every_grid_point(sweep_file, run_dir, study_name: str) -> None:
    resumed = sweep(sweep_file, run_dir)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    study = optuna.load_study(study_name=study_name, storage=f"sqlite:///{run_dir / 'optuna.db'}")
    done = [t for t in study.trials if t.state == TrialState.COMPLETE]
    assert sorted(t.system_attrs["grid_id"] for t in done) == [0, 1, 2, 3]  # each grid point once


def test_a_full_disk_stops_with_one_line_and_a_rerun_with_room_finishes(tmp_path, small_disk):
    sweep_file = small_sweep(tmp_path, name="full", budget={"steps": 6}, train={"checkpoint_every": 2})
    run_dir = small_disk / "runs"
    filler = small_disk / "filler"
    filler.write_bytes(b"\0" * (248 << 20))  # ~8 MB left: the stores fit, the first checkpoints do not

    stopped = sweep(sweep_file, run_dir)
    assert stopped.returncode == 2, stopped.stderr[-3000:]
    errors = [line for line in stopped.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "no space left" in errors[0], stopped.stderr[-3000:]
    assert "Traceback" not in stopped.stderr + stopped.stdout

    filler.unlink()
    rerun_trains_every_grid_point(sweep_file, run_dir, "full-synthetic")


def test_a_disk_that_fills_while_a_finished_adapter_is_written_stops_the_sweep_the_same_way(
    tmp_path, small_disk, monkeypatch, capsys
):
    """The adapter files are written beside the training loop: a full disk there still stops the
    sweep with one line, leaves no half-written adapter and no FAILED run, and a rerun finishes."""
    from mlflow.tracking import MlflowClient

    from plora_hpo.engine.export import PeftAdapterFiles

    sweep_file = small_sweep(tmp_path, name="fullexport", budget={"steps": 4}, train={"checkpoint_every": 2})
    run_dir = small_disk / "runs"
    filler = small_disk / "filler"
    real_write = PeftAdapterFiles.write
    writes: list[Path] = []

    def write_onto_a_full_disk(self, directory):  # fault injection: the disk fills just before the first write
        writes.append(directory)
        if not filler.exists():
            filler.write_bytes(b"\0" * (shutil.disk_usage(small_disk).free - (1 << 20)))  # 1 MB left
        return real_write(self, directory)

    monkeypatch.setattr(PeftAdapterFiles, "write", write_onto_a_full_disk)
    # mostly the line names the finished adapter; a database write that meets the disk while the
    # adapter's partial file fills it names the database instead (the same stop, the same rerun)
    stops_with_one_line(sweep_file, run_dir, capsys)
    assert not [p for p in (run_dir / "adapters").iterdir() if p.name.startswith(".")]  # no half-written adapter
    # the records behind the failed one resumed their trials without writing: each write would have
    # filled the disk again while the stores wrote the trials' retries
    assert len(writes) == 1, writes
    client = MlflowClient(f"sqlite:///{run_dir / 'mlflow.db'}")
    runs = client.search_runs([e.experiment_id for e in client.search_experiments()])
    trial_runs = [r for r in runs if "plora.trial_number" in r.data.tags]
    assert trial_runs and {r.info.status for r in trial_runs} <= {"KILLED", "FINISHED"}

    monkeypatch.undo()
    filler.unlink()
    rerun_trains_every_grid_point(sweep_file, run_dir, "fullexport-synthetic")


@pytest.mark.parametrize("store", ["mlflow", "optuna"])
def test_a_finished_trial_whose_record_meets_a_full_database_is_trained_again(store, tmp_path, monkeypatch, capsys):
    """SQLite says "database or disk is full" while a finished trial is recorded, in its MLflow run
    or in its Optuna trial (the other writers can fill a disk first): the sweep stops with one
    line, that trial is queued to resume like the rest (not FAILED, which a rerun would count as
    done), and a rerun finishes every grid point."""
    from plora_hpo import study as study_module
    from plora_hpo.reporting import MlflowReporter

    sweep_file = small_sweep(tmp_path, name="fulldb", budget={"steps": 4}, train={"checkpoint_every": 2})
    run_dir = tmp_path / "runs"
    failed: list[int] = []

    def full_once(record, number_of):  # fault injection: the first record meets a full database
        def recording(*args, **kwargs):
            if not failed:
                failed.append(number_of(*args))
                raise sqlite3.OperationalError("database or disk is full")
            return record(*args, **kwargs)

        return recording

    if store == "mlflow":
        recording = full_once(MlflowReporter.trial_completed, lambda reporter, slot, *_: slot.request.number)
        monkeypatch.setattr(MlflowReporter, "trial_completed", recording)
    else:
        recording = full_once(study_module.record_outcome, lambda trial, *_: trial.number)
        monkeypatch.setattr(study_module, "record_outcome", recording)
    stops_with_one_line(sweep_file, run_dir, capsys)
    study = optuna.load_study(study_name="fulldb-synthetic", storage=f"sqlite:///{run_dir / 'optuna.db'}")
    (original,) = [t for t in study.trials if t.number == failed[0]]
    assert original.user_attrs.get("interrupted") is True  # queued again, not a failure to keep

    monkeypatch.undo()
    rerun_trains_every_grid_point(sweep_file, run_dir, "fulldb-synthetic")
