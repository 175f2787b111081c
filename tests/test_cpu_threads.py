"""CPU sweeps size torch's thread pool from the free cores, and leave an explicit choice alone."""

from __future__ import annotations

import torch

from plora_hpo import cpu_threads


def test_busy_cores_are_not_counted(monkeypatch):
    monkeypatch.setattr(cpu_threads.os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    monkeypatch.setattr(cpu_threads.os, "getloadavg", lambda: (2.7, 0.0, 0.0))
    assert cpu_threads.available_cores() == 2
    monkeypatch.setattr(cpu_threads.os, "getloadavg", lambda: (9.0, 0.0, 0.0))
    assert cpu_threads.available_cores() == 1  # never below one


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
