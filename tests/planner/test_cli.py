"""``plora-hpo plan`` through its argparse arguments: JSON, table, Gantt chart and bad input."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from plora_hpo.errors import ConfigError, PloraError
from plora_hpo.planner.cli import add_plan_arguments, run_plan

SPACES = Path(__file__).resolve().parents[2] / "search_spaces"


def plan(*argv: str) -> int:
    parser = argparse.ArgumentParser()
    add_plan_arguments(parser)
    return run_plan(parser.parse_args(list(argv)))


def test_paper120_json_on_8_gpus(capsys, tmp_path):
    gantt = tmp_path / "g.png"
    args = ["--model", "qwen2.5-7b", "--gpus", "8", "--gpu-memory-gib", "80", "--json", "--gantt", str(gantt)]
    assert plan(str(SPACES / "paper120.yaml"), *args) == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out) >= {"packs", "makespan", "baselines", "solver", "planning_seconds"}
    assert set(out["baselines"]) == {"min_gpu", "max_gpu", "greedy", "lower_bound"}
    assert sorted(c for p in out["packs"] for c in p["configs"]) == list(range(120))
    for p in out["packs"]:
        assert {"configs", "degree", "gpus", "start", "end"} <= set(p)
        assert len(p["gpus"]) == p["degree"]
    assert out["makespan"] < out["baselines"]["min_gpu"], "packing must beat one-config-per-GPU"
    assert out["makespan"] >= out["baselines"]["lower_bound"]
    assert out["solver"] in {"gurobi", "highs", "gurobi+highs"}
    assert gantt.stat().st_size > 10_000 and out["gantt"] == str(gantt)


def test_a_grid_sweep_plans_the_grid_points_its_trials_take(capsys, tmp_path):
    """With n_trials below the grid's size the plan is for the configs the sweep trains: the ones
    it enqueues in its Optuna study, in that order (not the first points of the grid's product)."""
    import yaml

    from plora_hpo.config import load_sweep
    from plora_hpo.space import SearchSpace
    from plora_hpo.study import create_study, queue_grid

    data = yaml.safe_load((SPACES / "paper120.yaml").read_text())
    data.update(n_trials=16, budget={"steps": 100}, tasks=["synthetic"])
    sweep_file = tmp_path / "sweep.yaml"
    sweep_file.write_text(yaml.safe_dump(data))
    assert plan(str(sweep_file), "--model", "qwen2.5-1.5b", "--gpus", "2", "--gpu-memory-gib", "80",
                "--no-gantt", "--json") == 0  # fmt: skip
    planned = json.loads(capsys.readouterr().out)["config_labels"]

    config = load_sweep(sweep_file)
    study = create_study(config, "synthetic", f"sqlite:///{tmp_path / 'optuna.db'}")
    assert queue_grid(study, config.n_trials) == 16
    space = SearchSpace(config.space, seed=config.seed)
    queued = [t.system_attrs["fixed_params"] for t in sorted(study.trials, key=lambda t: t.number)]
    assert planned == [space.to_config(p, seed=space.config_seed(p)).label() for p in queued]
    first_of_product = [c.label() for c in space.enumerate_configs()[:16]]
    assert planned != first_of_product  # the seeded order, which a plan of the product's head would miss


def test_a_sweep_with_another_sampler_plans_n_trials_draws(capsys, tmp_path):
    import yaml

    data = yaml.safe_load((SPACES / "paper120.yaml").read_text())
    data.update(n_trials=12, budget={"steps": 100}, sampler="tpe")
    sweep_file = tmp_path / "sweep.yaml"
    sweep_file.write_text(yaml.safe_dump(data))
    assert plan(str(sweep_file), "--model", "qwen2.5-1.5b", "--gpus", "1", "--gpu-memory-gib", "80",
                "--no-gantt", "--json") == 0  # fmt: skip
    assert len(json.loads(capsys.readouterr().out)["config_labels"]) == 12  # not the grid's 120


def test_a_sweep_is_planned_with_its_longest_training_row(capsys, tmp_path):
    """The sweep pads each step only to its longest row and sizes its packs so; its plan does the
    same with the sweep model's tokenizer, unless --seq-len says otherwise. A model without a
    tokenizer plans with seq_len and says why."""
    import yaml

    from plora_hpo.models import load_tokenizer
    from plora_hpo.tasks import load_train_examples

    data = yaml.safe_load((SPACES / "paper120.yaml").read_text())
    data.update(model="smollm2-135m", tasks=["synthetic"], n_trials=8, budget={"steps": 50})
    sweep_file = tmp_path / "sweep.yaml"
    sweep_file.write_text(yaml.safe_dump(data))
    argv = [str(sweep_file), "--model", "qwen2.5-1.5b", "--gpus", "1", "--gpu-memory-gib", "80", "--no-gantt", "--json"]

    def planned(*extra: str) -> dict:
        assert plan(*argv, *extra) == 0
        return json.loads(capsys.readouterr().out)

    examples = load_train_examples("synthetic", load_tokenizer("smollm2-135m"), seq_len=512)
    longest = max(len(e.input_ids) for e in examples)
    rows = planned()
    assert rows["seq_len"] == longest < 512 and rows["seq_len_source"] == "the longest training example of synthetic"
    padded = planned("--seq-len", "512")
    assert (padded["seq_len"], padded["seq_len_source"]) == (512, "--seq-len")
    assert padded["makespan"] > rows["makespan"]  # rows of 512 tokens: longer steps

    data["model"] = "random:qwen2.5-1.5b"
    sweep_file.write_text(yaml.safe_dump(data))
    fallback = planned()
    assert fallback["seq_len"] == 512 and "a random-init model has no tokenizer" in fallback["seq_len_source"]


def test_a_bad_flag_is_refused_before_the_training_data_is_read(tmp_path, monkeypatch):
    """Reading the rows takes the tokenizer and the task data (seconds); a bad --model needs neither."""
    import yaml

    from plora_hpo import models

    def never(*_args, **_kwargs):
        raise AssertionError("the training rows were read before the flags were checked")

    monkeypatch.setattr(models, "load_tokenizer", never)
    data = yaml.safe_load((SPACES / "paper120.yaml").read_text())
    data.update(model="smollm2-135m", tasks=["synthetic"], n_trials=4, budget={"steps": 50})
    sweep_file = tmp_path / "sweep.yaml"
    sweep_file.write_text(yaml.safe_dump(data))
    with pytest.raises(ConfigError, match="unknown model shape 'gpt-9'"):
        plan(str(sweep_file), "--model", "gpt-9", "--gpus", "1", "--gpu-memory-gib", "80", "--no-gantt")


def test_table_and_hub_id_mapping(capsys, tmp_path):
    # adaptive.yaml names Qwen/Qwen2.5-1.5B-Instruct: the shape follows from the hub id.
    args = ["--gpus", "2", "--gpu-memory-gib", "80", "--samples", "12", "--steps", "100", "--no-gantt"]
    assert plan(str(SPACES / "adaptive.yaml"), *args) == 0
    out = capsys.readouterr().out
    assert "model qwen2.5-1.5b" in out and "predicted makespan" in out and "speedup over min gpu" in out
    assert "gantt chart" not in out


def test_bare_space_file(tmp_path, capsys):
    space = tmp_path / "space.yaml"
    space.write_text(
        "rank: {choices: [8, 64]}\nalpha_multiplier: {choices: [1]}\n"
        "learning_rate: {choices: [1.0e-4]}\nbatch_size: {choices: [1, 4]}\n"
    )
    base = [str(space), "--gpus", "1", "--gpu-memory-gib", "24", "--no-gantt", "--json"]
    with pytest.raises(ConfigError, match="names no model"):
        plan(*base)
    with pytest.raises(ConfigError, match="pass --steps"):
        plan(*base, "--model", "qwen2.5-0.5b")
    assert plan(*base, "--model", "qwen2.5-0.5b", "--steps", "10") == 0
    assert len(json.loads(capsys.readouterr().out)["config_labels"]) == 4


@pytest.mark.parametrize(
    ("argv", "error", "words"),
    [
        (["--gpus", "0", "--gpu-memory-gib", "80"], PloraError, "at least one GPU"),
        (["--gpus", "8", "--gpu-memory-gib", "-5"], PloraError, "GPU memory must be a positive"),
        (["--gpus", "8", "--gpu-memory-gib", "80", "--model", "gpt-9"], ConfigError, "unknown model shape 'gpt-9'"),
        (["--gpus", "8", "--gpu-memory-gib", "80", "--samples", "0"], ConfigError, "--samples must be at least 1"),
        (["--gpus", "8", "--gpu-memory-gib", "80", "--seq-len", "0"], ConfigError, "--seq-len must be at least 1"),
        (["--gpus", "8", "--gpu-memory-gib", "80", "--max-degree", "3"], PloraError, "power of two"),
        (["--gpus", "1", "--gpu-memory-gib", "16"], PloraError, "cannot fit even alone on 1 GPU"),
    ],
)
def test_bad_input_is_one_clear_line(argv, error, words):
    with pytest.raises(error, match=words) as err:
        plan(str(SPACES / "paper120.yaml"), "--no-gantt", "--json", *argv)
    assert "\n" not in str(err.value)


def test_ranged_space_needs_samples_and_missing_file(tmp_path):
    sweep = tmp_path / "s.yaml"
    text = (SPACES / "adaptive.yaml").read_text().replace("n_trials: 64\n", "")
    sweep.write_text(text)
    with pytest.raises(ConfigError, match="--samples N"):
        plan(str(sweep), "--gpus", "1", "--gpu-memory-gib", "80", "--no-gantt")
    with pytest.raises(ConfigError, match="no such file"):
        plan(str(tmp_path / "missing.yaml"), "--gpus", "1", "--gpu-memory-gib", "80")


def test_allow_unschedulable_plans_the_rest(capsys):
    argv = ["--gpus", "1", "--gpu-memory-gib", "14", "--model", "qwen2.5-1.5b", "--no-gantt", "--json"]
    assert plan(str(SPACES / "paper120.yaml"), *argv, "--allow-unschedulable") == 0
    out = json.loads(capsys.readouterr().out)
    left_out = set(out["unschedulable"])
    assert left_out and sorted(left_out | {c for p in out["packs"] for c in p["configs"]}) == list(range(120))


def test_a_sweep_that_rotates_is_planned_with_its_trials_taking_turns(capsys, tmp_path):
    """The trials a full pack leaves over take turns in it (``pack.rotate``, on by default), so
    the plan has one pack that starts with those that fit; a sweep that does not rotate (turned
    off, a pruner, or ``--no-rotate``) is planned with them in a pack of their own afterwards."""
    import yaml

    data = yaml.safe_load((SPACES / "paper120.yaml").read_text())
    data.update(model="random:qwen2.5-1.5b", tasks=["synthetic"], n_trials=32, budget={"steps": 200})
    argv = ["--gpus", "1", "--gpu-memory-gib", "79.18", "--seq-len", "151", "--no-gantt"]

    def planned(changes: dict, *extra: str) -> list[dict]:
        sweep_file = tmp_path / "sweep.yaml"
        sweep_file.write_text(yaml.safe_dump({**data, **changes}))
        assert plan(str(sweep_file), *argv, "--json", *extra) == 0
        return json.loads(capsys.readouterr().out)["packs"]

    (pack,) = planned({})
    assert len(pack["configs"]) == 32 and 20 < pack["width"] < 32
    for changes, extra in [
        ({"pack": {"size": 32, "rotate": False}}, ()),
        ({"pruning": {"pruner": "median"}}, ()),
        ({}, ("--no-rotate",)),
    ]:
        first, *rest = planned(changes, *extra)
        assert first["configs"] == sorted(set(first["configs"])) and first["width"] == pack["width"]
        assert rest and all(p["start"] >= first["end"] and p["width"] == len(p["configs"]) for p in rest)
        assert sorted(c for p in (first, *rest) for c in p["configs"]) == list(range(32))

    sweep_file = tmp_path / "sweep.yaml"
    sweep_file.write_text(yaml.safe_dump(data))
    assert plan(str(sweep_file), *argv) == 0
    assert f"32 ({pack['width']} first, the rest by turns): 0-31" in capsys.readouterr().out
