"""lm-eval task objects from the built-in configs: splits, few-shot, and the metric keys lm-eval reports."""

from __future__ import annotations

import pytest
from lm_eval.api.model import LM
from lm_eval.evaluator import evaluate

from plora_hpo.tasks import build_eval_tasks, get_task


class AlwaysYes(LM):
    """A stand-in model: prefers the continuation " yes" and always answers GSM8K with 72."""

    def loglikelihood(self, requests):
        return [(-1.0 if r.args[1].strip() in ("yes", "A") else -2.0, False) for r in requests]

    def loglikelihood_rolling(self, requests):
        return [-1.0 for _ in requests]

    def generate_until(self, requests):
        return [" She sold 72 clips.\n#### 72" for _ in requests]


@pytest.mark.parametrize(
    ("name", "docs", "fewshot", "output_type"),
    [("gsm8k", 1319, 5, "generate_until"), ("mrpc", 408, 0, "multiple_choice"), ("cola", 1043, 0, "multiple_choice")],
)
def test_builtin_definitions_from_data_dir(name, docs, fewshot, output_type, data_dir):
    spec = get_task(name)
    task = build_eval_tasks(name, data_dir=data_dir)["tasks"][spec.lm_eval_task]
    assert len(task.eval_docs) == docs
    assert task.get_config("num_fewshot") == fewshot
    assert task.config.output_type == output_type
    assert task.config.dataset_path == "json"
    assert task.config.metadata["config_source"].endswith("task.yaml")


def test_gsm8k_fewshot_override_and_prompt(data_dir):
    task = build_eval_tasks("gsm8k", data_dir=data_dir, num_fewshot=2)["tasks"]["gsm8k"]
    assert task.get_config("num_fewshot") == 2
    context = task.fewshot_context(task.eval_docs[0], 2)
    assert context.count("Question: ") == 3 and context.endswith("\nAnswer:")
    assert "Janet’s ducks lay 16 eggs per day" in context


def test_metric_keys_reported_by_lm_eval(data_dir):
    tasks = {}
    for name in ("gsm8k", "mrpc", "cola", "synthetic"):
        tasks.update(build_eval_tasks(name, data_dir=data_dir, num_fewshot=0)["tasks"])
    out = evaluate(lm=AlwaysYes(), task_dict={"tasks": tasks}, limit=None, bootstrap_iters=0, log_samples=False)
    results = out["results"]
    for name in ("gsm8k", "mrpc", "cola", "synthetic"):
        spec = get_task(name)
        assert set(spec.metrics) <= set(results[spec.lm_eval_task]), results[spec.lm_eval_task]
    assert results["mrpc"]["acc,none"] == pytest.approx(279 / 408)
    assert results["mrpc"]["f1,none"] == pytest.approx(2 * 279 / (279 + 408))
    assert results["cola"]["mcc,none"] == pytest.approx(0.0)
    assert results["synthetic_groups"]["acc,none"] == pytest.approx(38 / 72)  # group A answers are right
    gsm = results["gsm8k"]
    assert 0 < gsm["exact_match,strict-match"] == gsm["exact_match,flexible-extract"] < 0.05
