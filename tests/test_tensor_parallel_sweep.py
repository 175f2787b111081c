"""``pack.degree: 2`` in a real sweep: ``plora-hpo sweep --device cpu,cpu`` trains every pack on a
group of two worker processes (gloo) and gets what the same sweep gets at degree 1; a follower
killed mid-pack ends its group and hands the trials back to resume.

The model is a tiny random Llama (4 heads, 2 key-value heads) saved with SmolLM2's tokenizer.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import optuna
import pytest
import torch
import yaml
from mlflow.tracking import MlflowClient
from optuna.trial import TrialState
from transformers import AutoModelForCausalLM, LlamaConfig

from .cli_process import start_cli
from .test_sweep_e2e import small_sweep

pytestmark = pytest.mark.slow

SPACE = {
    "rank": {"choices": [4, 8]},
    "alpha_multiplier": {"choices": [1]},
    "learning_rate": {"choices": [1e-3, 4e-3]},
    "batch_size": {"choices": [2]},
}  # 4 grid points, one pack


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory) -> Path:
    from plora_hpo.models import load_base_model

    tokenizer = load_base_model("smollm2-135m").tokenizer
    out = tmp_path_factory.mktemp("tiny-llama")
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def sweep_file(tmp: Path, model: Path, degree: int, **overrides) -> Path:
    path = small_sweep(
        tmp,
        name=f"tp{degree}",
        model=str(model),
        space=SPACE,
        budget={"steps": 6},
        evaluation={"limit": 4, "batch_size": 8, "max_new_tokens": 4},
        pack={"size": 4, "gather_seconds": 2, "degree": degree},
        **overrides,
    )
    data = yaml.safe_load(path.read_text())
    data["train"] = {**data.get("train", {}), "lr_schedule": "linear", "checkpoint_every": 2}
    path.write_text(yaml.safe_dump(data))
    return path


def finish(proc: subprocess.Popen, log: Path, timeout: float = 600.0) -> int:
    try:
        return proc.wait(timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        raise AssertionError(f"still running after {timeout} s: {log.read_text()[-3000:]}") from None


def completed(run_dir: Path, name: str) -> dict[int, optuna.trial.FrozenTrial]:
    """The study's completed trials by grid point."""
    study = optuna.load_study(study_name=f"{name}-synthetic", storage=f"sqlite:///{run_dir / 'optuna.db'}")
    done = [t for t in study.get_trials(deepcopy=False) if t.state == TrialState.COMPLETE]
    by_point = {t.system_attrs["grid_id"]: t for t in done}
    assert len(by_point) == len(done), "a grid point completed twice"
    return by_point


def curve(run_dir: Path, trial: optuna.trial.FrozenTrial) -> list[float]:
    """The trial's loss curve, as its MLflow run recorded it."""
    client = MlflowClient(f"sqlite:///{run_dir / 'mlflow.db'}")
    history = client.get_metric_history(trial.user_attrs["mlflow_run_id"], "train_loss")
    return [m.value for m in sorted(history, key=lambda m: m.step)]


def test_a_degree_two_sweep_equals_the_same_sweep_at_degree_one(tmp_path, tiny_llama):
    runs = {}
    for degree, devices in [(1, "cpu"), (2, "cpu,cpu")]:
        run_dir = tmp_path / f"runs{degree}"
        argv = ["sweep", str(sweep_file(tmp_path, tiny_llama, degree)), "--run-dir", str(run_dir)]
        log = tmp_path / f"sweep{degree}.log"
        proc = start_cli([*argv, "--device", devices], log, COLUMNS="300")
        assert finish(proc, log) == 0, log.read_text()[-3000:]
        runs[degree] = {p: (t, curve(run_dir, t)) for p, t in completed(run_dir, f"tp{degree}").items()}
    assert sorted(runs[2]) == sorted(runs[1]) == [0, 1, 2, 3]
    log = (tmp_path / "sweep2.log").read_text()
    assert "degree 2: each pack split over 2 devices" in log
    record = json.loads((tmp_path / "runs2" / "packs" / "packs.json").read_text())  # the workers' records, merged
    assert record["summary"]["packs"] >= 1 and all(d.startswith("cpu@") for d in record["summary"]["devices"])
    assert f"packs: {record['summary']['packs']} packs in {record['summary']['segments']} compositions" in log
    client = MlflowClient(f"sqlite:///{tmp_path / 'runs2' / 'mlflow.db'}")
    [parent] = client.search_runs([client.get_experiment_by_name("tp2").experiment_id], "tags.`plora.kind` = 'sweep'")
    logged = {a.path for a in client.list_artifacts(parent.info.run_id, "packs")}
    assert {"packs/packs.json", "packs/packs.png"} <= logged  # the merged record, beside the workers' folders
    for point, (one, one_curve) in runs[1].items():
        two, two_curve = runs[2][point]
        assert two.params == one.params and len(one_curve) == 6
        torch.testing.assert_close(torch.tensor(two_curve), torch.tensor(one_curve), rtol=1e-4, atol=1e-6)
        final = (two.user_attrs["final_train_loss"], one.user_attrs["final_train_loss"])
        assert final[0] == pytest.approx(final[1], rel=1e-4)
        assert two.user_attrs["metrics"] == one.user_attrs["metrics"] and two.value == one.value
        adapter = Path(two.user_attrs["adapter_dir"]) / "adapter_model.safetensors"
        assert adapter.is_file(), two.user_attrs["adapter_dir"]


def _follower(sweep: subprocess.Popen) -> int | None:
    """The pid of the sweep's worker process of rank 1 (its group's follower), once it runs."""
    children = Path(f"/proc/{sweep.pid}/task/{sweep.pid}/children")
    for pid in children.read_text().split() if children.exists() else []:
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"RANK=1" in environ:
            return int(pid)
    return None


def test_a_killed_follower_ends_its_group_and_a_rerun_resumes_the_trials(tmp_path, tiny_llama):
    run_dir = tmp_path / "runs"
    path = sweep_file(tmp_path, tiny_llama, 2)
    data = yaml.safe_load(path.read_text())
    data["budget"] = {"steps": 150}
    path.write_text(yaml.safe_dump(data))
    argv = ["sweep", str(path), "--run-dir", str(run_dir), "--device", "cpu,cpu"]
    sweep = start_cli(argv, tmp_path / "sweep.log", COLUMNS="300")
    checkpoints = run_dir / "checkpoints" / "tp2-synthetic"
    deadline = time.monotonic() + 300
    while len(list(checkpoints.glob("t*.pt"))) < 4:
        assert sweep.poll() is None, (tmp_path / "sweep.log").read_text()[-3000:]
        assert time.monotonic() < deadline, (tmp_path / "sweep.log").read_text()[-3000:]
        time.sleep(0.2)
    follower = _follower(sweep)
    assert follower is not None
    os.kill(follower, signal.SIGKILL)
    assert finish(sweep, tmp_path / "sweep.log") == 2
    log = (tmp_path / "sweep.log").read_text()
    assert "every worker process stopped" in log and "rerun the same command" in log, log[-3000:]
    assert completed(run_dir, "tp2") == {}

    rerun = start_cli(argv, tmp_path / "rerun.log", COLUMNS="300")
    assert finish(rerun, tmp_path / "rerun.log") == 0, (tmp_path / "rerun.log").read_text()[-3000:]
    done = completed(run_dir, "tp2")
    assert sorted(done) == [0, 1, 2, 3]
    assert all(t.user_attrs["resumed_from_step"] >= 2 for t in done.values()), [
        t.user_attrs["resumed_from_step"] for t in done.values()
    ]
