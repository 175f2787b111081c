"""A rerun after a crash leaves no trial RUNNING: stale trials fail and their params are retried."""

from __future__ import annotations

from pathlib import Path

import optuna
from optuna.trial import TrialState

from plora_hpo.config import load_sweep
from plora_hpo.space import SearchSpace
from plora_hpo.study import create_study, finished_trials, recover_stale_trials, settled_lineages, study_name

DEMO = Path(__file__).resolve().parents[1] / "search_spaces" / "demo.yaml"


def _crashed_study(storage: str) -> tuple[optuna.Study, dict]:
    """A study with one COMPLETE trial and one left RUNNING (its process was killed)."""
    config = load_sweep(DEMO)
    space = SearchSpace(config.space, seed=config.seed)
    study = create_study(config, "synthetic", storage)
    done = study.ask()
    space.suggest(done)
    study.tell(done, 0.5)
    stale = study.ask()
    space.suggest(stale)  # then kill -9: never told
    return study, dict(stale.params)


def test_recover_fails_stale_trial_and_enqueues_its_params(tmp_path):
    storage = f"sqlite:///{tmp_path / 'optuna.db'}"
    study, params = _crashed_study(storage)
    [stale_number] = [t.number for t in study.trials if t.state == TrialState.RUNNING]

    assert recover_stale_trials(study) == [stale_number]

    trials = {t.number: t for t in optuna.load_study(study_name=study.study_name, storage=storage).trials}
    assert trials[stale_number].state == TrialState.FAIL
    assert not [t for t in trials.values() if t.state == TrialState.RUNNING]
    [retry] = [t for t in trials.values() if t.user_attrs.get("retry_of") == stale_number]
    assert retry.state == TrialState.WAITING and retry.system_attrs["fixed_params"] == params
    assert finished_trials(study) == 1  # the COMPLETE one; the failed stale one is being retried


def test_create_study_leaves_running_trials_to_their_owner(tmp_path):
    storage = f"sqlite:///{tmp_path / 'optuna.db'}"
    config = load_sweep(DEMO)
    _crashed_study(storage)

    shared = create_study(config, "synthetic", storage)  # another live process may own RUNNING trials
    assert [t.state for t in shared.trials].count(TrialState.RUNNING) == 1

    rerun = create_study(config, "synthetic", storage)
    recover_stale_trials(rerun)  # what the run directory's owner (SweepRun) does on open
    states = [t.state for t in rerun.trials]
    assert TrialState.RUNNING not in states
    assert states.count(TrialState.COMPLETE) == 1 and states.count(TrialState.FAIL) == 1
    assert rerun.study_name == study_name(config, "synthetic")

    # the retry runs with the stale trial's params and counts towards n_trials once
    retry = rerun.ask()
    assert retry.user_attrs["retry_of"] == 1
    SearchSpace(config.space, seed=config.seed).suggest(retry)
    assert retry.params == rerun.trials[1].params
    assert finished_trials(rerun) == 1


def test_settled_lineages_are_those_with_a_result_and_no_retry_to_come(tmp_path):
    """Complete, pruned and non-finite trials settle their lineage; an interrupted or stale
    trial's does not (its retry continues from the checkpoint). A trial's lineage is its number
    unless it continues an earlier trial's."""
    storage = f"sqlite:///{tmp_path / 'optuna.db'}"
    study, _ = _crashed_study(storage)  # trial 0 COMPLETE, trial 1 RUNNING
    create = optuna.trial.create_trial
    study.add_trial(create(state=TrialState.PRUNED, user_attrs={"lineage": 2}))
    study.add_trial(create(state=TrialState.FAIL, user_attrs={"lineage": 3, "fail_reason": "loss nan"}))
    study.add_trial(create(state=TrialState.FAIL, user_attrs={"lineage": 4, "interrupted": True}))
    assert settled_lineages(study) == {0, 2, 3}

    recover_stale_trials(study)  # trials 1 and 4 retried: the retry of 4 continues lineage 4
    assert settled_lineages(study) == {0, 2, 3}
    study.add_trial(create(state=TrialState.COMPLETE, value=0.5, user_attrs={"lineage": 4, "retry_of": 4}))
    assert settled_lineages(study) == {0, 2, 3}  # the first retry of 4 still waits
