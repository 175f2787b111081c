"""CPU sweeps size torch's thread pool from the free cores, and leave an explicit choice alone."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import torch

from plora_hpo import cpu_threads


def test_busy_cores_are_not_counted(monkeypatch):
    monkeypatch.setattr(cpu_threads.os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    monkeypatch.setattr(cpu_threads, "busy_cores", lambda: 1.7)
    assert cpu_threads.available_cores() == 2
    monkeypatch.setattr(cpu_threads, "busy_cores", lambda: 9.0)
    assert cpu_threads.available_cores() == 1  # never below one


def test_a_process_spinning_on_a_core_counts_as_one_busy_core():
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.5)
        assert 0.6 < cpu_threads.busy_cores(1.0) <= (os.cpu_count() or 1) + 1e-6
    finally:
        spinner.kill()
        spinner.wait()


def test_threads_follow_free_cores_unless_omp_num_threads_is_set(monkeypatch):
    before = torch.get_num_threads()
    monkeypatch.setattr(cpu_threads, "available_cores", lambda: 1)
    try:
        torch.set_num_threads(2)
        monkeypatch.setenv("OMP_NUM_THREADS", "2")
        assert cpu_threads.use_available_cores() == 2  # the user's choice
        monkeypatch.delenv("OMP_NUM_THREADS")
        assert cpu_threads.use_available_cores() == 1
    finally:
        torch.set_num_threads(before)
