"""Tasks to tune on: training examples and lm-eval evaluation, from one lm-eval definition.

Public API:

- :class:`TrainExample`: one tokenised training sequence (what the engine consumes).
- :class:`TaskSpec`, :data:`TASKS`, :func:`get_task`: the registry (synthetic, gsm8k, mrpc, cola).
- :func:`resolve_task`: a built-in task, or one the sweep file defines under ``custom_tasks``
  (:mod:`plora_hpo.tasks.custom`).
- :func:`load_train_examples`: the train split as token sequences, prompts as lm-eval renders them.
- :func:`padded_length`: the most tokens a training row of those examples has (what packs are sized by).
- :func:`build_eval_tasks`: lm-eval task objects for ``lm_eval.evaluator.evaluate``.

Data comes from the Hugging Face Hub by default, or from a data directory of the original
files (argument, else ``$PLORA_HPO_DATA_DIR``); see :mod:`plora_hpo.tasks._sources`.

Importing this package needs only the standard library; lm-eval and transformers are imported
when data is loaded, so the GPU image (no lm-eval) can still import :class:`TrainExample`.
"""

from __future__ import annotations

import os
import random
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

from plora_hpo.errors import ConfigError
from plora_hpo.tasks import cola, gsm8k, mrpc, synthetic
from plora_hpo.tasks._base import Direction, TaskSpec, TrainExample
from plora_hpo.tasks._sources import DATA_DIR_ENV

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from plora_hpo.config import CustomTask

__all__ = [
    "DATA_DIR_ENV",
    "TASKS",
    "Direction",
    "TaskSpec",
    "TrainExample",
    "build_eval_tasks",
    "get_task",
    "load_train_examples",
    "padded_length",
    "resolve_task",
]

TASKS: dict[str, TaskSpec] = {spec.name: spec for spec in (synthetic.TASK, gsm8k.TASK, mrpc.TASK, cola.TASK)}


def get_task(name: str) -> TaskSpec:
    """The task called ``name``; the error lists the known tasks."""
    if name not in TASKS:
        raise ConfigError(f"unknown task {name!r}; choose from {', '.join(TASKS)}")
    return TASKS[name]


def resolve_task(name: str, custom_tasks: Mapping[str, CustomTask]) -> TaskSpec:
    """The task called ``name``: one the sweep file defines in ``custom_tasks`` (its lm-eval task is
    loaded and checked; see :func:`plora_hpo.tasks.custom.custom_task_spec`), else a built-in one."""
    if name in custom_tasks:
        from plora_hpo.tasks.custom import custom_task_spec

        return custom_task_spec(name, custom_tasks[name])
    return get_task(name)


def _spec(task: str | TaskSpec) -> TaskSpec:
    return task if isinstance(task, TaskSpec) else get_task(task)


def load_train_examples(
    task: str | TaskSpec,
    tokenizer: PreTrainedTokenizerBase,
    *,
    seq_len: int,
    data_dir: str | os.PathLike[str] | None = None,
    max_examples: int | None = None,
    seed: int = 0,
) -> list[TrainExample]:
    """Tokenised training examples of ``task``'s train split.

    Prompt = the lm-eval task's zero-shot ``doc_to_text``; completion = its ``target_delimiter``
    plus the gold target (answer text or correct choice) plus EOS. Prompt tokens are labelled
    -100. Sequences longer than ``seq_len`` lose prompt tokens from the left first.

    Args:
        task: one of :data:`TASKS`, or a resolved spec (:func:`resolve_task`).
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

    spec = _spec(task)
    if max_examples is not None and max_examples <= 0:
        raise ConfigError(f"max_examples must be positive, got {max_examples}")
    lm_task, _ = load_task(spec, data_dir)
    order = list(range(len(lm_task.training_docs())))
    if max_examples is not None:
        random.Random(seed).shuffle(order)
        order = order[:max_examples]
    prompts, completions = training_pairs(lm_task, order)
    return encode_pairs(tokenizer, prompts, completions, seq_len=seq_len)


def padded_length(seq_len: int, examples: Iterable[TrainExample]) -> int:
    """The most tokens a training row can have: the longest of ``examples``, at most ``seq_len``
    (``seq_len`` when there are none).

    The engine pads a step's rows only to its longest row, so sizing packs by ``seq_len`` (512 in
    paper120) on a task of ~100-token examples (MRPC) overstates activation memory and step time
    several times over, and the planner packs far fewer adapters than fit.
    """
    longest = max((len(e.input_ids) for e in examples), default=seq_len)
    return max(1, min(seq_len, longest))


def build_eval_tasks(
    task: str | TaskSpec,
    *,
    data_dir: str | os.PathLike[str] | None = None,
    num_fewshot: int | None = None,
) -> dict[str, Any]:
    """lm-eval's task dict for ``task`` (a name or a resolved spec), for ``lm_eval.evaluator.evaluate``.

    The task is lm-eval's built-in definition (prompts, few-shot count, filters, metrics) with
    only its data source replaced when a data directory is used. ``num_fewshot`` overrides the
    task's default as ``lm_eval.simple_evaluate`` would; the few-shot sampler is seeded with
    lm-eval's default seed. Pass ``limit`` and ``bootstrap_iters`` to ``evaluate`` itself. Results
    are reported under the spec's ``lm_eval_task`` with keys like ``"acc,none"``.
    """
    from plora_hpo.tasks._lmeval import load_task, prepare_for_eval

    spec = _spec(task)
    lm_task, _ = load_task(spec, data_dir)
    prepare_for_eval(lm_task, num_fewshot)
    return {"tasks": {spec.lm_eval_task: lm_task}, "groups": {}, "group_map": {}}
