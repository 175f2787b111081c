"""The user's own tasks through the whole sweep on the embedded SmolLM2: a JSONL task with a fixed
choice set and an lm-eval task YAML of the user's (both on tiny data written here), trained,
scored by lm-eval and optimised against the adapter's size as a multi-objective study.
"""

from __future__ import annotations

import json
from pathlib import Path

import optuna
import pytest
import yaml
from mlflow.tracking import MlflowClient

from plora_hpo.cli import main

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
WORDS = {"animal": ["cat", "dog", "cow", "owl", "fox", "pig"], "food": ["pie", "jam", "tea", "rice", "corn", "kiwi"]}


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    """The converted files and generated task YAMLs go to a fresh cache."""
    monkeypatch.setenv("PLORA_HPO_CACHE", str(tmp_path / "cache"))


def write_task_files(folder: Path) -> None:
    rows = [{"prompt": f"Word: {w}\nKind?", "completion": kind} for kind, words in WORDS.items() for w in words]
    (folder / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (folder / "heldout.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[::3]))
    task = {
        "task": "word_kind",
        "dataset_path": "json",
        "dataset_kwargs": {
            "data_files": {"train": str(folder / "train.jsonl"), "validation": str(folder / "heldout.jsonl")}
        },
        "output_type": "generate_until",
        "training_split": "train",
        "validation_split": "validation",
        "doc_to_text": "{{prompt}}\nAnswer:",
        "doc_to_target": "{{completion}}",
        "generation_kwargs": {"until": ["\n"], "do_sample": False, "max_gen_toks": 4},
        "metric_list": [{"metric": "exact_match", "aggregation": "mean", "higher_is_better": True}],
    }
    (folder / "word_kind.yaml").write_text(yaml.safe_dump(task))


def sweep_file(folder: Path) -> Path:
    data = yaml.safe_load((REPO / "search_spaces" / "demo.yaml").read_text())
    data.update(
        name="own",
        tasks=["kinds", "yamltask"],
        custom_tasks={
            "kinds": {"train": "train.jsonl", "eval": "heldout.jsonl", "choices": ["animal", "food"]},
            "yamltask": {"yaml": "word_kind.yaml"},
        },
        objectives=["task", "adapter_params"],
        budget={"steps": 2},
        space={
            "rank": {"choices": [4, 8]},
            "alpha_multiplier": {"choices": [1]},
            "learning_rate": {"choices": [4e-4]},
            "batch_size": {"choices": [2]},
        },
        evaluation={"batch_size": 16, "max_new_tokens": 4},
        pack={"size": 2, "gather_seconds": 1},
    )
    path = folder / "own.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def test_own_tasks_train_score_and_give_a_pareto_front(tmp_path, capsys):
    write_task_files(tmp_path)
    path, run_dir = sweep_file(tmp_path), tmp_path / "runs"
    assert main(["sweep", str(path), "--run-dir", str(run_dir), "--device", "cpu", "--workers", "threads"]) == 0
    storage = f"sqlite:///{run_dir / 'optuna.db'}"
    expected = {"kinds": ("kinds:acc,none", 4), "yamltask": ("yamltask:exact_match,none", 4)}
    for task, (metric, held_out) in expected.items():
        study = optuna.load_study(study_name=f"own-{task}", storage=storage)
        assert study.metric_names == [metric, "adapter_params"]
        assert [d.name for d in study.directions] == ["MAXIMIZE", "MINIMIZE"]
        trials = study.trials
        assert len(trials) == 2 and all(t.state == optuna.trial.TrialState.COMPLETE for t in trials)
        for t in trials:
            score, params = t.values
            assert score == t.user_attrs["metrics"][metric.split(":")[1]]
            assert score * held_out == pytest.approx(round(score * held_out))  # a share of the held-out rows
            assert params == t.user_attrs["adapter_params"] > 0
        by_rank = {t.params["rank"]: t for t in trials}
        assert by_rank[8].values[1] == 2 * by_rank[4].values[1]  # adapter size is linear in the rank
        front = {t.number for t in study.best_trials}
        # the rank-4 adapter is smaller, so it is on the front whatever it scored
        assert by_rank[4].number in front
        assert (by_rank[8].number in front) == (by_rank[8].values[0] > by_rank[4].values[0])

    summary = json.loads((run_dir / "summary" / "trials.json").read_text())
    assert {row["trial"] for row in summary["kinds"] if row["pareto"]} == {
        t.number for t in optuna.load_study(study_name="own-kinds", storage=storage).best_trials
    }
    client = MlflowClient(f"sqlite:///{run_dir / 'mlflow.db'}")
    [parent] = [
        r
        for r in client.search_runs([client.get_experiment_by_name("own").experiment_id])
        if r.data.tags.get("plora.kind") == "sweep"
    ]
    assert parent.data.tags["plora.objective.kinds"] == "kinds:acc,none (maximize), adapter_params (minimize)"

    capsys.readouterr()
    assert main(["results", str(path), "--run-dir", str(run_dir)]) == 0
    out = capsys.readouterr().out
    assert "own-kinds: Pareto front" in out and "adapter_params (minimize)" in out


def test_a_bad_own_task_stops_before_anything_is_written(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    write_task_files(tmp_path)
    path = sweep_file(tmp_path)
    data = yaml.safe_load(path.read_text())
    data["custom_tasks"]["kinds"]["completion_column"] = "label"
    path.write_text(yaml.safe_dump(data))
    before = {p.name for p in tmp_path.iterdir()} | {"cache"}
    assert main(["sweep", str(path), "--run-dir", str(tmp_path / "runs"), "--device", "cpu"]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "has no column 'label' (columns: prompt, completion)" in errors[0]
    assert {p.name for p in tmp_path.iterdir()} <= before  # no run directory, no study
