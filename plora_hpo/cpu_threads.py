"""How many threads CPU training and evaluation use: the cores actually free, not all of them.

torch defaults to one intra-op thread per core. On a machine whose cores are already busy
(another job, a test runner, a second sweep) OpenMP threads that outnumber the free cores spin
and wait for each other, and a step can take several times longer than with fewer threads. A
sweep on the CPU therefore sizes its thread pool from the cores this process may run on minus
those other processes keep busy right now: the machine's busy time over a quarter of a second
(``/proc/stat``; the one-minute load average where that does not exist, which lags behind). An
explicit ``OMP_NUM_THREADS`` (or a smaller thread count the caller already set) is left alone.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch

SAMPLE_SECONDS = 0.25


def busy_cores(seconds: float = SAMPLE_SECONDS) -> float:
    """Cores kept busy by running processes over the next ``seconds`` (this one is asleep then)."""
    stat = Path("/proc/stat")
    if not stat.is_file():
        try:
            return os.getloadavg()[0]
        except OSError:  # no load average on this platform either
            return 0.0

    def sample() -> tuple[int, int]:
        fields = [int(v) for v in stat.read_text().split("\n", 1)[0].split()[1:]]
        idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
        return sum(fields), idle

    total0, idle0 = sample()
    time.sleep(seconds)
    total1, idle1 = sample()
    elapsed = total1 - total0
    return 0.0 if elapsed <= 0 else (os.cpu_count() or 1) * (1 - (idle1 - idle0) / elapsed)


def available_cores() -> int:
    """Cores this process may run on, less those other processes keep busy; at least 1."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, min(cores, cores - round(busy_cores())))


def use_available_cores() -> int:
    """Set torch's intra-op threads to :func:`available_cores` unless ``OMP_NUM_THREADS`` is set
    or torch was already told a smaller count; returns the count in use."""
    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(min(torch.get_num_threads(), available_cores()))
    return torch.get_num_threads()
