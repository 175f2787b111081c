"""Building lm-eval task objects, and reading training pairs out of them.

Both training and evaluation go through the same lm-eval ``Task``: training prompts are the
task's own ``doc_to_text`` and targets its own ``doc_to_target``/``doc_to_choice``, joined by its
``target_delimiter``, so a trained adapter is asked exactly what it was taught.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from plora_hpo.errors import DataError
from plora_hpo.tasks._base import TaskSpec
from plora_hpo.tasks._sources import TaskSource, hub_unreachable_error, task_source

if TYPE_CHECKING:
    from lm_eval.api.task import Task

# lm-eval's default few-shot sampler seed (simple_evaluate's fewshot_random_seed).
FEWSHOT_SEED = 1234

log = logging.getLogger(__name__)


def load_task(spec: TaskSpec, data_dir: str | os.PathLike[str] | None) -> tuple[Task, TaskSource]:
    """Instantiate ``spec``'s lm-eval task with its data loaded from the chosen source."""
    from lm_eval.tasks import TaskManager

    _compile_each_template_once()
    source = task_source(spec, data_dir)
    # No default index: loading one YAML by path skips scanning lm-eval's ~15k task files (~8 s).
    manager = TaskManager(include_defaults=False)
    try:
        loaded = manager.load(str(source.config_path))
    except Exception as err:  # datasets raises many unrelated types for "cannot reach the Hub"
        if source.origin != "hub":
            raise DataError(
                f"task {spec.name!r}: lm-eval could not load {source.description}: {_first_line(err)}"
            ) from err
        raise hub_unreachable_error(spec, _first_line(err)) from None
    task = loaded["tasks"].get(spec.lm_eval_task)
    if task is None:
        raise DataError(
            f"task {spec.name!r}: {source.config_path} defines lm-eval tasks {sorted(loaded['tasks'])} but not "
            f"{spec.lm_eval_task!r}; delete that file's folder so it is written again"
        )
    log.info("task %s: data from %s", spec.name, source.description)
    return task, source


TEMPLATES_KEPT = 256
"""Compiled prompt templates lm-eval keeps per process (a task has a handful)."""


def _compile_each_template_once() -> None:
    """Have lm-eval compile each prompt template once per process, not once per document.

    lm-eval renders a task's Jinja templates (``doc_to_text``, ``doc_to_target``, …) through
    ``lm_eval.utils.apply_template``, which compiles the template string again for every document
    it renders: about half a millisecond each, seconds for a training split (GSM8K renders two
    templates for each of its 7,473 documents) and again for every few-shot context. A compiled
    template renders any document, and lm-eval's environment compiles nothing but these strings,
    so its ``from_string`` is memoised.
    """
    from lm_eval import utils

    if not hasattr(utils.env.from_string, "cache_info"):
        utils.env.from_string = functools.lru_cache(maxsize=TEMPLATES_KEPT)(utils.env.from_string)


def training_pairs(task: Task, indices: Sequence[int] | None = None) -> tuple[list[str], list[str]]:
    """(prompt, completion) for documents of the task's training split (all, or ``indices``)."""
    if not task.has_training_docs():
        raise DataError(f"lm-eval task {task.config.task!r} has no training split")
    docs = task.training_docs()
    delimiter = task.config.target_delimiter
    prompts, completions = [], []
    for i in range(len(docs)) if indices is None else indices:
        doc = docs[i]
        prompts.append(task.doc_to_text(doc))
        completions.append(delimiter + target_text(task, doc))
    return prompts, completions


def target_text(task: Task, doc: dict[str, Any]) -> str:
    """The gold continuation of one document: the answer text, or the correct choice's text."""
    target = task.doc_to_target(doc)
    if isinstance(target, list):  # tasks with several acceptable answers: train on the first
        target = target[0]
    if task.config.output_type == "multiple_choice":
        choices = task.doc_to_choice(doc)
        return str(choices[target] if isinstance(target, int) else target)
    return str(target)


def prepare_for_eval(task: Task, num_fewshot: int | None) -> None:
    """Apply what ``lm_eval.simple_evaluate`` does before ``evaluate``: few-shot count and seed."""
    default = task.get_config("num_fewshot")
    if num_fewshot is not None and default != 0:  # lm-eval never overrides a YAML's explicit 0
        task.set_config(key="num_fewshot", value=num_fewshot)
    elif default is None:
        task.set_config(key="num_fewshot", value=0)
    task.set_fewshot_seed(seed=FEWSHOT_SEED)


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    line = text.splitlines()[0] if text else ""
    return f"{type(err).__name__}: {line}" if line else type(err).__name__
