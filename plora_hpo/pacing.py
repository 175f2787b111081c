"""A cap on the share of wall time that a recurring side job may take from training.

Checkpoint saves and live loss curves both run between (or beside) training steps and both are
worth skipping now and then rather than slowing every step: each keeps a :class:`SharePacer`
that measures what the job has cost so far and says whether the next one still fits.

Boundary: the arithmetic of the share; what is skipped, and how it is timed, is the caller's.
"""

from __future__ import annotations

import time
from collections.abc import Callable


class SharePacer:
    """Keeps the seconds a side job takes under ``share`` of the wall time since the pacer started.

    Sizes are in whatever the job's cost is proportional to (LoRA parameters for a checkpoint, one
    per call for a live curve). The cost of the next job is predicted from the seconds per unit of
    size of the jobs so far (the first is always affordable: it is the measurement). A job that
    would push the total above ``share`` of the time since the start is to be skipped; the caller
    asks again for the next one.
    """

    def __init__(self, share: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.share = share
        self.clock = clock
        self.started = clock()
        self.spent = 0.0
        self.done = 0

    def affordable(self, size: int) -> bool:
        if self.done == 0:
            return True
        predicted = self.spent * size / self.done
        return self.spent + predicted <= self.share * (self.clock() - self.started)

    def record(self, size: int, seconds: float) -> None:
        self.spent += seconds
        self.done += max(1, size)
