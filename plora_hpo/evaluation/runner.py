"""Score many adapters of one packed model on lm-eval tasks in one batched pass.

``evaluate_adapters`` is what the sweep calls after a pack has trained: lm-eval's own
``evaluate()`` runs once per adapter (its filters, metrics and aggregation, unchanged), while
the model work for all adapters happens together in the shared server's batches.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from lm_eval.api.task import Task
from lm_eval.evaluator import evaluate

from plora_hpo.engine.packed_lora import PackedLoraModel
from plora_hpo.evaluation.lm import MultiAdapterServer, ServerStats
from plora_hpo.evaluation.uncertainty import document_statistics

log = logging.getLogger(__name__)

FEWSHOT_SEED = 1234  # lm-eval's simple_evaluate default few-shot seed


@dataclass
class EvaluationReport:
    """Everything one multi-adapter evaluation produced.

    Attributes:
        metrics: ``{adapter: {metric: value}}`` (see :func:`evaluate_adapters`).
        per_task: ``{adapter: {task: {metric: value}}}``.
        results: ``{adapter: lm-eval's results dict}`` (with ``samples`` when logged).
        stats: request counts, forwards, tokens and paging of the shared passes.
        seconds: wall time of the whole evaluation.
    """

    metrics: dict[str, dict[str, float]]
    per_task: dict[str, dict[str, dict[str, float]]]
    results: dict[str, dict[str, Any]]
    stats: ServerStats
    seconds: float = 0.0


def lm_eval_tasks(task_dict: Mapping[str, Any]) -> Iterator[Task]:
    """Task objects in either lm-eval task-dict layout (nested dicts or ``{"tasks": ...}``)."""
    for value in task_dict.values():
        if isinstance(value, Task):
            yield value
        elif isinstance(value, Mapping):
            yield from lm_eval_tasks(value)
        elif isinstance(value, tuple) and value and isinstance(value[-1], Task):
            yield value[-1]  # (group, task) pairs of older layouts


@contextmanager
def _requests_built_once(tasks: list[Task]) -> Iterator[None]:
    """Within the block, each task builds its requests once; later builds replay fresh copies.

    ``evaluate()`` rebuilds every request on each call (GSM8K 5-shot: seconds of few-shot
    formatting per call). The requests are the same for every adapter, so the first build is
    kept and later calls with the same arguments get new, empty ``Instance`` objects of it.
    """

    def fresh(instances: list) -> list:
        return [dataclasses.replace(i, resps=[], filtered_resps={}) for i in instances]

    shadowed = {id(t): vars(t).get("build_all_requests") for t in tasks}  # instance attributes, if any
    for task in tasks:
        original = task.build_all_requests
        built: dict[str, list] = {}

        def build(*args: Any, _task: Task = task, _original: Any = original, _built: dict = built, **kwargs: Any):
            key = repr((args, sorted(kwargs.items())))
            if key in _built:
                _task._instances = fresh(_built[key])
            else:
                _original(*args, **kwargs)
                _built[key] = fresh(_task._instances)

        task.build_all_requests = build  # an instance attribute; the class method is untouched
    try:
        yield
    finally:
        for task in tasks:
            if shadowed[id(task)] is None:
                del task.build_all_requests  # back to the class method
            else:
                task.build_all_requests = shadowed[id(task)]


def _numeric(entry: Mapping[str, Any]) -> dict[str, float]:
    """lm-eval's per-task metrics: no alias, no sample count, no ``"N/A"`` stderr placeholders."""
    return {
        key: float(value)
        for key, value in entry.items()
        if key not in ("alias", "sample_len") and isinstance(value, (int, float)) and not isinstance(value, bool)
    }


def evaluate_adapters_report(
    packed: PackedLoraModel,
    tokenizer: Any,
    adapter_ids: Sequence[str],
    task_dict: Mapping[str, Any],
    *,
    limit: int | float | None = None,
    samples: Mapping[str, list[int]] | None = None,
    batch_size: int = 32,
    max_new_tokens: int = 256,
    bootstrap_iters: int = 0,
    adapter_memory_budget: int | None = None,
    fewshot_seed: int = FEWSHOT_SEED,
    log_samples: bool = False,
    prefill_tokens: int = 8192,
    refill_fraction: float = 0.25,
) -> EvaluationReport:
    """:func:`evaluate_adapters` with per-task metrics, lm-eval's raw results and timings."""
    started = time.perf_counter()
    server = MultiAdapterServer(
        packed,
        tokenizer,
        adapter_ids,
        batch_size=batch_size,
        max_gen_toks=max_new_tokens,
        adapter_memory_budget=adapter_memory_budget,
        prefill_tokens=prefill_tokens,
        refill_fraction=refill_fraction,
    )
    model = packed.model
    was_training = model.training
    model.eval()
    tasks = list({id(t): t for t in lm_eval_tasks(task_dict)}.values())
    results: dict[str, dict[str, Any]] = {}
    for task in tasks:  # the few-shot examples simple_evaluate would pick, built once for all adapters
        task.set_fewshot_seed(seed=fewshot_seed)
    try:
        with _requests_built_once(tasks):
            for adapter_id in server.adapter_ids:
                out = evaluate(
                    lm=server.view(adapter_id),
                    task_dict=task_dict,
                    limit=limit,
                    samples=dict(samples) if samples else None,
                    bootstrap_iters=bootstrap_iters,
                    log_samples=True,  # per-document results: standard errors and prediction shares
                )
                results[adapter_id] = out or {}
    finally:
        model.train(was_training)
    by_name = {t.config.task: t for t in tasks}
    per_task = {}
    for adapter_id, res in results.items():
        per_task[adapter_id] = {}
        for name, entry in res.get("results", {}).items():
            numeric = _numeric(entry)
            docs = res.get("samples", {}).get(name, [])
            for key, value in document_statistics(docs, _choices(by_name.get(name), docs)).items():
                numeric.setdefault(key, value)  # lm-eval's own bootstrap, when it ran, wins
            per_task[adapter_id][name] = numeric
        if not log_samples:
            res.pop("samples", None)
    metrics = {}
    for adapter_id, tasks_metrics in per_task.items():
        if len(tasks_metrics) == 1:
            metrics[adapter_id] = dict(next(iter(tasks_metrics.values())))
        else:
            metrics[adapter_id] = {f"{t}/{k}": v for t, m in tasks_metrics.items() for k, v in m.items()}
    seconds = time.perf_counter() - started
    log.info("scored %d adapters in %.1f s (%s)", len(results), seconds, server.stats.requests)
    return EvaluationReport(metrics=metrics, per_task=per_task, results=results, stats=server.stats, seconds=seconds)


def _choices(task: Task | None, docs: Sequence[Mapping[str, Any]]) -> list[str] | None:
    """A multiple-choice task's answers (as its first scored document lists them), else None."""
    if task is None or task.OUTPUT_TYPE != "multiple_choice" or not docs:
        return None
    choices = task.doc_to_choice(docs[0]["doc"])
    return [str(c).strip() for c in choices] if isinstance(choices, (list, tuple)) else None


def evaluate_adapters(
    packed: PackedLoraModel,
    tokenizer: Any,
    adapter_ids: Sequence[str],
    task_dict: Mapping[str, Any],
    *,
    limit: int | float | None = None,
    samples: Mapping[str, list[int]] | None = None,
    batch_size: int = 32,
    max_new_tokens: int = 256,
    bootstrap_iters: int = 0,
    adapter_memory_budget: int | None = None,
) -> dict[str, dict[str, float]]:
    """Score every adapter on lm-eval tasks, all adapters sharing each batch.

    Args:
        packed: the packed model holding the adapters (its base stays frozen; left as found).
        tokenizer: the base model's Hugging Face tokenizer.
        adapter_ids: the adapters to score.
        task_dict: lm-eval tasks, as ``lm_eval.tasks.get_task_dict`` / ``TaskManager`` return them.
        limit: score only the first ``limit`` documents of each task (a float: that fraction).
        samples: score only these document indices, per task name (instead of ``limit``; see
            :func:`plora_hpo.evaluation.sampling.document_sample`).
        batch_size: rows per forward across adapters; the most sequences decoding at once.
        max_new_tokens: generation cap for requests that do not set ``max_gen_toks``.
        bootstrap_iters: lm-eval's bootstrap iterations for stderr (0: none, the fast choice).
        adapter_memory_budget: bytes of adapter weights allowed on the device at once; more
            adapters than that are paged in from host memory per batch (same results).

    Returns:
        ``{adapter_id: {metric: value}}`` with metric keys as lm-eval reports them
        (``"acc,none"``, ``"f1,none"``, ``"mcc,none"``, ``"exact_match,flexible-extract"``),
        each with its standard error (``"mcc_stderr,none"``) and, for multiple-choice tasks, the
        share of each answer among the predictions (``"pred_share_yes,none"``; see
        :mod:`plora_hpo.evaluation.uncertainty`); with several tasks the keys are
        ``"<task>/<metric>"``.

    Example:
        >>> scores = evaluate_adapters(packed, tokenizer, ["t0", "t1"], task_dict, limit=50)
        >>> scores["t0"]["mcc,none"]  # doctest: +SKIP
    """
    report = evaluate_adapters_report(
        packed,
        tokenizer,
        adapter_ids,
        task_dict,
        limit=limit,
        samples=samples,
        batch_size=batch_size,
        max_new_tokens=max_new_tokens,
        bootstrap_iters=bootstrap_iters,
        adapter_memory_budget=adapter_memory_budget,
    )
    return report.metrics
