"""Sweep files: the shipped ones validate; malformed ones fail with one line that says where."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from plora_hpo.config import TrainSpec, load_sweep
from plora_hpo.errors import ConfigError
from plora_hpo.run_state import RunState, check_resumable

SPACES = Path(__file__).resolve().parents[1] / "search_spaces"


@pytest.mark.parametrize("path", sorted(SPACES.glob("*.yaml")), ids=lambda p: p.name)
def test_shipped_sweep_files_validate(path):
    config = load_sweep(path)
    assert config.tasks and config.space.rank


def _write(tmp_path: Path, data: dict | str) -> Path:
    path = tmp_path / "sweep.yaml"
    path.write_text(data if isinstance(data, str) else yaml.safe_dump(data))
    return path


def _base() -> dict:
    return yaml.safe_load((SPACES / "demo.yaml").read_text())


@pytest.mark.parametrize(
    ("mutate", "expected"),
    [
        (lambda d: d.update(tasks=["squad"]), "tasks: unknown task 'squad'"),
        (
            lambda d: d.update(tasks=["tickts"], custom_tasks={"tickets": {"lm_eval": "arc_easy"}}),
            "tasks: unknown task 'tickts'; did you mean 'tickets'?",
        ),
        (
            lambda d: d.update(custom_tasks={"x": {"lm_eval": "arc_easy", "yaml": "x.yaml"}}),
            "custom_tasks.x: give exactly one of 'lm_eval', 'yaml' or 'train'+'eval', got 'lm_eval' and 'yaml'",
        ),
        (lambda d: d.update(custom_tasks={"x": {"train": "a.jsonl"}}), "custom_tasks.x: 'train' needs 'eval'"),
        (
            lambda d: d.update(custom_tasks={"x": {"train": "a.jsonl", "eval": "b.jsonl", "choices": ["yes"]}}),
            "custom_tasks.x: 'choices' needs at least two different answers",
        ),
        (
            lambda d: d.update(custom_tasks={"mrpc": {"lm_eval": "arc_easy"}}),
            "custom_tasks.mrpc: custom task 'mrpc' has a built-in task's name",
        ),
        (
            lambda d: d.update(custom_tasks={"my task/1": {"lm_eval": "arc_easy"}}),
            "custom_tasks.my task/1: task name 'my task/1' names studies and folders",
        ),
        (lambda d: d.update(objectives=["adapter_params"]), "objectives: objectives must start with 'task'"),
        (
            lambda d: d.update(objectives=["task", "adapter_params"], pruning={"pruner": "asha"}),
            "objectives: pruning needs a single objective",
        ),
        (lambda d: d.update(target_modules=["qkv"]), "target_modules: unknown target module 'qkv'"),
        (lambda d: d["space"]["rank"].update(choices=[8, -16]), "space.rank: every choice must be > 0"),
        (lambda d: d["space"].update(learning_rate={"low": 0, "high": 1e-3}), "space.learning_rate.low"),
        (lambda d: d["space"]["batch_size"].update(choices=[0]), "space.batch_size"),
        (lambda d: d["space"].update(alpha_multiplier={"choices": []}), "'choices' is empty"),
        (lambda d: d.update(budget={"steps": 10, "epochs": 1}), "exactly one of 'steps' or 'epochs'"),
        (lambda d: d.update(colour="red"), "unknown key 'colour'; remove it or check its spelling (keys here: name,"),
        (lambda d: d["space"].update(rnak=d["space"].pop("rank")), "unknown key 'space.rnak'; did you mean 'rank'?"),
        (
            lambda d: d["budget"].update(stpes=d["budget"].pop("steps")),
            "unknown key 'budget.stpes'; did you mean 'steps'?",
        ),
        (
            lambda d: d["train"].update(checkpoint_evry=5),
            "unknown key 'train.checkpoint_evry'; did you mean 'checkpoint_every'?",
        ),
        (lambda d: d["space"]["rank"].update(choice=[8]), "unknown key 'space.rank.choice'; did you mean 'choices'?"),
        (
            lambda d: d["space"]["rank"].update(choices=[16, 16, 64]),
            "space.rank: choice 16 appears twice; list each value once",
        ),
        (
            lambda d: d["space"]["learning_rate"].update(choices=[2e-4, 0.0002, 2.0e-4]),
            "space.learning_rate: choice 0.0002 appears 3 times; list each value once",
        ),
        (
            lambda d: d["space"]["alpha_multiplier"].update(choices=[1, 1.0]),
            "space.alpha_multiplier: choice 1 appears twice",
        ),
        (lambda d: d.pop("space"), "space: required key is missing"),
        (
            lambda d: d["space"].update(lora_dropout={"choices": [0.0, 1.0]}),
            "space.lora_dropout: every choice must be in [0, 1)",
        ),
        (lambda d: d["space"].update(lora_dropout={"low": 0.0, "high": 1.5}), "space.lora_dropout.high"),
        (lambda d: d["space"].update(lora_dropout={"low": 0.0, "high": 0.2, "log": True}), "needs low > 0"),
        (lambda d: d.update(seq_len="long"), "seq_len"),
        (
            lambda d: d.update(sampler="grid", space={**d["space"], "learning_rate": {"low": 1e-5, "high": 1e-3}}),
            "needs 'choices' for every parameter",
        ),
    ],
)
def test_bad_sweep_names_the_key(tmp_path, mutate, expected):
    data = _base()
    mutate(data)
    with pytest.raises(ConfigError) as info:
        load_sweep(_write(tmp_path, data))
    message = str(info.value)
    assert expected in message
    assert "\n" not in message and message.startswith(str(tmp_path))


def test_yaml_syntax_error_reports_line_and_column(tmp_path):
    path = _write(tmp_path, "name: x\ntasks: [synthetic\nseed: 1\n")
    with pytest.raises(ConfigError, match=r"sweep\.yaml:\d+:\d+: YAML syntax error"):
        load_sweep(path)


def test_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="no such sweep file"):
        load_sweep(tmp_path / "nope.yaml")


def test_cli_overrides_reach_nested_keys_and_errors_name_the_flag():
    config = load_sweep(SPACES / "demo.yaml", {"pack.size": 2, "n_trials": 3, "model": None})
    assert config.pack.size == 2 and config.n_trials == 3 and config.model == "smollm2-135m"
    assert config.pack.gather_seconds == _base()["pack"]["gather_seconds"]  # the rest of pack: kept
    with pytest.raises(ConfigError, match=r"^--pack-size: .*greater than 0 \(got 0\); pass a positive --pack-size$"):
        load_sweep(SPACES / "demo.yaml", {"pack.size": 0})


def test_directory_and_empty_file(tmp_path):
    with pytest.raises(ConfigError, match="is a directory, not a sweep file"):
        load_sweep(tmp_path)
    with pytest.raises(ConfigError, match="the file is empty; start from"):
        load_sweep(_write(tmp_path, ""))


def test_an_unknown_key_is_named_first_among_several_problems(tmp_path):
    data = _base()
    data["seq_len"] = "long"
    data["pack"]["size"] = 0
    data["space"]["rnak"] = data["space"].pop("rank")
    with pytest.raises(ConfigError) as info:
        load_sweep(_write(tmp_path, data))
    message = str(info.value)
    # the typo's own "space.rank: required key is missing" is the same problem: not counted again
    assert message == f"{tmp_path / 'sweep.yaml'}: unknown key 'space.rnak'; did you mean 'rank'? " + (
        "(+2 more problems: seq_len, pack.size)"
    )


def test_other_problems_are_named_even_without_an_unknown_key(tmp_path):
    data = _base()
    data["seq_len"] = "long"
    data["pack"]["size"] = 0
    with pytest.raises(ConfigError, match=r"seq_len: .*integer.* \(\+1 more problem: pack\.size\)$"):
        load_sweep(_write(tmp_path, data))


def test_distinct_choices_pass():
    config = load_sweep(SPACES / "demo.yaml")
    data = config.model_dump()
    data["space"]["learning_rate"] = {"choices": [2e-5, 2.00001e-5]}
    assert type(config).model_validate(data).space.learning_rate.choices == [2e-5, 2.00001e-5]


def test_checkpoint_interval_is_automatic_unless_set():
    auto = TrainSpec()
    assert auto.checkpoint_every is None
    assert auto.checkpoint_interval(30) == 7  # the demo: saved at steps 7, 14, 21, 28
    assert auto.checkpoint_interval(1000) == 250
    assert [auto.checkpoint_interval(n) for n in (0, 1, 3, 4, 7, 8)] == [1, 1, 1, 1, 1, 2]
    assert TrainSpec(checkpoint_every=100).checkpoint_interval(30) == 100
    assert TrainSpec(checkpoint_every=3).checkpoint_interval(10_000) == 3


def test_checkpoint_every_accepts_null_and_rejects_zero(tmp_path):
    data = _base()
    data["train"]["checkpoint_every"] = None
    assert load_sweep(_write(tmp_path, data)).train.checkpoint_interval(30) == 7
    data["train"]["checkpoint_every"] = 0
    with pytest.raises(ConfigError, match=r"train\.checkpoint_every: .*greater than 0"):
        load_sweep(_write(tmp_path, data))


def test_a_run_may_resume_with_a_different_checkpoint_interval(tmp_path):
    config = load_sweep(SPACES / "demo.yaml")
    fixed = config.model_copy(update={"train": TrainSpec(lr_schedule="constant", checkpoint_every=100)})
    RunState.of(fixed).save(tmp_path)
    assert check_resumable(tmp_path, config, resume=True) is not None
