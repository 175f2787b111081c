"""Evaluate many adapters of one packed model in shared batches (S-LoRA-style), through lm-eval.

- :func:`evaluate_adapters` / :func:`evaluate_adapters_report`: lm-eval tasks → metrics per adapter.
- :class:`MultiAdapterServer` / :class:`AdapterView`: the lm-eval models behind them.
- :func:`score_continuations` and :func:`generate_greedy`: the batched model-level paths
  (log-likelihoods; greedy decoding with continuous batching), usable without lm-eval.
- :class:`AdapterResidency`: adapter paging between host memory and the device.

Exports load lazily: the model-level paths need only torch + transformers (the GPU image has
no lm-eval), while the lm-eval models import lm-eval on first use.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "evaluate_adapters": "plora_hpo.evaluation.runner",
    "evaluate_adapters_report": "plora_hpo.evaluation.runner",
    "EvaluationReport": "plora_hpo.evaluation.runner",
    "MultiAdapterServer": "plora_hpo.evaluation.lm",
    "AdapterView": "plora_hpo.evaluation.lm",
    "ServerStats": "plora_hpo.evaluation.lm",
    "ScoreRequest": "plora_hpo.evaluation.scoring",
    "ScoringStats": "plora_hpo.evaluation.scoring",
    "score_continuations": "plora_hpo.evaluation.scoring",
    "GenerationJob": "plora_hpo.evaluation.generation",
    "GenerationStats": "plora_hpo.evaluation.generation",
    "StopWindows": "plora_hpo.evaluation.generation",
    "generate_greedy": "plora_hpo.evaluation.generation",
    "AdapterResidency": "plora_hpo.evaluation.residency",
    "PagingStats": "plora_hpo.evaluation.residency",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'plora_hpo.evaluation' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
