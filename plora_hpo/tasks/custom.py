"""Tasks a sweep file defines itself: an lm-eval task by name or YAML, or the user's data files.

Each becomes a :class:`TaskSpec` like the built-in tasks: one lm-eval task YAML (the user's own;
lm-eval's registered one; a YAML that ``include``s either and points its dataset at local
files; or one generated over prompt/completion files) whose training split trains the adapters
and whose metric scores them. Resolving a definition loads its lm-eval task once, so an unknown
name, a YAML lm-eval rejects, data it cannot read, an empty split or a metric the task does not
produce stops the sweep with one line before anything is written.
"""

from __future__ import annotations

import difflib
import functools
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

from plora_hpo.errors import ConfigError, DataError, first_line
from plora_hpo.tasks import _user_data
from plora_hpo.tasks._base import Direction, TaskSpec
from plora_hpo.tasks._sources import override_config

if TYPE_CHECKING:
    from lm_eval.api.task import Task
    from lm_eval.tasks import TaskManager

    from plora_hpo.config import CustomTask

LOCAL_BUILDERS = ("json", "csv", "parquet", "text", "arrow")
"""``dataset_path`` values that read local files; any other names a Hugging Face Hub dataset."""

log = logging.getLogger(__name__)


def custom_task_spec(name: str, definition: CustomTask) -> TaskSpec:
    """The :class:`TaskSpec` of the sweep file's task ``name``; loads its lm-eval task to check it.

    Raises :class:`~plora_hpo.errors.ConfigError` or :class:`~plora_hpo.errors.DataError` with one
    line naming the problem (see the module docstring).
    """
    config_path, source, hub_dataset = _config_of(name, definition)
    task = load_custom_task(name, config_path, source, hub_dataset)
    metric, higher_is_better = _objective(name, task, definition.metric)
    direction: Direction = definition.direction or ("maximize" if higher_is_better else "minimize")
    _check_splits(name, task)
    eval_split = task.config.test_split if task.has_test_docs() else task.config.validation_split
    return TaskSpec(
        name=name,
        lm_eval_task=task.config.task,
        description=f"{name}: lm-eval task {task.config.task} ({task.config.output_type}), {metric} on {eval_split}",
        primary_metric=metric,
        direction=direction,
        metrics=(metric,),
        eval_split=str(eval_split),
        make_config=lambda: config_path,
        source=source,
    )


def _config_of(name: str, definition: CustomTask) -> tuple[Path, str, str | None]:
    """The YAML lm-eval loads for ``definition``, where its data comes from, and the Hub dataset
    it reads (None when its data is local)."""
    if definition.kind == "files":
        return _user_data.make_config(name, definition), f"files {definition.train} and {definition.eval}", None
    if definition.kind == "yaml":
        assert definition.yaml is not None
        path = Path(definition.yaml)
        if not path.is_file():
            raise ConfigError(f"task {name!r}: no lm-eval task YAML at {path}; fix custom_tasks.{name}.yaml")
        included, what, raw = path, f"task YAML {path}", _read_yaml(path)
    else:
        assert definition.lm_eval is not None
        included, raw = registered_yaml(name, definition.lm_eval)
        what = f"lm-eval's task {definition.lm_eval!r}"
    if definition.data_files is None:
        dataset = str(raw.get("dataset_path", ""))
        return included, what, None if dataset in LOCAL_BUILDERS or not dataset else dataset
    files = {split: Path(path) for split, path in definition.data_files.items()}
    for path in files.values():
        if not path.is_file():
            raise DataError(f"task {name!r}: no such data file {path}; fix custom_tasks.{name}.data_files")
    builder = _user_data.builder_for(list(files.values()))
    return override_config(name, included, files, builder), f"{what} over {', '.join(map(str, files.values()))}", None


def _read_yaml(path: Path) -> dict[str, Any]:
    """The top-level keys of a task YAML (lm-eval's own tags such as ``!function`` are kept as text)."""
    import yaml

    class _Lenient(yaml.SafeLoader):
        pass

    _Lenient.add_multi_constructor("!", lambda loader, suffix, node: suffix)
    try:
        data = yaml.load(path.read_text(), Loader=_Lenient)
    except (OSError, yaml.YAMLError) as err:
        raise ConfigError(f"task YAML {path}: {first_line(err)}; fix the file") from None
    return data if isinstance(data, dict) else {}


