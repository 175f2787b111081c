"""plora_hpo: LoRA hyperparameter search with many trials packed onto one frozen base model.

The public API is imported lazily so that ``plora_hpo.engine`` and ``plora_hpo.kernels`` stay
importable on machines with only torch, transformers and triton (no optuna/mlflow/lm-eval).

Example:
    >>> from plora_hpo import SweepRun, load_sweep  # doctest: +SKIP
    >>> with SweepRun(load_sweep("search_spaces/demo.yaml"), run_dir="plora_runs") as run:  # doctest: +SKIP
    ...     run.optimize()  # doctest: +SKIP
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "AdapterConfig": "plora_hpo.adapter",
    "SweepConfig": "plora_hpo.config",
    "load_sweep": "plora_hpo.config",
    "SearchSpace": "plora_hpo.space",
    "PackedSweep": "plora_hpo.sweep",
    "SweepRun": "plora_hpo.run",
    "TrialRequest": "plora_hpo.trials",
    "TrialOutcome": "plora_hpo.trials",
    "PackedObjective": "plora_hpo.study",
    "create_study": "plora_hpo.study",
    "optimize_in_packs": "plora_hpo.study",
    "serve": "plora_hpo.study",
    "SweepWorker": "plora_hpo.cluster",
    "AdmissionPolicy": "plora_hpo.admission",
    "PlannerAdmission": "plora_hpo.admission",
    "FifoAdmission": "plora_hpo.admission",
    "ask_batch": "plora_hpo.study",
    "SweepTracker": "plora_hpo.tracking",
    "PloraError": "plora_hpo.errors",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'plora_hpo' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
