"""Every grid point goes to exactly one trial: concurrent asks, resumed sweeps, enqueued points."""

from __future__ import annotations

import contextlib
import threading
from collections import Counter

import optuna
from optuna.trial import TrialState

from plora_hpo.grid import OrderedGridSampler
from plora_hpo.study import recover_stale_trials

GRID = {"rank": [8, 16, 32, 64], "learning_rate": [1e-4, 2e-4]}


def suggest(trial: optuna.Trial) -> dict:
    return {
        "rank": trial.suggest_categorical("rank", GRID["rank"]),
        "learning_rate": trial.suggest_categorical("learning_rate", GRID["learning_rate"]),
    }


def ask_concurrently(study: optuna.Study, n: int) -> list[optuna.Trial]:
    barrier = threading.Barrier(n)
    trials: list[optuna.Trial] = []

    def ask() -> None:
        barrier.wait()
        trial = study.ask()
        suggest(trial)
        trials.append(trial)

    threads = [threading.Thread(target=ask) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return trials


def new_study(tmp_path, sampler) -> optuna.Study:
    return optuna.create_study(storage=f"sqlite:///{tmp_path / 'optuna.db'}", sampler=sampler, direction="maximize")


def test_resumed_concurrent_asks_take_distinct_free_points_as_uninterrupted_trials_would(tmp_path):
    study = new_study(tmp_path, OrderedGridSampler(GRID, seed=0))
    for trial in [study.ask() for _ in range(2)]:
        suggest(trial)
        study.tell(trial, 0.5)
    for trial in [study.ask() for _ in range(3)]:  # in flight when the process is killed
        suggest(trial)

    recover_stale_trials(study)
    retries = [study.ask() for _ in range(3)]  # the waiting copies, asked one at a time
    for trial in retries:
        suggest(trial)
    fresh = ask_concurrently(study, 3)

    trials = study.get_trials(deepcopy=False)
    by_number = {t.number: t for t in trials}
    for retry in retries:
        original = by_number[retry.user_attrs["retry_of"]]
        assert by_number[retry.number].system_attrs["grid_id"] == original.system_attrs["grid_id"]
        assert retry.params == original.params
    assert sorted(by_number[t.number].system_attrs["grid_id"] for t in fresh) == [5, 6, 7]
    running = [t for t in study.get_trials(deepcopy=False) if t.state == TrialState.RUNNING]
    configs = Counter(tuple(sorted(t.params.items())) for t in running)
    assert len(running) == 6 and max(configs.values()) == 1  # no config trains twice


def test_enqueued_grid_point_is_not_handed_out_again(tmp_path):
    study = new_study(tmp_path, OrderedGridSampler(GRID, seed=0))
    study.enqueue_trial({"rank": 8, "learning_rate": 1e-4})  # grid point 0
    trials = [study.ask() for _ in range(len(GRID["rank"]) * len(GRID["learning_rate"]))]
    for trial in trials:
        suggest(trial)
        study.tell(trial, 0.0)
    configs = Counter(tuple(sorted(t.params.items())) for t in study.trials)
    assert len(configs) == 8 and set(configs.values()) == {1}


def test_exhausted_grid_falls_back_to_optunas_choice(tmp_path):
    study = new_study(tmp_path, OrderedGridSampler({"rank": [8, 16]}, seed=0))
    for _ in range(3):
        trial = study.ask()
        trial.suggest_categorical("rank", [8, 16])
        with contextlib.suppress(RuntimeError):  # Optuna's Study.stop outside optimize, grid exhausted
            study.tell(trial, 0.0)
    ranks = [t.params["rank"] for t in study.trials]
    assert set(ranks[:2]) == {8, 16} and ranks[2] in (8, 16)  # both points first, then a repeat
