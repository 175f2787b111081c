"""Search spaces: the paper grid, Optuna distributions, and configs built from trial params."""

from __future__ import annotations

from pathlib import Path

import optuna
import pytest
import yaml

from plora_hpo.config import load_sweep
from plora_hpo.space import SearchSpace
from plora_hpo.study import REFERENCE_PARAMS

SPACES = Path(__file__).resolve().parents[1] / "search_spaces"


def space_of(name: str) -> SearchSpace:
    config = load_sweep(SPACES / name)
    return SearchSpace(config.space, seed=config.seed)


def test_paper120_is_the_design_grid():
    space = space_of("paper120.yaml")
    configs = space.enumerate_configs()
    assert len(configs) == space.grid_size() == 120
    assert {c.rank for c in configs} == {8, 16, 32, 64, 128}
    assert {c.alpha / c.rank for c in configs} == {0.25, 1.0, 4.0}
    assert {c.learning_rate for c in configs} == {2e-5, 1e-4, 2e-4, 4e-4}
    assert {c.batch_size for c in configs} == {2, 8}
    assert len({(c.rank, c.alpha, c.learning_rate, c.batch_size) for c in configs}) == 120
    grid = space.grid()
    assert all(value in grid[name] for name, value in REFERENCE_PARAMS.items())


def test_adaptive_space_is_continuous_and_samples_inside_bounds():
    space = space_of("adaptive.yaml")
    assert not space.is_grid
    dists = space.distributions()
    assert dists["learning_rate"].log and isinstance(dists["learning_rate"], optuna.distributions.FloatDistribution)
    for config in space.enumerate_configs(n_samples=50):
        assert 2e-5 <= config.learning_rate <= 4e-4
        assert 0.25 * config.rank <= config.alpha <= 4 * config.rank + 1e-9
    with pytest.raises(ValueError):
        space.grid()


@pytest.mark.parametrize("sampler", ["grid", "tpe", "gp", "random"])
def test_every_sampler_proposes_valid_configs(sampler):
    space = space_of("paper120.yaml")
    samplers = {
        "grid": optuna.samplers.GridSampler(space.grid(), seed=0),
        "tpe": optuna.samplers.TPESampler(seed=0),
        "gp": optuna.samplers.GPSampler(seed=0),
        "random": optuna.samplers.RandomSampler(seed=0),
    }
    study = optuna.create_study(direction="maximize", sampler=samplers[sampler])
    seen = set()
    for _ in range(6):
        trial = study.ask()
        config = space.suggest(trial)
        assert config.rank in {8, 16, 32, 64, 128} and config.batch_size in {2, 8}
        seen.add((config.rank, config.alpha, config.learning_rate, config.batch_size))
        study.tell(trial, -config.learning_rate * config.rank)  # any deterministic value
    if sampler == "grid":
        assert len(seen) == 6  # the grid never repeats a point


def test_seeds_belong_to_the_config_not_the_trial_number():
    a, b = space_of("demo.yaml"), space_of("demo.yaml")
    b.seed = 7
    configs = a.enumerate_configs()
    assert len({c.seed for c in configs}) == len(configs)  # every grid point its own seed
    assert [c.seed for c in configs] != [c.seed for c in b.enumerate_configs()]  # the sweep seed counts
    study = optuna.create_study(sampler=optuna.samplers.GridSampler(a.grid(), seed=3))
    by_params = {(c.rank, c.alpha, c.learning_rate, c.batch_size): c.seed for c in configs}
    seen = []

    def objective(trial):  # any trial number, the same seed for the same config
        c = a.suggest(trial)
        seen.append(c.seed == by_params[(c.rank, c.alpha, c.learning_rate, c.batch_size)])
        return 0.0

    study.optimize(objective, n_trials=len(configs))
    assert seen == [True] * len(configs)


def test_lora_dropout_is_searched_when_the_sweep_file_gives_it(tmp_path):
    data = yaml.safe_load((SPACES / "demo.yaml").read_text())
    data["space"]["lora_dropout"] = {"choices": [0.0, 0.1]}
    path = tmp_path / "dropout.yaml"
    path.write_text(yaml.safe_dump(data))
    space = SearchSpace(load_sweep(path).space)
    assert space.grid()["lora_dropout"] == [0.0, 0.1] and space.grid_size() == 2 * space_of("demo.yaml").grid_size()
    assert {c.lora_dropout for c in space.enumerate_configs()} == {0.0, 0.1}
    study = optuna.create_study(sampler=optuna.samplers.GridSampler(space.grid(), seed=0))
    trial = study.ask()
    config = space.suggest(trial)
    assert (
        config.lora_dropout == trial.params["lora_dropout"]
        and config.as_params()["lora_dropout"] == config.lora_dropout
    )

    data["space"]["lora_dropout"] = {"low": 0.0, "high": 0.3}
    data["sampler"] = "tpe"  # a range needs a sampler that is not the grid
    path.write_text(yaml.safe_dump(data))
    ranged = SearchSpace(load_sweep(path).space)
    assert all(0.0 <= c.lora_dropout <= 0.3 for c in ranged.enumerate_configs(n_samples=20))
    # a sweep file without it searches the four parameters only, and trains without dropout
    assert "lora_dropout" not in space_of("demo.yaml").distributions()
    assert {c.lora_dropout for c in space_of("demo.yaml").enumerate_configs()} == {0.0}
