"""Where a task's data comes from: the Hugging Face Hub, or a data directory of original files.

lm-eval's built-in task YAMLs point at Hub datasets. For a data directory we keep lm-eval's
YAML untouched and write a small YAML next to the data in the cache that ``include``s it and
overrides only the dataset source (``dataset_path: json`` + ``dataset_kwargs.data_files``), so
prompts, filters and metrics stay lm-eval's. Files lm-eval cannot read as they are (GLUE TSV)
are converted once into JSON lines with the Hub dataset's column names.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from plora_hpo.errors import DataError
from plora_hpo.tasks._base import TaskSpec
from plora_hpo.tasks._cache import build_atomically, cache_root

DATA_DIR_ENV = "PLORA_HPO_DATA_DIR"
# Bump when the conversion or the override YAML changes, so old cache entries are not reused.
FORMAT_VERSION = "1"


@dataclass(frozen=True)
class TaskSource:
    """The lm-eval YAML to load for a task, and a phrase saying where its data comes from."""

    config_path: Path
    origin: str  # "hub", "data_dir", or "generated" (a YAML of plora_hpo's or the sweep file's own)
    description: str


def resolve_data_dir(data_dir: str | os.PathLike[str] | None) -> Path | None:
    """The data directory from the argument, else ``$PLORA_HPO_DATA_DIR``, else None (use the Hub)."""
    value = os.fspath(data_dir) if data_dir is not None else os.environ.get(DATA_DIR_ENV)
    return Path(value).expanduser().resolve() if value else None


def builtin_config_path(spec: TaskSpec) -> Path:
    """lm-eval's own YAML for ``spec`` in the installed lm-eval."""
    import lm_eval.tasks

    assert spec.builtin_config is not None
    path = Path(lm_eval.tasks.__file__).parent / spec.builtin_config
    if path.is_file():
        return path
    # A future lm-eval may move its files; its index still knows where the task lives.
    entry = lm_eval.tasks.TaskManager().task_index.get(spec.lm_eval_task)
    if entry is None or entry.yaml_path is None:
        raise DataError(
            f"task {spec.name!r}: the installed lm-eval has no built-in task {spec.lm_eval_task!r}; "
            "install lm-eval 0.4.x (pip install 'lm-eval>=0.4.8')"
        )
    return Path(entry.yaml_path)


def task_source(spec: TaskSpec, data_dir: str | os.PathLike[str] | None) -> TaskSource:
    """Pick the YAML lm-eval should load for ``spec`` given an optional data directory."""
    if spec.make_config is not None:
        return TaskSource(spec.make_config(), "generated", spec.source)
    builtin = builtin_config_path(spec)
    directory = resolve_data_dir(data_dir)
    if directory is None:
        return TaskSource(builtin, "hub", f"the Hugging Face Hub dataset {_hub_dataset(builtin)!r}")
    data_files = local_data_files(spec, directory)
    return TaskSource(override_config(spec.name, builtin, data_files), "data_dir", f"data directory {directory}")


def hub_unreachable_error(spec: TaskSpec, reason: str) -> DataError:
    """The one-line error for a task whose Hub dataset cannot be loaded and no data dir was given."""
    return DataError(
        f"task {spec.name!r}: cannot load its data from the Hugging Face Hub ({reason}) and no data "
        f"directory was given; pass --data-dir DIR (or set {DATA_DIR_ENV}) where DIR holds "
        f"{spec.expected_files()}"
    )


def check_local_files(spec: TaskSpec, data_dir: Path) -> dict[str, Path]:
    """The task's files in ``data_dir``; the error names the first one that is missing."""
    paths = spec.local_paths(data_dir)
    for path in paths.values():
        if not path.is_file():
            raise DataError(
                f"task {spec.name!r}: missing data file {path}; the data directory must hold "
                f"{spec.expected_files()} (the files as originally published)"
            )
    return paths


def local_data_files(spec: TaskSpec, data_dir: Path) -> dict[str, Path]:
    """lm-eval split → JSON-lines file, converting the task's originals into the cache if needed."""
    paths = check_local_files(spec, data_dir)
    if spec.read_local is None:
        return paths
    target = cache_root() / "data" / spec.name / fingerprint(spec.name, paths.values())
    reader = spec.read_local

    def convert(tmp: Path) -> None:
        for split, rows in reader(paths).items():
            write_jsonl(tmp / f"{split}.jsonl", rows)

    build_atomically(target, convert)
    return {split: target / f"{split}.jsonl" for split in paths}


def write_jsonl(path: Path, rows: Iterable[Mapping[str, Any]]) -> None:
    """One JSON object per line, UTF-8, as the ``json`` dataset builder reads it."""
    with path.open("w", encoding="utf-8") as handle:
        for row in rows:
            handle.write(json.dumps(row, ensure_ascii=False) + "\n")


def override_config(name: str, included: Path, data_files: Mapping[str, Path], builder: str = "json") -> Path:
    """A YAML that includes an lm-eval task YAML and replaces only its dataset source.

    ``builder`` is the ``datasets`` builder that reads the files (``json``, ``csv``, ``parquet``).
    """
    override = {
        "include": str(included),
        "dataset_path": builder,
        "dataset_name": None,
        "dataset_kwargs": {"data_files": {split: str(path) for split, path in data_files.items()}},
    }
    key = fingerprint(name, data_files.values(), extra=json.dumps(override, sort_keys=True))
    target = cache_root() / "tasks" / name / key

    def write(tmp: Path) -> None:
        (tmp / "task.yaml").write_text(yaml.safe_dump(override, sort_keys=False))

    return build_atomically(target, write) / "task.yaml"


def fingerprint(name: str, files: Iterable[Path], extra: str = "") -> str:
    """Content hash of a task's inputs: a changed file never reuses a stale cache entry."""
    digest = hashlib.sha256(f"{name}\0{FORMAT_VERSION}\0{extra}".encode())
    for path in files:
        digest.update(str(path).encode() + b"\0")
        digest.update(hashlib.sha256(path.read_bytes()).digest())
    return digest.hexdigest()[:16]


def _hub_dataset(config_path: Path) -> str:
    try:
        return str(yaml.safe_load(config_path.read_text()).get("dataset_path", "?"))
    except (yaml.YAMLError, OSError, AttributeError):
        return "?"
