"""Tasks to tune on: training examples and lm-eval evaluation, from one lm-eval definition.

Public API:

- :class:`TrainExample`: one tokenised training sequence (what the engine consumes).
- :class:`TaskSpec`, :data:`TASKS`, :func:`get_task`: the registry (synthetic, gsm8k, mrpc, cola).
- :func:`load_train_examples`: the train split as token sequences, prompts as lm-eval renders them.
- :func:`build_eval_tasks`: lm-eval task objects for ``lm_eval.evaluator.evaluate``.

Data comes from the Hugging Face Hub by default, or from a data directory of the original
files (argument, else ``$PLORA_HPO_DATA_DIR``); see :mod:`plora_hpo.tasks._sources`.

Importing this package needs only the standard library; lm-eval and transformers are imported
when data is loaded, so the GPU image (no lm-eval) can still import :class:`TrainExample`.
"""

from __future__ import annotations

import os
import random
from typing import TYPE_CHECKING, Any

from plora_hpo.errors import ConfigError
from plora_hpo.tasks import cola, gsm8k, mrpc, synthetic
from plora_hpo.tasks._base import TaskSpec, TrainExample
from plora_hpo.tasks._sources import DATA_DIR_ENV

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

__all__ = [
    "DATA_DIR_ENV",
    "TASKS",
    "TaskSpec",
    "TrainExample",
    "build_eval_tasks",
    "get_task",
    "load_train_examples",
]

TASKS: dict[str, TaskSpec] = {spec.name: spec for spec in (synthetic.TASK, gsm8k.TASK, mrpc.TASK, cola.TASK)}


def get_task(name: str) -> TaskSpec:
    """The task called ``name``; the error lists the known tasks."""
    if name not in TASKS:
        raise ConfigError(f"unknown task {name!r}; choose from {', '.join(TASKS)}")
    return TASKS[name]


def load_train_examples(
    task_name: str,
    tokenizer: PreTrainedTokenizerBase,
    *,
    seq_len: int,
    data_dir: str | os.PathLike[str] | None = None,
    max_examples: int | None = None,
    seed: int = 0,
) -> list[TrainExample]:
    """Tokenised training examples of ``task_name``'s train split.

    Prompt = the lm-eval task's zero-shot ``doc_to_text``; completion = its ``target_delimiter``
    plus the gold target (answer text or correct choice) plus EOS. Prompt tokens are labelled
    -100. Sequences longer than ``seq_len`` lose prompt tokens from the left first.

    Args:
        task_name: one of :data:`TASKS`.
        tokenizer: the base model's tokenizer.
        seq_len: most tokens per example.
        data_dir: folder with the original files; default ``$PLORA_HPO_DATA_DIR``, else the Hub.
        max_examples: keep only this many, a ``seed``-shuffled subset (all, in split order, if None).
        seed: seeds the subset choice; the same seed gives the same examples.

    Example:
        >>> examples = load_train_examples("synthetic", tokenizer, seq_len=64)  # doctest: +SKIP
        >>> examples[0].labels[:3]
        (-100, -100, -100)
    """
    from plora_hpo.tasks._encode import encode_pairs
    from plora_hpo.tasks._lmeval import load_task, training_pairs

    spec = get_task(task_name)
    if max_examples is not None and max_examples <= 0:
        raise ConfigError(f"max_examples must be positive, got {max_examples}")
    task, _ = load_task(spec, data_dir)
    order = list(range(len(task.training_docs())))
    if max_examples is not None:
        random.Random(seed).shuffle(order)
        order = order[:max_examples]
    prompts, completions = training_pairs(task, order)
    return encode_pairs(tokenizer, prompts, completions, seq_len=seq_len)


def build_eval_tasks(
    task_name: str,
    *,
    data_dir: str | os.PathLike[str] | None = None,
    num_fewshot: int | None = None,
) -> dict[str, Any]:
    """lm-eval's task dict for ``task_name``, ready for ``lm_eval.evaluator.evaluate(lm, task_dict)``.

    The task is lm-eval's built-in definition (prompts, few-shot count, filters, metrics) with
    only its data source replaced when a data directory is used. ``num_fewshot`` overrides the
    task's default as ``lm_eval.simple_evaluate`` would; the few-shot sampler is seeded with
    lm-eval's default seed. Pass ``limit`` and ``bootstrap_iters`` to ``evaluate`` itself. Results
    are reported under ``get_task(task_name).lm_eval_task`` with keys like ``"acc,none"``.
    """
    from plora_hpo.tasks._lmeval import load_task, prepare_for_eval

    spec = get_task(task_name)
    task, _ = load_task(spec, data_dir)
    prepare_for_eval(task, num_fewshot)
    return {"tasks": {spec.lm_eval_task: task}, "groups": {}, "group_map": {}}
