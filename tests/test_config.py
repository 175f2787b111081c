"""Sweep files: the shipped ones validate; malformed ones fail with one line that says where."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from plora_hpo.config import load_sweep
from plora_hpo.errors import ConfigError

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
        (lambda d: d.update(target_modules=["qkv"]), "target_modules: unknown target module 'qkv'"),
        (lambda d: d["space"]["rank"].update(choices=[8, -16]), "space.rank: every choice must be > 0"),
        (lambda d: d["space"].update(learning_rate={"low": 0, "high": 1e-3}), "space.learning_rate.low"),
        (lambda d: d["space"]["batch_size"].update(choices=[0]), "space.batch_size"),
        (lambda d: d["space"].update(alpha_multiplier={"choices": []}), "'choices' is empty"),
        (lambda d: d.update(budget={"steps": 10, "epochs": 1}), "exactly one of 'steps' or 'epochs'"),
        (lambda d: d.update(colour="red"), "colour: unknown key"),
        (lambda d: d.pop("space"), "space: required key is missing"),
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
