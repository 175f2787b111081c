"""Search space → Optuna distributions, grids and :class:`AdapterConfig` objects.

Optuna parameter names are the sweep file's keys (``rank``, ``alpha_multiplier``,
``learning_rate``, ``batch_size`` and, when the file gives it, ``lora_dropout``), so studies stay
readable in optuna-dashboard.
"""

from __future__ import annotations

import hashlib
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
        return self.spec.params()

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
        """Ask an Optuna trial for one config, seeded by its hyperparameters (:meth:`config_seed`)."""
        params: dict[str, Any] = {}
        for name, p in self._params():
            if p.is_categorical:
                choices = [int(v) if name in _INTEGER_PARAMS else float(v) for v in p.choices]
                params[name] = trial.suggest_categorical(name, choices)
            elif name in _INTEGER_PARAMS:
                params[name] = trial.suggest_int(name, int(p.low), int(p.high), log=p.log)
            else:
                params[name] = trial.suggest_float(name, p.low, p.high, log=p.log)
        return self.to_config(params, seed=self.config_seed(params))

    def config_seed(self, params: dict[str, Any]) -> int:
        """The seed of a config's initialisation and data order: the sweep seed and the
        hyperparameters, never the trial number, so a config trains the same whichever trial
        gets it — after a crash and resume as in an uninterrupted sweep."""
        key = ";".join(f"{name}={float(params[name])!r}" for name in sorted(params))
        digest = hashlib.sha256(f"{self.seed}|{key}".encode()).digest()
        return int.from_bytes(digest[:4], "little") & 0x7FFFFFFF

    def to_config(self, params: dict[str, Any], *, seed: int) -> AdapterConfig:
        rank = int(params["rank"])
        return AdapterConfig(
            rank=rank,
            alpha=float(params["alpha_multiplier"]) * rank,
            learning_rate=float(params["learning_rate"]),
            batch_size=int(params["batch_size"]),
            seed=seed,
            use_rslora=self.use_rslora,
            lora_dropout=float(params.get("lora_dropout", 0.0)),
        )

    def enumerate_configs(self, n_samples: int | None = None) -> list[AdapterConfig]:
        """Every grid point in order, or ``n_samples`` seeded random draws from a ranged space."""
        if self.is_grid and n_samples is None:
            grid = self.grid()
            points = [dict(zip(grid, values)) for values in itertools.product(*grid.values())]
        else:
            rng = random.Random(self.seed)
            points = [self._draw(rng) for _ in range(n_samples or 120)]
        return [self.to_config(p, seed=self.config_seed(p)) for p in points]

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
