"""Filling starting packs with the configs a plan leaves for a later wave, as a sweep does.

The job planner times a pack as if its members ran together until each one's own steps are done,
and DTM keeps a config out of a pack when it lowers that pack's tokens per second. A sweep lets a
member leave when its steps are done and refills the slot, so a config deferred under that view
would wait for the first device to free up and then run on it nearly alone, ending the sweep
late; joining a starting pack that has room costs that pack little. The sweep's admission and the
ahead-of-time plan (``plora-hpo plan``) both apply this rule, so the plan predicts the packs the
sweep starts.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence


def spread_deferred(
    packs: list[list[int]],
    deferred: Iterable[int],
    steps: Sequence[int],
    *,
    fits: Callable[[int, list[int]], bool],
    seconds: Callable[[int, list[int]], float],
) -> list[int]:
    """Give the ``deferred`` items to the starting ``packs`` they fit in, longest first (by
    ``steps[item]``), each to the pack that then ends earliest; returns the items placed.

    ``packs`` are lists of items (indices the callers define), changed in place and left sorted.
    ``fits(k, items)`` says whether pack ``k`` may run with ``items`` (slots, memory);
    ``seconds(k, items)`` is how long pack ``k`` with ``items`` runs.
    """
    placed: list[int] = []
    for item in sorted(deferred, key=lambda i: -steps[i]):
        best, best_end = None, math.inf
        for k, pack in enumerate(packs):
            together = [*pack, item]
            if not fits(k, together):
                continue
            end = seconds(k, together)
            if end < best_end:
                best, best_end = k, end
        if best is not None:
            packs[best].append(item)
            placed.append(item)
    for pack in packs:
        pack.sort()
    return placed
