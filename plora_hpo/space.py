"""Search space → Optuna distributions, grids and :class:`AdapterConfig` objects.

Optuna parameter names are the sweep file's keys (``rank``, ``alpha_multiplier``,
``learning_rate``, ``batch_size``), so studies stay readable in optuna-dashboard.
"""

from __future__ import annotations

import itertools
import random
from typing import Any

from plora_hpo.adapter import AdapterConfig
from plora_hpo.config import ParamSpec, SpaceSpec

_INTEGER_PARAMS = ("rank", "batch_size")


class SearchSpace:
    """The LoRA hyperparameter space of a sweep."""

    def __init__(self, spec: SpaceSpec, *, seed: int = 0, use_rslora: bool = False) -> None:
        self.spec = spec
        self.seed = seed
        self.use_rslora = use_rslora

    def _params(self) -> list[tuple[str, ParamSpec]]:
        return list(self.spec)

    @property
    def is_grid(self) -> bool:
        return all(p.is_categorical for _, p in self._params())

    def distributions(self) -> dict[str, Any]:
        """Optuna distributions, for ``study.ask(fixed_distributions=...)``."""
        import optuna.distributions as d

        out: dict[str, Any] = {}
        for name, p in self._params():
            if p.is_categorical:
                values = [int(v) if name in _INTEGER_PARAMS else float(v) for v in p.choices]
                out[name] = d.CategoricalDistribution(values)
            elif name in _INTEGER_PARAMS:
                out[name] = d.IntDistribution(int(p.low), int(p.high), log=p.log)
            else:
                out[name] = d.FloatDistribution(p.low, p.high, log=p.log)
        return out

    def grid(self) -> dict[str, list[Any]]:
        """The grid for ``optuna.samplers.GridSampler``; needs every parameter categorical."""
        if not self.is_grid:
            raise ValueError("the grid sampler needs 'choices' for every parameter")
        return {name: list(dist.choices) for name, dist in self.distributions().items()}

    def grid_size(self) -> int:
        size = 1
        for values in self.grid().values():
            size *= len(values)
        return size

    def suggest(self, trial: Any) -> AdapterConfig:
        """Ask an Optuna trial for one config. A retry of a crashed trial (user attr ``lineage``)
        gets its predecessor's seed, so it reproduces the same initialisation and data order."""
        params: dict[str, Any] = {}
        for name, p in self._params():
            if p.is_categorical:
                choices = [int(v) if name in _INTEGER_PARAMS else float(v) for v in p.choices]
                params[name] = trial.suggest_categorical(name, choices)
            elif name in _INTEGER_PARAMS:
                params[name] = trial.suggest_int(name, int(p.low), int(p.high), log=p.log)
            else:
                params[name] = trial.suggest_float(name, p.low, p.high, log=p.log)
        lineage = getattr(trial, "user_attrs", {}).get("lineage", trial.number)
        return self.to_config(params, seed=self.trial_seed(lineage))

    def trial_seed(self, trial_number: int) -> int:
        """Each trial gets its own seed (init and data order), derived from the sweep seed."""
        return self.seed * 100_003 + trial_number

    def to_config(self, params: dict[str, Any], *, seed: int) -> AdapterConfig:
        rank = int(params["rank"])
        return AdapterConfig(
            rank=rank,
            alpha=float(params["alpha_multiplier"]) * rank,
            learning_rate=float(params["learning_rate"]),
            batch_size=int(params["batch_size"]),
            seed=seed,
            use_rslora=self.use_rslora,
        )

    def enumerate_configs(self, n_samples: int | None = None) -> list[AdapterConfig]:
        """Every grid point in order, or ``n_samples`` seeded random draws from a ranged space."""
        if self.is_grid and n_samples is None:
            grid = self.grid()
            points = [dict(zip(grid, values)) for values in itertools.product(*grid.values())]
        else:
            rng = random.Random(self.seed)
            points = [self._draw(rng) for _ in range(n_samples or 120)]
        return [self.to_config(p, seed=self.trial_seed(i)) for i, p in enumerate(points)]

    def _draw(self, rng: random.Random) -> dict[str, Any]:
        import math

        point: dict[str, Any] = {}
        for name, p in self._params():
            if p.is_categorical:
                point[name] = rng.choice(p.choices)
            elif p.log:
                point[name] = math.exp(rng.uniform(math.log(p.low), math.log(p.high)))
            else:
                point[name] = rng.uniform(p.low, p.high)
            if name in _INTEGER_PARAMS:
                point[name] = round(point[name])
        return point

    def contains(self, params: dict[str, Any]) -> bool:
        """Whether a point (e.g. the reference trial) lies inside this space."""
        for name, p in self._params():
            value = params.get(name)
            if value is None:
                return False
            if p.is_categorical and not any(abs(value - c) <= 1e-12 * abs(c) for c in p.choices):
                return False
            if not p.is_categorical and not (p.low <= value <= p.high):
                return False
        return True
