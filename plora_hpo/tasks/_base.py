"""What a task is: its lm-eval identity, its metrics, and where its local files live.

A task here is a thin description around an lm-eval task. Prompts, answer extraction and
metrics belong to lm-eval; plora_hpo only decides where the data comes from and turns the
training split into token sequences.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

Direction = Literal["maximize", "minimize"]
# Converts the task's local files into HF-style rows, one list of dicts per lm-eval split.
LocalReader = Callable[[Mapping[str, Path]], dict[str, list[dict[str, Any]]]]
# Writes (once, into the cache) the lm-eval YAML of a task plora_hpo defines itself.
ConfigMaker = Callable[[], Path]


@dataclass(frozen=True)
class TrainExample:
    """One tokenised training sequence: prompt tokens are labelled -100, completion tokens train.

    The engine pads these per adapter; ``labels`` has the same length as ``input_ids``.
    """

    input_ids: tuple[int, ...]
    labels: tuple[int, ...]

    def __post_init__(self) -> None:
        if len(self.input_ids) != len(self.labels):
            raise ValueError(f"input_ids ({len(self.input_ids)}) and labels ({len(self.labels)}) differ in length")

    @property
    def num_trained_tokens(self) -> int:
        return sum(label != -100 for label in self.labels)


@dataclass(frozen=True)
class TaskSpec:
    """A tunable task and how to score it.

    Attributes:
        name: plora_hpo's name (sweep files, CLI, MLflow).
        lm_eval_task: the task name lm-eval reports results under.
        description: one line for humans (listings, MLflow).
        primary_metric: the key of the Optuna objective in lm-eval's results, e.g. ``"acc,none"``.
        direction: whether Optuna maximises or minimises ``primary_metric``.
        metrics: every key worth logging, primary first.
        eval_split: the lm-eval split that is scored ("test" or "validation").
        builtin_config: lm-eval's own YAML for this task, relative to ``lm_eval/tasks``
            (None for tasks plora_hpo defines itself).
        local_files: lm-eval split → file name under ``<data_dir>/<name>/``.
        read_local: turns those files into rows with the columns lm-eval's task expects; None
            when lm-eval can read the files as they are (JSON lines in the right columns).
        make_config: for tasks without a ``builtin_config`` (the synthetic task, the sweep file's
            own tasks): returns the path of their lm-eval YAML, writing it into the cache if needed.
        source: where the data of a ``make_config`` task comes from, for logs and errors.
    """

    name: str
    lm_eval_task: str
    description: str
    primary_metric: str
    direction: Direction = "maximize"
    metrics: tuple[str, ...] = ()
    eval_split: str = "validation"
    builtin_config: str | None = None
    local_files: Mapping[str, str] = field(default_factory=dict)
    read_local: LocalReader | None = None
    make_config: ConfigMaker | None = None
    source: str = "generated locally"

    def local_paths(self, data_dir: Path) -> dict[str, Path]:
        """Where this task's original files are expected inside a data directory."""
        return {split: data_dir / self.name / filename for split, filename in self.local_files.items()}

    def expected_files(self) -> str:
        """Human-readable list of the files a data directory must hold, for error messages."""
        return ", ".join(f"{self.name}/{filename}" for filename in self.local_files.values())
