"""What a device worker is given to train on: its base replica, task data, eval tasks, device.

Built by the sweep (one :class:`DeviceResources` per worker) and handed over whole; the worker
reads these and never reaches back into whoever built them. Importable with torch alone.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch

from plora_hpo.adapter import AdapterConfig

if TYPE_CHECKING:
    from plora_hpo.config import BudgetSpec
    from plora_hpo.planner import GpuSpec


@dataclass
class TaskData:
    """One task's tokenized training examples and the metric its trials are scored by."""

    examples: list[Any]
    metric: str


@dataclass
class DeviceResources:
    """One worker's own copy of everything it trains and scores with.

    Attributes:
        device: where the base replica lives.
        name: the worker's name in pack ids and logs (``cpu``, ``cuda:1``, ``cpu#2``).
        base: the loaded base model (model, tokenizer, shape, name).
        eval_tasks: lm-eval task objects per task (they keep per-run state: one set per worker).
        tasks: training data per task (shared, read-only).
        gpu: the device as the planner's cost model sees it.
    """

    device: torch.device
    name: str
    base: Any
    eval_tasks: dict[str, Any]
    tasks: dict[str, TaskData]
    gpu: GpuSpec


class AdapterScorer(Protocol):
    """Scores adapters of a pack on a task: ``{adapter_id: {metric: value}}``.

    ``limit``: at most this many evaluation documents (None: the whole evaluation set). The
    sweep's scorer runs the task's lm-eval definition over many adapters per batch
    (:func:`plora_hpo.evaluation.evaluate_adapters`).
    """

    def __call__(
        self, packed: Any, adapter_ids: Sequence[str], task: str, limit: int | None
    ) -> dict[str, dict[str, float]]: ...


class AdapterExporter(Protocol):
    """Reads one finished adapter out of a pack and returns its write to ``directory``.

    The read happens at once, while the adapter is in the pack (on every rank of a
    tensor-parallel group); the returned write, which returns where the adapter is, runs later
    on another thread, after the pack dropped the adapter. The sweep's exporter writes PEFT's
    format (:mod:`plora_hpo.engine.export`).
    """

    def __call__(self, packed: Any, adapter_id: str, directory: Path) -> Callable[[], Path]: ...


def total_steps(budget: BudgetSpec, config: AdapterConfig, train_examples: int) -> int:
    """Optimizer steps of one trial: the budget's fixed steps, or epochs over its training set."""
    if budget.steps is not None:
        return budget.steps
    return max(1, math.ceil(budget.epochs * train_examples / config.batch_size))


def usable_memory_bytes(device: torch.device, total: float) -> float:
    """Bytes this process may plan with on ``device``: what it holds plus what nobody holds.

    On a GPU shared with other processes (co-located sweeps, another user's job) their memory is
    not this process's to fill: planning with the whole card would run every tenant out of memory.
    Read at each admission, so a neighbour that finishes frees room. The CPU host: ``total``.
    """
    if device.type != "cuda":
        return total
    free, _ = torch.cuda.mem_get_info(device)
    return min(total, free + torch.cuda.memory_reserved(device))


def device_spec(device: torch.device) -> GpuSpec:
    """The device as the planner's cost model sees it (the CPU host counts as one "GPU")."""
    from plora_hpo.planner import GpuSpec

    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        return GpuSpec(props.name, props.total_memory / 2**30)
    return GpuSpec.host()
