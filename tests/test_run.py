"""SweepRun, the Python API's sweep: one owner per run directory, and crash recovery from Python
(a script killed with ``kill -9`` is resumed by the next ``SweepRun`` on the same directory)."""

from __future__ import annotations

from pathlib import Path

import optuna
import pytest
from mlflow.tracking import MlflowClient
from optuna.trial import TrialState

from plora_hpo import SweepRun, load_sweep
from plora_hpo.ownership import RunDirInUse

from .test_resume_e2e import kill_9_when_ready
from .test_sweep_e2e import small_sweep

pytestmark = pytest.mark.slow

STEPS, EVERY = 12, 3
SCRIPT = (
    "import sys\n"
    "from plora_hpo import SweepRun, load_sweep\n"
    "with SweepRun(load_sweep(sys.argv[1]), run_dir=sys.argv[2]) as run:\n"
    "    run.optimize()\n"
)


def _study(run_dir: Path, name: str) -> optuna.Study:
    return optuna.load_study(study_name=f"{name}-synthetic", storage=f"sqlite:///{run_dir / 'optuna.db'}")


def test_python_api_resumes_a_killed_script_from_its_checkpoints(tmp_path):
    name = "pyapi"
    sweep_file = small_sweep(
        tmp_path, name=name, budget={"steps": STEPS}, train={"lr_schedule": "cosine", "checkpoint_every": EVERY}
    )
    config = load_sweep(sweep_file)
    run_dir = tmp_path / "runs"
    checkpoints = run_dir / "checkpoints" / f"{name}-synthetic"
    kill_9_when_ready(
        ["-c", SCRIPT, str(sweep_file), str(run_dir)],
        tmp_path / "killed.log",
        lambda: len(list(checkpoints.glob("t*.pt"))) >= 4,
    )
    assert [t.state for t in _study(run_dir, name).trials] == [TrialState.RUNNING] * 4

    with SweepRun(config, run_dir=run_dir) as run:
        assert run.retries == {"synthetic": 4}  # the dead script's trials, found by the owner
        with pytest.raises(RunDirInUse, match=r"in use by pid \d+"):  # one owner while it runs
            SweepRun(config, run_dir=run_dir).open()
        run.optimize()

    trials = _study(run_dir, name).trials
    originals, retries = trials[:4], trials[4:]
    assert [t.state for t in originals] == [TrialState.FAIL] * 4
    assert [t.state for t in retries] == [TrialState.COMPLETE] * 4
    for retry in retries:  # (that a resumed trial equals an uninterrupted one: tests/test_resume_e2e.py)
        original = originals[retry.user_attrs["retry_of"]]
        assert retry.params == original.params and retry.user_attrs["lineage"] == original.number
        assert retry.user_attrs["resumed_from_step"] in range(EVERY, STEPS, EVERY)  # from a checkpoint

    client = MlflowClient(f"sqlite:///{run_dir / 'mlflow.db'}")
    runs = client.search_runs([client.get_experiment_by_name(name).experiment_id])
    assert {r.info.status for r in runs} == {"FINISHED"}  # nothing left RUNNING by the killed script
    assert sum(r.data.tags.get("plora.kind") == "trial" for r in runs) == 4  # one run per adapter
    assert sum(r.data.tags.get("plora.kind") == "sweep" for r in runs) == 1  # the parent, continued


def test_a_refused_open_leaves_nothing_behind(tmp_path):
    config = load_sweep(small_sweep(tmp_path))
    run_dir = tmp_path / "new"
    with pytest.raises(Exception, match="--resume: nothing to resume"):
        SweepRun(config, run_dir=run_dir, resume=True).open()
    assert not run_dir.exists()
    with pytest.raises(RuntimeError, match="needs an open run"):
        SweepRun(config, run_dir=run_dir).optimize()