@functools.cache
def task_manager() -> TaskManager:
    """lm-eval's index of its registered tasks (built once per process: it scans ~15k YAML files)."""
    from lm_eval.tasks import TaskManager

    return TaskManager()


def registered_yaml(name: str, lm_eval_name: str) -> tuple[Path, dict[str, Any]]:
    """The YAML and raw config of the task lm-eval registers as ``lm_eval_name``; the error lists close names."""
    from lm_eval.tasks._index import Kind

    index = task_manager().task_index
    entry = index.get(lm_eval_name)
    if entry is None:
        close = difflib.get_close_matches(lm_eval_name, list(index), n=5, cutoff=0.6)
        hint = f"close names: {', '.join(close)}" if close else "see `lm-eval ls tasks` for the names it knows"
        raise ConfigError(f"task {name!r}: lm-eval has no task {lm_eval_name!r}; {hint}")
    if entry.kind != Kind.TASK or entry.yaml_path is None:
        raise ConfigError(
            f"task {name!r}: {lm_eval_name!r} is an lm-eval {entry.kind.name.lower()} of several tasks, not one "
            "task; name one of its tasks under lm_eval"
        )
    return Path(entry.yaml_path), dict(entry.cfg or {})


def load_custom_task(name: str, config_path: Path, source: str, hub_dataset: str | None) -> Task:
    """The one lm-eval task ``config_path`` defines; its data loaded."""
    from lm_eval.tasks import TaskManager

    manager = TaskManager(include_defaults=False)
    try:
        loaded = manager.load(str(config_path))
    except Exception as err:  # lm-eval and datasets raise many types: the first line says which problem
        if hub_dataset is not None:
            raise DataError(
                f"task {name!r}: {source} reads the Hugging Face Hub dataset {hub_dataset!r}, which cannot be "
                f"loaded here ({type(err).__name__}: {first_line(err)}); give data_files with local copies "
                "of its splits"
            ) from None
        raise DataError(f"task {name!r}: lm-eval rejected {source}: {type(err).__name__}: {first_line(err)}") from None
    tasks = loaded.get("tasks", {})
    if len(tasks) != 1:
        defined = ", ".join(sorted(tasks)) or "none"
        raise DataError(f"task {name!r}: {source} defines {len(tasks)} lm-eval tasks ({defined}); give a YAML of one")
    log.info("task %s: data from %s", name, source)
    return next(iter(tasks.values()))


def _objective(name: str, task: Task, wanted: str | None) -> tuple[str, bool]:
    """The lm-eval results key to optimise (``"acc,none"``) and whether higher is better.

    ``wanted`` is ``metric`` or ``metric,filter``; without a filter the task's first one is used;
    without a metric, the task's first metric.
    """
    better = task.higher_is_better()
    filters = [f.get("name", "none") for f in task.config.filter_list or ()] or ["none"]
    produced = [f"{m},{f}" for f in filters for m in better]
    if wanted is None:
        key = f"{next(iter(better))},{filters[0]}"
    else:
        metric, _, filt = wanted.partition(",")
        key = f"{metric},{filt or filters[0]}"
    if key not in produced:
        raise ConfigError(
            f"task {name!r}: metric {wanted!r} is not one lm-eval's task {task.config.task!r} produces; "
            f"choose from {', '.join(produced)}"
        )
    return key, bool(better[key.split(",")[0]])


def _check_splits(name: str, task: Task) -> None:
    """A training split to train on and an evaluation split to score, neither empty."""
    if not task.has_training_docs():
        raise DataError(
            f"task {name!r}: lm-eval task {task.config.task!r} has no training split; give data_files with a "
            f"'train' file and training_split in the YAML"
        )
    if not len(task.training_docs()):
        raise DataError(f"task {name!r}: the training split {task.config.training_split!r} is empty")
    if not (task.has_test_docs() or task.has_validation_docs()):
        raise DataError(f"task {name!r}: lm-eval task {task.config.task!r} has no test or validation split to score")
    if not len(task.eval_docs):
        raise DataError(f"task {name!r}: the split it is scored on is empty")
