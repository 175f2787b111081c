"""The sweep file's own tasks: prompt/completion files, an lm-eval YAML, a registered lm-eval task.

Each is resolved through lm-eval (its prompts, targets and metrics) from tiny files written here;
each bad definition stops with one line naming what to fix.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path

import optuna
import pytest
import yaml

from plora_hpo.config import parse_sweep
from plora_hpo.errors import PloraError
from plora_hpo.study import create_study
from plora_hpo.tasks import build_eval_tasks, load_train_examples, resolve_task
from plora_hpo.tasks._lmeval import training_pairs

REPO = Path(__file__).resolve().parents[2]
ANIMALS = ["cat", "dog", "cow", "owl"]
FOODS = ["pie", "jam", "tea", "rice"]


def rows() -> list[dict[str, str]]:
    return [{"text": f"Word: {w}\nKind?", "kind": "animal"} for w in ANIMALS] + [
        {"text": f"Word: {w}\nKind?", "kind": "food"} for w in FOODS
    ]


@pytest.fixture
def files(tmp_path) -> Path:
    """The same rows as JSON lines (train), CSV (eval; its prompts hold newlines) and Parquet."""
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows()))
    with (tmp_path / "eval.csv").open("w", newline="") as handle:
        writer = csv.DictWriter(handle, ["text", "kind"])
        writer.writeheader()
        writer.writerows(rows()[::2])
    import pyarrow
    import pyarrow.parquet

    pyarrow.parquet.write_table(pyarrow.Table.from_pylist(rows()), tmp_path / "train.parquet")
    return tmp_path


def sweep(folder: Path, **tasks: dict) -> object:
    data = yaml.safe_load((REPO / "search_spaces" / "demo.yaml").read_text())
    data.update(tasks=list(tasks), custom_tasks=tasks)
    return parse_sweep(data, folder / "sweep.yaml")


def files_task(**extra) -> dict:
    return {"train": "train.jsonl", "eval": "eval.csv", "prompt_column": "text", "completion_column": "kind", **extra}


def test_choice_task_trains_on_completions_and_scores_by_choice(files, tokenizer):
    config = sweep(files, kinds=files_task(choices=["animal", "food"]))
    spec = resolve_task("kinds", config.custom_tasks)
    assert (spec.primary_metric, spec.direction, spec.eval_split) == ("acc,none", "maximize", "test")
    [task] = build_eval_tasks(spec)["tasks"].values()
    docs = list(task.eval_docs)
    assert len(docs) == 4 and task.doc_to_text(docs[0]) == "Word: cat\nKind?"  # the CSV's newline kept
    assert [task.doc_to_target(d) for d in docs] == [0, 0, 1, 1]
    assert task.doc_to_choice(docs[0]) == ["animal", "food"]
    prompts, completions = training_pairs(task, [0, 4])
    assert prompts == ["Word: cat\nKind?", "Word: pie\nKind?"] and completions == [" animal", " food"]
    examples = load_train_examples(spec, tokenizer, seq_len=32)
    assert len(examples) == 8
    trained = [t for t, label in zip(examples[0].input_ids, examples[0].labels) if label != -100]
    assert tokenizer.decode(trained).startswith(" animal")


def test_parquet_and_generation_with_a_regex(files):
    config = sweep(files, gen=files_task(train="train.parquet", regex=r"(animal|food)", until=["\n", "."]))
    spec = resolve_task("gen", config.custom_tasks)
    assert spec.primary_metric == "exact_match,regex" and spec.direction == "maximize"
    [task] = build_eval_tasks(spec)["tasks"].values()
    assert task.config.output_type == "generate_until" and len(task.training_docs()) == 8
    assert task.config.generation_kwargs["until"] == ["\n", "."]


def test_perplexity_is_minimised_and_the_study_goes_down(files, tmp_path):
    config = sweep(files, ppl=files_task(metric="perplexity"))
    spec = resolve_task("ppl", config.custom_tasks)
    assert (spec.primary_metric, spec.direction) == ("perplexity,none", "minimize")
    study = create_study(config, "ppl", f"sqlite:///{tmp_path / 'optuna.db'}")
    assert study.direction == optuna.study.StudyDirection.MINIMIZE
    assert study.metric_names == ["ppl:perplexity,none"]
    # an explicit direction wins over lm-eval's
    flipped = sweep(files, ppl=files_task(metric="perplexity", direction="maximize"))
    assert resolve_task("ppl", flipped.custom_tasks).direction == "maximize"


def test_user_lm_eval_yaml_with_an_include(files):
    base = {
        "dataset_path": "json",
        "dataset_kwargs": {"data_files": {"train": str(files / "train.jsonl"), "test": str(files / "train.jsonl")}},
        "output_type": "multiple_choice",
        "training_split": "train",
        "test_split": "test",
        "doc_to_choice": ["animal", "food"],
        "doc_to_target": "{{ 0 if kind == 'animal' else 1 }}",
        "metric_list": [{"metric": "acc"}, {"metric": "f1"}],
    }
    (files / "_base.yaml").write_text(yaml.safe_dump(base))
    (files / "kinds.yaml").write_text(
        yaml.safe_dump({"include": "_base.yaml", "task": "my_kinds", "doc_to_text": "{{text}}\nAnswer:"})
    )
    config = sweep(files, mine={"yaml": "kinds.yaml", "metric": "f1"})
    spec = resolve_task("mine", config.custom_tasks)
    assert (spec.lm_eval_task, spec.primary_metric) == ("my_kinds", "f1,none")
    [task] = build_eval_tasks(spec)["tasks"].values()
    prompts, completions = training_pairs(task, [0])
    assert prompts == ["Word: cat\nKind?\nAnswer:"] and completions == [" animal"]


def test_registered_lm_eval_task_over_local_files(files):
    arc = {"id": "q1", "question": "Which is alive?", "choices": {"text": ["a rock", "a cat"], "label": ["A", "B"]}}
    (files / "arc.jsonl").write_text(json.dumps({**arc, "answerKey": "B"}) + "\n")
    config = sweep(files, arc={"lm_eval": "arc_easy", "data_files": {"train": "arc.jsonl", "test": "arc.jsonl"}})
    spec = resolve_task("arc", config.custom_tasks)
    assert (spec.lm_eval_task, spec.primary_metric) == ("arc_easy", "acc,none")
    [task] = build_eval_tasks(spec)["tasks"].values()
    assert training_pairs(task) == (["Question: Which is alive?\nAnswer:"], [" a cat"])


@pytest.mark.parametrize(
    ("definition", "message"),
    [
        (files_task(prompt_column="question"), r"train\.jsonl row 1 has no column 'question' \(columns: text, kind\)"),
        (files_task(choices=["animal", "plant"]), r"completion 'food' is not one of the choices"),
        (files_task(choices=["animal", "food"], metric="bleu"), r"metric 'bleu' is not produced .* acc, acc_norm"),
        (files_task(eval="empty.jsonl"), r"empty\.jsonl has no rows"),
        (files_task(eval="missing.jsonl"), r"missing\.jsonl: no such data file"),
        (
            {"yaml": "bad.yaml"},
            r"lm-eval rejected task YAML .*bad\.yaml: ValueError: Got invalid output_type 'generate'",
        ),
        (
            {"yaml": "two.yaml", "metric": "exact_match"},
            r"metric 'exact_match' is not one .* produces; choose from acc,none",
        ),
    ],
)
def test_bad_definitions_say_what_to_fix(files, definition, message):
    (files / "empty.jsonl").write_text("")
    (files / "bad.yaml").write_text(yaml.safe_dump({"task": "b", "dataset_path": "json", "output_type": "generate"}))
    two = {
        "task": "two",
        "dataset_path": "json",
        "dataset_kwargs": {"data_files": {"train": str(files / "train.jsonl")}},
        "output_type": "multiple_choice",
        "training_split": "train",
        "test_split": "train",
        "doc_to_text": "{{text}}",
        "doc_to_choice": ["animal", "food"],
        "doc_to_target": "{{ 0 if kind == 'animal' else 1 }}",
        "metric_list": [{"metric": "acc"}],
    }
    (files / "two.yaml").write_text(yaml.safe_dump(two))
    config = sweep(files, t=definition)
    with pytest.raises(PloraError, match=message) as caught:
        resolve_task("t", config.custom_tasks)
    assert "\n" not in str(caught.value)


def test_unknown_lm_eval_task_lists_close_names(files):
    config = sweep(files, arc={"lm_eval": "arc_eazy"})
    with pytest.raises(PloraError, match=r"lm-eval has no task 'arc_eazy'; close names: arc_easy"):
        resolve_task("arc", config.custom_tasks)


def test_registered_task_without_local_data_names_its_hub_dataset(files, offline_hub):
    config = sweep(files, arc={"lm_eval": "arc_easy"})
    with pytest.raises(PloraError, match=r"Hub dataset 'allenai/ai2_arc', which cannot be loaded here .*data_files"):
        resolve_task("arc", config.custom_tasks)


def test_the_readme_example_is_a_valid_sweep_file(tmp_path):
    readme = (REPO / "README.md").read_text()
    block = readme.split("## Your own data", 1)[1].split("```yaml\n", 1)[1].split("```", 1)[0]
    config = parse_sweep(yaml.safe_load(block), tmp_path / "tickets.yaml")
    assert config.tasks == ["route", "answer"] and config.objectives == ["task", "adapter_params"]
    route = config.custom_tasks["route"]
    assert route.train == str(tmp_path / "data" / "route_train.jsonl") and route.choices == ["billing", "bugs", "sales"]
    assert config.custom_tasks["answer"].regex == r"#### (\d+)"
