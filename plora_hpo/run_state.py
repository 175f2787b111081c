"""What a run directory remembers about its sweep, so a rerun can resume it safely.

``<run_dir>/sweep.json`` holds the sweep settings that shape results and the MLflow parent
run. A rerun (or ``--resume``) with settings that would change finished trials' meaning is
refused; settings that only change speed or how many trials to run may differ.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from plora_hpo.config import SweepConfig
from plora_hpo.errors import ConfigError

STATE_FILE = "sweep.json"
# free to change between runs of one sweep: they decide speed and extent, not what a trial means
_MAY_CHANGE = {
    "n_trials",
    "pack",
    "evaluation.batch_size",
    "train.checkpoint_every",
    "train.checkpoint_overhead",
    "pruning",
}


@dataclass
class RunState:
    settings: dict[str, Any]
    mlflow_parent_run_id: str | None = None

    @classmethod
    def of(cls, config: SweepConfig) -> RunState:
        return cls(settings=config.model_dump(mode="json"))

    def save(self, run_dir: Path) -> None:
        path = run_dir / STATE_FILE
        partial = path.with_name(f".{path.name}.partial")
        partial.write_text(
            json.dumps({"settings": self.settings, "mlflow_parent_run_id": self.mlflow_parent_run_id}, indent=2)
        )
        os.replace(partial, path)


def load_run_state(run_dir: Path) -> RunState | None:
    path = run_dir / STATE_FILE
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
        return RunState(settings=data["settings"], mlflow_parent_run_id=data.get("mlflow_parent_run_id"))
    except (ValueError, KeyError, TypeError) as err:
        raise ConfigError(f"{path} is unreadable ({err}); restore it or use a new --run-dir") from None


def check_resumable(run_dir: Path, config: SweepConfig, *, resume: bool) -> RunState | None:
    """The run directory's state if ``config`` may continue it; None for a fresh run directory.

    Raises a one-line error for ``--resume`` with nothing to resume, and for a rerun whose
    settings differ from the ones the run directory was started with.
    """
    saved = load_run_state(run_dir)
    if saved is None:
        if resume:
            raise ConfigError(f"--resume: nothing to resume in {run_dir} (no {STATE_FILE}); drop --resume to start it")
        return None
    now = RunState.of(config).settings
    for key, (before, after) in differences(saved.settings, now).items():
        if not any(key == k or key.startswith(f"{k}.") for k in _MAY_CHANGE):
            raise ConfigError(
                f"incompatible resume: {key} was {before!r} in {run_dir}, now {after!r}; "
                "rerun with the original settings or use a new --run-dir"
            )
    return saved


def differences(before: Any, after: Any, prefix: str = "") -> dict[str, tuple[Any, Any]]:
    if isinstance(before, dict) and isinstance(after, dict):
        out: dict[str, tuple[Any, Any]] = {}
        for key in sorted(set(before) | set(after)):
            out.update(differences(before.get(key), after.get(key), f"{prefix}{key}."))
        return out
    return {} if before == after else {prefix.rstrip("."): (before, after)}
