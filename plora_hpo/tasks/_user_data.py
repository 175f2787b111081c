"""The user's own prompt/completion files (JSON lines, CSV, Parquet) as an lm-eval task.

The files are read once and checked (a missing column, an empty file, a completion outside the
choice set each stop with one line naming it), then written into the cache as JSON lines next to
a generated lm-eval task YAML, the way the synthetic task is defined. Training and scoring then
go through lm-eval like every other task: ``doc_to_text`` is the prompt, the target the
completion, and the metric one of lm-eval's.
"""

from __future__ import annotations

import csv
import io
import json
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from plora_hpo.errors import ConfigError, DataError
from plora_hpo.tasks._cache import build_atomically, cache_root
from plora_hpo.tasks._sources import fingerprint, write_jsonl

if TYPE_CHECKING:
    from plora_hpo.config import CustomTask

SUFFIXES = (".jsonl", ".json", ".csv", ".parquet")

METRICS: dict[str, tuple[str, ...]] = {
    "multiple_choice": ("acc", "acc_norm", "f1", "mcc"),
    "generate_until": ("exact_match",),
    "loglikelihood": ("perplexity", "acc"),
}
"""lm-eval metrics each way of scoring the files produces (the first is the default)."""

REGEX_FILTER = "regex"
"""The name of the filter that extracts answers with the task's ``regex`` (metric ``exact_match,regex``)."""


def builder_for(paths: Sequence[Path]) -> str:
    """The ``datasets`` builder that reads these files (all of one format)."""
    kinds = {_kind(path) for path in paths}
    if len(kinds) != 1:
        raise DataError(f"data files {', '.join(map(str, paths))} mix formats; give files of one format")
    return kinds.pop()


def _kind(path: Path) -> str:
    suffix = path.suffix.lower()
    if suffix not in SUFFIXES:
        raise DataError(f"{path}: unsupported file type {suffix or '(none)'!r}; use {', '.join(SUFFIXES)}")
    return {".jsonl": "json", ".json": "json"}.get(suffix, suffix[1:])


def read_rows(path: Path) -> list[dict[str, Any]]:
    """The rows of a JSON-lines (or JSON list), CSV or Parquet file, as dicts."""
    if not path.is_file():
        raise DataError(f"{path}: no such data file")
    kind = _kind(path)
    try:
        if kind == "parquet":
            import pyarrow.parquet

            return pyarrow.parquet.read_table(path).to_pylist()
        text = path.read_text(encoding="utf-8-sig")
        if kind == "csv":
            return list(csv.DictReader(io.StringIO(text, newline="")))
        if text.lstrip().startswith("["):
            rows = json.loads(text)
        else:
            rows = [json.loads(line) for line in text.splitlines() if line.strip()]
    except (OSError, ValueError, UnicodeDecodeError) as err:  # JSONDecodeError, pyarrow's ArrowInvalid
        raise DataError(f"{path}: cannot read it ({type(err).__name__}: {str(err).splitlines()[0]})") from None
    if not all(isinstance(row, dict) for row in rows):
        raise DataError(f"{path}: expected one JSON object per line (or a list of objects)")
    return rows


def pairs(task: str, path: Path, definition: CustomTask) -> list[dict[str, str]]:
    """``{"prompt", "completion"}`` rows of one file; the error names a missing column or an empty file."""
    rows = read_rows(path)
    if not rows:
        raise DataError(
            f"task {task!r}: {path} has no rows; give at least one {definition.prompt_column}/"
            f"{definition.completion_column} row"
        )
    columns = (definition.prompt_column, definition.completion_column)
    for number, row in enumerate(rows, start=1):
        missing = [c for c in columns if row.get(c) is None]
        if missing:
            found = ", ".join(map(str, row)) or "none"
            raise DataError(
                f"task {task!r}: {path} row {number} has no column {missing[0]!r} (columns: {found}); "
                f"set prompt_column/completion_column to the file's column names"
            )
    out = [{"prompt": str(row[columns[0]]), "completion": str(row[columns[1]])} for row in rows]
    if definition.choices is not None:
        for number, row in enumerate(out, start=1):
            if row["completion"] not in definition.choices:
                raise DataError(
                    f"task {task!r}: {path} row {number}: completion {row['completion']!r} is not one of the "
                    f"choices {definition.choices}; list every answer the data uses under choices"
                )
            row["label"] = definition.choices.index(row["completion"])
    return out


