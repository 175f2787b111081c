"""What one device trains and scores with: the frozen base model, each task's training examples
and its lm-eval task objects, loaded together for one sweep's settings.

The sweep recipe (:class:`plora_hpo.sweep.PackedSweep`) builds its first device worker from a
replica. A worker process that the sweep starts before it has checked its inputs loads the
replica as soon as it is told the sweep's settings, while the sweep opens its stores, and hands
it to the recipe when it is given its study: the recipe takes it only when it was loaded for the
very same settings, device and data directory (:attr:`Replica.key`), and loads its own otherwise.

Boundary: loading; how the parts are used is the recipe's and the workers'.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from plora_hpo.config import SweepConfig
from plora_hpo.errors import ConfigError
from plora_hpo.resources import TaskData
from plora_hpo.timeline import phase

if TYPE_CHECKING:
    from plora_hpo.models import LoadedModel
    from plora_hpo.tasks import TaskSpec


def replica_key(config: SweepConfig, device: torch.device, data_dir: str | None) -> str:
    """What a replica is loaded for: the whole sweep file, the device and the data directory."""
    return json.dumps(
        {"config": config.model_dump(mode="json"), "device": str(device), "data_dir": data_dir}, sort_keys=True
    )


@dataclass
class Replica:
    """A base model and the tasks' data, loaded for the settings in ``key``.

    Attributes:
        key: :func:`replica_key` of the settings, device and data directory it was loaded for.
        base: the frozen base model and its tokenizer.
        specs: each task's resolved definition (lm-eval task, objective metric, direction).
        tasks: each task's tokenized training examples and metric.
        eval_tasks: each task's lm-eval task objects (they keep per-run state: one device's own).
    """

    key: str
    base: LoadedModel
    specs: dict[str, TaskSpec]
    tasks: dict[str, TaskData]
    eval_tasks: dict[str, Any]


def load_base(config: SweepConfig, device: torch.device, *, sharded: bool = False) -> LoadedModel:
    """The sweep's base model on ``device`` (split over its tensor-parallel group when ``sharded``)."""
    from plora_hpo.models import load_base_model

    dtype = None if config.dtype == "auto" else getattr(torch, config.dtype)
    base = load_base_model(config.model, dtype=dtype, device=device, seed=config.seed)
    if base.tokenizer is None:
        raise ConfigError(
            f"model {config.model!r} has no tokenizer (random-init shapes are for benchmarks); "
            "use 'smollm2-135m', a hub id or a local model directory"
        )
    if sharded:
        from plora_hpo.engine.tensor_parallel import shard_model

        shard_model(base.model)
    return base


def fresh_eval_tasks(config: SweepConfig, specs: dict[str, TaskSpec], data_dir: str | None) -> dict[str, Any]:
    """Fresh lm-eval task objects for every task of the sweep (they keep per-run state: one set per device)."""
    from plora_hpo.tasks import build_eval_tasks

    num_fewshot = config.evaluation.num_fewshot
    return {task: build_eval_tasks(specs[task], data_dir=data_dir, num_fewshot=num_fewshot) for task in config.tasks}


def sweep_train_examples(config: SweepConfig, spec: TaskSpec, tokenizer: Any, data_dir: str | None) -> list:
    """A task's training examples as the sweep trains them: its ``seq_len``, example cap and seed
    (what ``plora-hpo plan`` sizes rows by, too)."""
    from plora_hpo.tasks import load_train_examples

    return load_train_examples(
        spec,
        tokenizer,
        seq_len=config.seq_len,
        data_dir=data_dir,
        max_examples=config.budget.max_train_examples,
        seed=config.seed,
    )


def load_replica(config: SweepConfig, device: torch.device, data_dir: str | None, *, sharded: bool = False) -> Replica:
    """Load the base model on ``device`` and every task's data (timed as ``load-model`` and
    ``load-data``). Raises :class:`~plora_hpo.errors.ConfigError` for a model without a tokenizer
    or a batch size larger than a task's training set, and the loaders' errors for missing data."""
    from plora_hpo.tasks import resolve_task

    with phase("load-model"):
        base = load_base(config, device, sharded=sharded)
    specs = {task: resolve_task(task, config.custom_tasks) for task in config.tasks}
    tasks: dict[str, TaskData] = {}
    with phase("load-data"):
        for name in config.tasks:
            examples = sweep_train_examples(config, specs[name], base.tokenizer, data_dir)
            largest_batch = max(config.space.batch_size.choices or [config.space.batch_size.high])
            if largest_batch > len(examples):
                raise ConfigError(
                    f"space.batch_size: {int(largest_batch)} is larger than the {len(examples)} training "
                    f"examples of task {name!r}; lower the batch size or raise budget.max_train_examples"
                )
            tasks[name] = TaskData(examples=examples, metric=specs[name].primary_metric)
        # built now so that missing evaluation data fails with one clear line
        eval_tasks = fresh_eval_tasks(config, specs, data_dir)
    return Replica(replica_key(config, device, data_dir), base, specs, tasks, eval_tasks)
