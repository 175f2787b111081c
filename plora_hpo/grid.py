"""A grid sampler that hands every grid point to exactly one trial, in the grid's order.

Optuna's ``GridSampler`` gives trial ``n`` grid point ``n`` while ``n`` is below the grid size,
and otherwise a random point among those no trial holds yet. Once a resumed sweep's retries and
failed originals have used up the low trial numbers, concurrent ``study.optimize`` threads pick
at random from the same free set and two of them can take one point (one config trained twice,
another never). This sampler picks the lowest free point of Optuna's (seeded) grid order under a
lock, so threads of one process never share a point and a resumed sweep trains the points an
uninterrupted one would, in the same order.

A point is held by any trial that carries its ``grid_id`` (finished or running, as Optuna counts
them) and by any trial whose enqueued ``fixed_params`` equal it (retries waiting to run, trials a
user enqueued), so enqueuing a grid point does not train it a second time. A sweep enqueues its
whole grid up front (:meth:`OrderedGridSampler.queue`): the lock above serves one process only,
while taking a waiting trial is atomic across all of them.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from typing import Any

import optuna
from optuna.samplers import GridSampler
from optuna.trial import FrozenTrial


class OrderedGridSampler(GridSampler):
    """``GridSampler`` whose new trials take the lowest grid point no trial holds."""

    def __init__(self, search_space: Mapping[str, Sequence[Any]], seed: int | None = None) -> None:
        super().__init__(search_space, seed=seed)
        self._lock = threading.Lock()
        self._index = {tuple(point): i for i, point in enumerate(self._all_grids)}

    def before_trial(self, study: optuna.Study, trial: FrozenTrial) -> None:
        if "grid_id" in trial.system_attrs or "fixed_params" in trial.system_attrs:
            return  # a retry or an enqueued trial: its params are given
        with self._lock:  # choose and record before another thread looks
            held = self.held_points(study)
            free = [i for i in range(len(self._all_grids)) if i not in held]
            if not free:  # more trials than grid points: Optuna's own choice (and warning)
                super().before_trial(study, trial)
                return
            study._storage.set_trial_system_attr(trial._trial_id, "search_space", self._search_space)
            study._storage.set_trial_system_attr(trial._trial_id, "grid_id", free[0])

    def points(self, n: int | None = None) -> list[dict[str, Any]]:
        """The first ``n`` grid points (all of them without ``n``), in the order a fresh sweep's
        trials take them: the configs a grid sweep of ``n`` trials trains."""
        return [dict(zip(self._param_names, point)) for point in self._all_grids[:n]]

    def queue(self, study: optuna.Study, n_trials: int) -> int:
        """Enqueue grid points no trial holds, in grid order, until ``n_trials`` points are held.

        Each goes in as a WAITING trial carrying its params and grid point. Processes that share
        the study take waiting trials atomically (see :mod:`plora_hpo.storage`), so every point
        trains exactly once however many workers serve the study. Returns how many were enqueued.
        """
        held = self.held_points(study)
        added = 0
        for i, point in enumerate(self._all_grids):
            if len(held) >= n_trials:
                break
            if i in held:
                continue
            trial = optuna.trial.create_trial(
                state=optuna.trial.TrialState.WAITING,
                system_attrs={
                    "fixed_params": dict(zip(self._param_names, point)),
                    "grid_id": i,
                    "search_space": self._search_space,
                },
            )
            study.add_trial(trial)
            held.add(i)
            added += 1
        return added

    def held_points(self, study: optuna.Study) -> set[int]:
        """Grid ids that a trial of ``study`` has trained, is training or is queued to train."""
        held: set[int] = set()
        for t in study._storage.get_all_trials(study._study_id, deepcopy=False):
            grid_id = t.system_attrs.get("grid_id")
            if grid_id is not None and self._same_search_space(t.system_attrs["search_space"]):
                held.add(grid_id)
            fixed = t.system_attrs.get("fixed_params")
            if fixed is not None:
                point = self._index.get(tuple(fixed.get(name) for name in self._param_names))
                if point is not None:
                    held.add(point)
        return held
