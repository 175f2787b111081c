"""How many threads CPU training and evaluation use: the cores actually free, not all of them.

torch defaults to one intra-op thread per core. On a machine whose cores are already busy
(another job, a test runner, a second sweep) OpenMP threads that outnumber the free cores spin
and wait for each other, and a step can take several times longer than with fewer threads. A
sweep on the CPU therefore sizes its thread pool from the cores this process may run on minus
the load other processes put on them (the one-minute load average). An explicit
``OMP_NUM_THREADS`` (or a thread count the caller already set) is left alone.
"""

from __future__ import annotations

import math
import os

import torch


def available_cores() -> int:
    """Cores this process may run on, less those the recent load keeps busy; at least 1."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    try:
        busy = math.floor(os.getloadavg()[0])
    except OSError:  # no load average on this platform
        busy = 0
    return max(1, min(cores, cores - busy))


def use_available_cores() -> int:
    """Set torch's intra-op threads to :func:`available_cores` unless ``OMP_NUM_THREADS`` is set
    or torch was already told a smaller count; returns the count in use."""
    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(min(torch.get_num_threads(), available_cores()))
    return torch.get_num_threads()