def output_type(definition: CustomTask) -> str:
    """How the files are scored: multiple choice with a choice set, log-likelihood for perplexity,
    else generation."""
    if definition.choices is not None:
        return "multiple_choice"
    return "loglikelihood" if (definition.metric or "").split(",")[0] == "perplexity" else "generate_until"


def lm_eval_config(task: str, definition: CustomTask, data_files: dict[str, str]) -> dict[str, Any]:
    """The lm-eval task definition over the converted files (splits ``train`` and ``test``)."""
    kind = output_type(definition)
    metric = (definition.metric or METRICS[kind][0]).split(",")[0]
    if metric not in METRICS[kind]:
        how = {"multiple_choice": "with choices", "generate_until": "by generation", "loglikelihood": ""}[kind]
        raise ConfigError(
            f"task {task!r}: metric {definition.metric!r} is not produced by a task scored {how}; "
            f"choose from {', '.join(METRICS[kind])}"
        )
    config: dict[str, Any] = {
        "task": task,
        "dataset_path": "json",
        "dataset_kwargs": {"data_files": data_files},
        "output_type": kind,
        "training_split": "train",
        "test_split": "test",
        "doc_to_text": "{{prompt}}",
        "target_delimiter": definition.target_delimiter,
        "doc_to_target": "label" if kind == "multiple_choice" else "{{completion}}",
        "metric_list": [metric_entry(metric)],
        "num_fewshot": 0,
        "metadata": {"version": 1.0},
    }
    if kind == "multiple_choice":
        config["doc_to_choice"] = list(definition.choices or ())
    if kind == "generate_until":
        config["generation_kwargs"] = {"until": list(definition.until), "do_sample": False}
        if definition.regex is not None:
            steps = [{"function": "regex", "regex_pattern": definition.regex}, {"function": "take_first"}]
            config["filter_list"] = [{"name": REGEX_FILTER, "filter": steps}]
    return config


def metric_entry(metric: str) -> dict[str, Any]:
    """A ``metric_list`` entry with lm-eval's own default aggregation and direction for ``metric``
    (spelt out, so lm-eval does not warn that they were left to defaults)."""
    from lm_eval.api import registry

    aggregate = registry.get_metric_aggregation(metric)
    aggregation = next(name for name, function in registry.AGGREGATION_REGISTRY.items() if function is aggregate)
    return {"metric": metric, "aggregation": aggregation, "higher_is_better": registry.is_higher_better(metric)}


def make_config(task: str, definition: CustomTask) -> Path:
    """Convert the task's files and write its lm-eval YAML into the cache (once per content);
    returns the YAML's path."""
    assert definition.train is not None and definition.eval is not None
    files = {"train": Path(definition.train), "test": Path(definition.eval)}
    rows = {split: pairs(task, path, definition) for split, path in files.items()}
    config = lm_eval_config(task, definition, {})
    key = fingerprint(task, files.values(), extra=json.dumps([config, definition.model_dump(mode="json")]))
    target = cache_root() / "tasks" / task / key

    def write(tmp: Path) -> None:
        data_files = {}
        for split, split_rows in rows.items():
            write_jsonl(tmp / f"{split}.jsonl", split_rows)
            data_files[split] = str(target / f"{split}.jsonl")  # the final location, after the rename
        (tmp / "task.yaml").write_text(yaml.safe_dump(lm_eval_config(task, definition, data_files), sort_keys=False))

    return build_atomically(target, write) / "task.yaml"
