"""The whole path on the embedded SmolLM2: Optuna → packed engine → lm-eval → MLflow → PEFT.

One small sweep (4 trials in one pack, a few steps) runs once per session through the CLI;
the tests below inspect what it left in the Optuna storage, in MLflow and on disk.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import mlflow
import optuna
import pytest
import torch
import yaml
from mlflow.tracking import MlflowClient
from peft import AutoPeftModelForCausalLM, PeftModel
from safetensors.torch import load_file

from plora_hpo.adapter import AdapterConfig
from plora_hpo.cli import main
from plora_hpo.engine import PackedLoraModel
from plora_hpo.models import load_base_model

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]


def small_sweep(tmp: Path, name: str = "e2e", **overrides) -> Path:
    data = yaml.safe_load((REPO / "search_spaces" / "demo.yaml").read_text())
    data.update(
        name=name,
        budget={"steps": 3},
        space={
            "rank": {"choices": [8, 16]},
            "alpha_multiplier": {"choices": [1]},
            "learning_rate": {"choices": [2e-5, 4e-4]},
            "batch_size": {"choices": [2]},
        },
        evaluation={"limit": 8, "batch_size": 32},
        pack={"size": 4, "gather_seconds": 5},
    )
    data.update(overrides)
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


DROPOUT = 0.1  # the session's sweep trains every adapter with lora_dropout


@pytest.fixture(scope="session")
def finished_sweep(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("e2e")
    sweep_file = small_sweep(tmp)
    data = yaml.safe_load(sweep_file.read_text())
    data["space"]["lora_dropout"] = {"choices": [DROPOUT]}
    sweep_file.write_text(yaml.safe_dump(data))
    run_dir = tmp / "runs"
    assert main(["sweep", str(sweep_file), "--run-dir", str(run_dir)]) == 0
    study = optuna.load_study(study_name="e2e-synthetic", storage=f"sqlite:///{run_dir / 'optuna.db'}")
    return sweep_file, run_dir, study


def test_the_sweep_freezes_what_it_loaded_before_its_first_pack(tmp_path, monkeypatch):
    """What start-up loaded leaves the garbage collector's full scans: after the stores open,
    before any training step. Garbage is collected, not frozen: a cycle the caller's process left
    unreachable before the sweep (here, holding a tensor, as a deleted model would) is freed."""
    import gc
    import weakref

    from plora_hpo.timeline import ENV

    timeline = tmp_path / "timeline.jsonl"
    monkeypatch.setenv(ENV, str(timeline))
    sweep_file = small_sweep(tmp_path, n_trials=2, budget={"steps": 2}, pack={"size": 2, "gather_seconds": 1})
    callbacks = list(gc.callbacks)
    assert gc.get_freeze_count() == 0 and gc.isenabled()
    gc.disable()  # until the sweep runs, nothing collects the cycle below
    try:
        cycle: dict = {"weights": torch.zeros(1 << 16)}
        cycle["self"] = cycle
        weights = weakref.ref(cycle["weights"])
        del cycle
        assert weights() is not None  # only a collection frees it
        assert main(["sweep", str(sweep_file), "--run-dir", str(tmp_path / "runs")]) == 0
        assert weights() is None
        # a caller's own process gets its collector back as it was: paused, nothing frozen, its callbacks
        assert gc.get_freeze_count() == 0 and not gc.isenabled() and gc.callbacks == callbacks
    finally:
        gc.enable()
    rows = [json.loads(line) for line in timeline.read_text().splitlines()]
    first = {}
    for r in sorted(rows, key=lambda r: r["start"]):
        first.setdefault(r["phase"], r)
    assert first["open-stores"]["end"] <= first["freeze"]["start"] <= first["freeze"]["end"] <= first["train"]["start"]
    assert first["freeze"]["objects"] > 100_000  # the modules, model and data loaded by then
    assert first["freeze"]["garbage"] > 0  # the cycle above, at least
    steps = [r for r in rows if r["phase"] == "train"]
    assert steps and all(r["padded_tokens"] > 0 for r in steps)  # each step's size, for slow steps


def test_every_trial_completes_in_one_pack(finished_sweep):
    _, _, study = finished_sweep
    trials = study.trials
    assert len(trials) == 4 and all(t.state == optuna.trial.TrialState.COMPLETE for t in trials)
    assert len({t.user_attrs["pack_id"] for t in trials}) == 1  # the 4 concurrent trials trained together
    assert {(t.params["rank"], t.params["learning_rate"]) for t in trials} == {
        (8, 2e-5),
        (8, 4e-4),
        (16, 2e-5),
        (16, 4e-4),
    }
    for t in trials:
        assert t.intermediate_values == {}  # trial.report carries eval scores, and only when pruning
        assert 0.0 <= t.value <= 1.0 and t.value == t.user_attrs["metrics"]["acc,none"]
        assert t.user_attrs["tokens_per_second"] > 0


def test_mlflow_has_a_child_run_per_trial(finished_sweep):
    sweep_file, run_dir, study = finished_sweep
    client = MlflowClient(f"sqlite:///{run_dir / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("e2e")
    runs = client.search_runs([experiment.experiment_id])
    parents = [r for r in runs if r.data.tags.get("plora.kind") == "sweep"]
    children = [r for r in runs if r.data.tags.get("plora.kind") == "trial"]
    assert len(parents) == 1 and len(children) == 4
    by_id = {r.info.run_id: r for r in children}
    for trial in study.trials:
        run = by_id[trial.user_attrs["mlflow_run_id"]]
        assert run.data.tags["mlflow.parentRunId"] == parents[0].info.run_id
        assert run.info.status == "FINISHED"
        assert int(run.data.params["rank"]) == trial.params["rank"]
        assert trial.params["lora_dropout"] == DROPOUT and float(run.data.params["lora_dropout"]) == DROPOUT
        assert run.data.params["base_model"] and run.data.params["target_modules"]
        losses = client.get_metric_history(run.info.run_id, "train_loss")
        assert [m.step for m in losses] == [1, 2, 3]
        # the mean of the last (up to 10) steps, not one batch's loss
        assert trial.user_attrs["final_train_loss_steps"] == 3
        assert sum(m.value for m in losses) / 3 == pytest.approx(trial.user_attrs["final_train_loss"])
        assert run.data.tags["plora.state"] == "COMPLETE" and run.data.tags["plora.resumed_from_step"] == "0"
        assert run.data.metrics["acc"] == pytest.approx(trial.value)
        assert run.data.metrics["pack_tokens_per_second"] > 0
        files = {a.path for a in client.list_artifacts(run.info.run_id, "adapter")}
        assert files == {"adapter/adapter_config.json", "adapter/adapter_model.safetensors"}
        label = f"r{trial.params['rank']}-a{trial.params['rank'] * trial.params['alpha_multiplier']:g}"
        assert run.info.run_name == f"synthetic-t{trial.number}-{label}-lr{trial.params['learning_rate']:.0e}-b2-d0p1"
    # the study links its MLflow parent run and sweep file; the parent holds flat params and the outcome
    parent = parents[0]
    assert study.user_attrs["mlflow_parent_run_id"] == parent.info.run_id
    assert study.user_attrs["sweep_file"] == str(sweep_file.resolve())
    assert parent.data.params["budget.steps"] == "3" and parent.data.params["space.rank.choices"] == "[8.0, 16.0]"
    assert parent.data.metrics["best/synthetic"] == pytest.approx(max(t.value for t in study.trials))
    assert {a.path for a in client.list_artifacts(parent.info.run_id, "summary")} == {"summary/trials.json"}


def test_exported_adapter_loads_in_peft_and_reproduces_engine_logits(finished_sweep):
    _, _, study = finished_sweep
    trial = max(study.trials, key=lambda t: t.params["learning_rate"] * t.params["rank"])
    adapter_dir = Path(trial.user_attrs["adapter_dir"])
    config = json.loads((adapter_dir / "adapter_config.json").read_text())
    assert config["r"] == trial.params["rank"] and config["peft_type"] == "LORA"
    assert config["lora_dropout"] == DROPOUT

    ids = torch.tensor([[1, 504, 1782, 28, 216, 33, 3419, 30]])
    base = load_base_model("smollm2-135m")
    packed = PackedLoraModel(base.model, config["target_modules"])
    packed.add_adapter(
        "t", AdapterConfig(rank=config["r"], alpha=config["lora_alpha"], learning_rate=1e-4, batch_size=1)
    )
    saved = load_file(adapter_dir / "adapter_model.safetensors")
    packed.load_state_dict_of("t", {k.removeprefix("base_model.model."): v for k, v in saved.items()})
    assert any(v.abs().max() > 0 for k, v in saved.items() if "lora_B" in k)  # trained, not the zero init
    with torch.no_grad(), packed.route([("t", 1)]):
        engine_logits = packed.model(input_ids=ids).logits

    peft_model = PeftModel.from_pretrained(load_base_model("smollm2-135m").model, adapter_dir).eval()
    with torch.no_grad():
        peft_logits = peft_model(input_ids=ids).logits
    assert torch.allclose(engine_logits, peft_logits, rtol=1e-4, atol=1e-4)
    # self-contained: the adapter names a base model that loads, so PEFT's auto class needs nothing else
    assert adapter_dir.is_absolute()
    alone = AutoPeftModelForCausalLM.from_pretrained(adapter_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        assert torch.allclose(alone(input_ids=ids).logits, peft_logits, rtol=1e-4, atol=1e-4)
    with torch.no_grad(), peft_model.disable_adapter():
        plain = peft_model(input_ids=ids).logits
    assert not torch.allclose(plain, peft_logits, atol=1e-4)  # the adapter changes the model


def _regular_files(root: Path) -> list[Path]:
    """Every regular file under ``root``, links not followed: what takes disk space."""
    return [Path(d) / f for d, _, files in os.walk(root) for f in files if not (Path(d) / f).is_symlink()]


def test_every_adapter_is_stored_once_and_loads_from_optuna_and_mlflow(finished_sweep, tmp_path):
    _, run_dir, study = finished_sweep
    weights = [p for p in _regular_files(run_dir) if p.name == "adapter_model.safetensors"]
    assert len(weights) == len(study.trials) == 4
    assert len({p.stat().st_ino for p in weights}) == 4  # no hard links either: four files, four inodes
    client = MlflowClient(f"sqlite:///{run_dir / 'mlflow.db'}")
    for trial in study.trials:
        adapter_dir = Path(trial.user_attrs["adapter_dir"])
        run = client.get_run(trial.user_attrs["mlflow_run_id"])
        artifacts = Path(run.info.artifact_uri.removeprefix("file://"))
        assert adapter_dir.is_absolute() and adapter_dir == artifacts / "adapter"  # Optuna names MLflow's copy
        assert (adapter_dir / "adapter_model.safetensors") in weights
        link = next(p for p in (run_dir / "adapters").iterdir() if p.resolve() == adapter_dir.resolve())
        assert link.is_symlink() and link.name.startswith(f"synthetic-t{trial.number}-")

    trial = study.trials[0]
    ids = torch.tensor([[1, 504, 1782, 28, 216, 33, 3419, 30]])
    downloaded = mlflow.artifacts.download_artifacts(
        run_id=trial.user_attrs["mlflow_run_id"],
        artifact_path="adapter",
        dst_path=str(tmp_path),
        tracking_uri=f"sqlite:///{run_dir / 'mlflow.db'}",
    )
    logits = []
    for path in (trial.user_attrs["adapter_dir"], downloaded):
        model = AutoPeftModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        with torch.no_grad():
            logits.append(model(input_ids=ids).logits)
    assert torch.equal(logits[0], logits[1])


def test_notebook_executes_against_the_study(finished_sweep):
    nbformat = pytest.importorskip("nbformat")
    from nbclient import NotebookClient

    sweep_file, run_dir, _ = finished_sweep
    nb = nbformat.read(REPO / "notebooks" / "explore_120.ipynb", as_version=4)
    env = {
        "PLORA_SWEEP": str(sweep_file),
        "PLORA_STORAGE": f"sqlite:///{run_dir / 'optuna.db'}",
        "PLORA_MLFLOW_URI": f"sqlite:///{run_dir / 'mlflow.db'}",
    }
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(REPO)}}).execute()
    finally:
        for k, v in old.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
    outputs = [o for cell in nb.cells if cell.cell_type == "code" for o in cell.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    assert sum("image/png" in o.get("data", {}) for o in outputs) >= 2  # heatmaps and loss curves


@pytest.mark.server
def test_batch_api_logs_to_a_remote_mlflow_server(mlflow_server, tmp_path):
    """ask a batch → train packed → tell, tracked on a real `mlflow server`."""
    from plora_hpo import PackedSweep, SweepTracker, create_study, load_sweep, optimize_in_packs

    config = load_sweep(small_sweep(tmp_path, name="batch-api"))
    tracker = SweepTracker(mlflow_server.uri, config.name)
    sweep = PackedSweep(config, tracker=tracker, run_dir=tmp_path / "runs")
    tracker.start(config.name, {"api": "batch"})
    study = create_study(config, "synthetic", f"sqlite:///{tmp_path / 'optuna.db'}")
    outcomes = optimize_in_packs(study, sweep, "synthetic", n_trials=4, pack_size=4)
    sweep.close()
    tracker.finish()

    assert len({o.pack_id for o in outcomes}) == 1
    assert [t.state for t in study.trials] == [optuna.trial.TrialState.COMPLETE] * 4
    client = MlflowClient(mlflow_server.uri)
    for outcome in outcomes:
        run = client.get_run(outcome.run_id)
        assert run.data.tags["mlflow.parentRunId"] == tracker.parent_run_id
        assert len(client.get_metric_history(outcome.run_id, "train_loss")) == 3
        assert {a.path for a in client.list_artifacts(outcome.run_id, "adapter")} == {
            "adapter/adapter_config.json",
            "adapter/adapter_model.safetensors",
        }


def _cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "plora_hpo.cli", *args],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, **(env or {})},
    )


@pytest.mark.parametrize(
    ("overrides", "flags", "expected"),
    [
        ({"tasks": ["squad"]}, [], "unknown task 'squad'"),
        ({"model": "no-such-org/no-such-model"}, [], "cannot load model"),
        ({"model": "./missing-model-dir"}, [], "cannot load model"),
        ({"budget": {"steps": 3, "max_train_examples": 1}}, [], "larger than the 1 training examples"),
        ({"tasks": ["mrpc"]}, ["--data-dir", "EMPTY"], "mrpc"),
        ({}, ["--storage", "notadb://x"], "cannot open the Optuna storage"),
        ({}, ["--mlflow-uri", "http://127.0.0.1:9"], "cannot reach the MLflow tracking store"),
    ],
)
def test_bad_input_is_one_line_and_writes_nothing(tmp_path, overrides, flags, expected):
    sweep_file = small_sweep(tmp_path, **overrides)
    flags = [str(tmp_path / "empty") if f == "EMPTY" else f for f in flags]
    (tmp_path / "empty").mkdir()
    run_dir = tmp_path / "runs"
    result = _cli("sweep", str(sweep_file), "--run-dir", str(run_dir), *flags, env={"HF_HUB_OFFLINE": "1"})
    lines = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert result.returncode == 2, result.stderr[-2000:]
    assert len(lines) == 1 and expected in lines[0], result.stderr[-2000:]
    assert not run_dir.exists()  # no study, no MLflow store, no adapters


def test_malformed_yaml_says_where(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\nspace:\n  rank: {choices: [8, 16]\n")
    result = _cli("sweep", str(bad), "--run-dir", str(tmp_path / "runs"))
    assert result.returncode == 2
    assert result.stderr.strip().startswith(f"error: {bad}:") and "YAML syntax error" in result.stderr


@pytest.mark.parametrize("sampler", ["tpe"])
def test_study_optimize_packs_concurrent_trials_of_model_based_samplers(tmp_path, sampler):
    """study.optimize with n_jobs=2: TPE trials proposed concurrently train as one pack.

    GP is covered by the sampler tests in test_space.py (it proposes inside this space too).
    """
    from plora_hpo import PackedObjective, PackedSweep, SweepTracker, create_study, load_sweep

    space = {
        "rank": {"choices": [8, 16]},
        "alpha_multiplier": {"low": 0.5, "high": 2.0},
        "learning_rate": {"low": 1e-5, "high": 5e-4, "log": True},
        "batch_size": {"choices": [1, 2]},
    }
    config = load_sweep(
        small_sweep(
            tmp_path,
            name=f"opt-{sampler}",
            sampler=sampler,
            space=space,
            budget={"steps": 2},
            evaluation={"limit": 4, "batch_size": 32},
            pack={"size": 2, "gather_seconds": 30},
        )
    )
    tracker = SweepTracker(f"sqlite:///{tmp_path / 'mlflow.db'}", config.name)
    sweep = PackedSweep(config, tracker=tracker, run_dir=tmp_path / "runs")
    tracker.start(config.name, {})
    study = create_study(config, "synthetic", f"sqlite:///{tmp_path / 'optuna.db'}")
    study.optimize(PackedObjective(sweep, "synthetic"), n_trials=2, n_jobs=sweep.concurrency)
    sweep.close()

    trials = study.trials
    assert [t.state for t in trials] == [optuna.trial.TrialState.COMPLETE] * 2
    assert len({t.user_attrs["pack_id"] for t in trials}) == 1
    assert all(1e-5 <= t.params["learning_rate"] <= 5e-4 for t in trials)


def test_results_command_prints_the_study_or_one_error(finished_sweep, tmp_path, capsys):
    sweep_file, run_dir, study = finished_sweep
    assert main(["results", str(sweep_file), "--run-dir", str(run_dir), "--top", "2"]) == 0
    out = capsys.readouterr().out
    best = max(study.trials, key=lambda t: t.value)
    assert "e2e-synthetic: 4 complete trials" in out and f"{best.value:.4f}" in out
    assert main(["results", str(sweep_file), "--run-dir", str(tmp_path / "none")]) == 2
    assert capsys.readouterr().err.startswith("error: no studies in")
    assert not (tmp_path / "none").exists()
