"""One owner per run directory: a second sweep on a live run directory is refused; a dead owner's is not."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from plora_hpo.cli import main
from plora_hpo.ownership import OWNER_FILE, RunDirInUse, RunDirOwner

from .test_sweep_e2e import small_sweep


def wait_for_owner(run_dir, pid, timeout=60.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if json.loads((run_dir / OWNER_FILE).read_text())["pid"] == pid:
                return
        except (OSError, ValueError, KeyError):
            pass
        time.sleep(0.1)
    raise AssertionError(f"pid {pid} never took {run_dir}")


def test_a_second_sweep_is_refused_while_the_first_lives_and_admitted_after_kill_9(tmp_path, capsys):
    sweep_file = small_sweep(tmp_path, name="owner")
    run_dir = tmp_path / "runs"
    first = subprocess.Popen(
        [sys.executable, "-m", "plora_hpo.cli", "sweep", str(sweep_file), "--run-dir", str(run_dir)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        wait_for_owner(run_dir, first.pid)
        before = sorted(p.name for p in run_dir.iterdir())
        assert main(["sweep", str(sweep_file), "--run-dir", str(run_dir)]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error: ")
        assert f"in use by pid {first.pid}" in err[0] and "--run-dir" in err[0]
        assert sorted(p.name for p in run_dir.iterdir()) == before  # the refused sweep wrote nothing
    finally:
        os.killpg(first.pid, signal.SIGKILL)
        first.wait()
    with RunDirOwner(run_dir):  # the kernel dropped the dead owner's lock
        assert json.loads((run_dir / OWNER_FILE).read_text())["pid"] == os.getpid()


def test_owner_lock_is_exclusive_between_processes_and_released_on_exit(tmp_path):
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; from pathlib import Path; from plora_hpo.ownership import RunDirOwner; "
            "o = RunDirOwner(Path(sys.argv[1])); o.acquire(); print('held', flush=True); time.sleep(60)",
            str(tmp_path),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(RunDirInUse, match=f"pid {holder.pid} on "):
            RunDirOwner(tmp_path).acquire()
    finally:
        holder.kill()
        holder.wait()
    owner = RunDirOwner(tmp_path)
    owner.acquire()
    owner.release()
