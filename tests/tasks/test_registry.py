"""The task registry matches the sweep config's task names and lm-eval's metric keys."""

from __future__ import annotations

import pytest

from plora_hpo.config import TASK_NAMES
from plora_hpo.errors import ConfigError
from plora_hpo.tasks import TASKS, get_task


def test_registry_covers_config_task_names():
    assert tuple(TASKS) == TASK_NAMES


@pytest.mark.parametrize(
    ("name", "lm_eval_task", "primary", "split"),
    [
        ("gsm8k", "gsm8k", "exact_match,flexible-extract", "test"),
        ("mrpc", "mrpc", "acc,none", "validation"),
        ("cola", "cola", "mcc,none", "validation"),
        ("synthetic", "synthetic_groups", "acc,none", "validation"),
    ],
)
def test_task_identity(name, lm_eval_task, primary, split):
    spec = get_task(name)
    assert (spec.lm_eval_task, spec.primary_metric, spec.eval_split, spec.direction) == (
        lm_eval_task,
        primary,
        split,
        "maximize",
    )
    assert spec.metrics[0] == primary


def test_extra_metrics():
    assert "f1,none" in get_task("mrpc").metrics
    assert "exact_match,strict-match" in get_task("gsm8k").metrics


def test_synthetic_is_labelled_synthetic():
    spec = get_task("synthetic")
    assert "synthetic" in spec.name and "synthetic" in spec.lm_eval_task and "synthetic" in spec.description


def test_unknown_task():
    with pytest.raises(ConfigError, match=r"unknown task 'sst2'; choose from synthetic, gsm8k, mrpc, cola"):
        get_task("sst2")


@pytest.mark.parametrize("name", sorted(TASKS))
def test_module_docstring_has_example(name):
    import importlib

    module = importlib.import_module(f"plora_hpo.tasks.{name}")
    assert "Example item" in module.__doc__ and "Answer:" in module.__doc__
