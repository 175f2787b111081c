"""How much an adapter's score would move on other documents, and what its predictions look like.

From lm-eval's per-document results (``log_samples``) of one task:

- the standard error of each metric: for per-document values (accuracy, exact match) the
  sample standard error; for metrics lm-eval aggregates over the whole set from (gold,
  prediction) pairs (F1, MCC) a seeded bootstrap over documents, computed on confusion counts
  so that it costs milliseconds instead of lm-eval's own minute-long bootstrap;
- for multiple-choice tasks, the share of each answer among the adapter's predictions, so a
  classifier that answers one class for every document shows as such.

The keys follow lm-eval's: ``"mcc_stderr,none"`` next to ``"mcc,none"``, and
``"pred_share_<choice>,none"`` per answer choice.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

BOOTSTRAP_RESAMPLES = 1000
COLLAPSED_SHARE = 0.95
"""A classifier whose most frequent answer takes at least this share of the documents is flagged."""


def stderr_key(metric_key: str) -> str:
    """``"mcc,none"`` → ``"mcc_stderr,none"`` (lm-eval's naming)."""
    name, _, filt = metric_key.partition(",")
    return f"{name}_stderr,{filt}" if filt else f"{name}_stderr"


def share_keys(metrics: Mapping[str, float]) -> dict[str, float]:
    """The ``pred_share_<choice>`` entries of a metrics dict, keyed by choice."""
    out = {}
    for key, value in metrics.items():
        name = key.partition(",")[0]
        if name.startswith("pred_share_"):
            out[name.removeprefix("pred_share_")] = value
    return out


def collapsed(metrics: Mapping[str, float]) -> bool:
    """Whether one answer takes at least :data:`COLLAPSED_SHARE` of the predictions."""
    shares = share_keys(metrics)
    return bool(shares) and max(shares.values()) >= COLLAPSED_SHARE


def document_statistics(
    samples: Sequence[Mapping[str, Any]], choices: Sequence[str] | None, *, seed: int = 0
) -> dict[str, float]:
    """Standard errors of every metric in ``samples`` and, with ``choices``, prediction shares."""
    if not samples:
        return {}
    filt = samples[0].get("filter", "none")
    out: dict[str, float] = {}
    for metric in samples[0].get("metrics", []):
        values = [s[metric] for s in samples if metric in s]
        if len(values) < 2:
            continue
        stderr = _stderr(metric, values, seed)
        if stderr is not None:
            out[f"{metric}_stderr,{filt}"] = stderr
    if choices:
        predictions = [_predicted_choice(s) for s in samples]
        known = [p for p in predictions if p is not None]
        for index, choice in enumerate(choices):
            out[f"pred_share_{choice},{filt}"] = sum(p == index for p in known) / len(known) if known else math.nan
    return out


def _predicted_choice(sample: Mapping[str, Any]) -> int | None:
    """The answer a multiple-choice document was given: the choice with the highest loglikelihood."""
    responses = sample.get("filtered_resps")
    try:
        scores = [float(r[0]) if isinstance(r, (tuple, list)) else float(r) for r in responses]
    except (TypeError, ValueError):
        return None
    return int(np.argmax(scores)) if scores else None


def _stderr(metric: str, values: list[Any], seed: int) -> float | None:
    if isinstance(values[0], (tuple, list)):
        gold = np.array([int(v[0]) for v in values])
        pred = np.array([int(v[1]) for v in values])
        if metric not in _PAIR_METRICS or not set(np.unique(gold)) | set(np.unique(pred)) <= {0, 1}:
            return None
        rng = np.random.default_rng(seed)
        idx = rng.integers(0, len(gold), size=(BOOTSTRAP_RESAMPLES, len(gold)))
        resampled = _PAIR_METRICS[metric](gold[idx], pred[idx])
        return float(np.std(resampled, ddof=1))
    x = np.asarray(values, dtype=float)
    return float(np.std(x, ddof=1) / math.sqrt(len(x)))


def _counts(gold: np.ndarray, pred: np.ndarray) -> tuple[np.ndarray, ...]:
    tp = ((gold == 1) & (pred == 1)).sum(-1).astype(float)
    tn = ((gold == 0) & (pred == 0)).sum(-1).astype(float)
    fp = ((gold == 0) & (pred == 1)).sum(-1).astype(float)
    fn = ((gold == 1) & (pred == 0)).sum(-1).astype(float)
    return tp, tn, fp, fn


def _binary_f1(gold: np.ndarray, pred: np.ndarray) -> np.ndarray:
    """scikit-learn's ``f1_score`` (positive label 1; 0 where it is undefined), per row."""
    tp, _, fp, fn = _counts(gold, pred)
    denominator = 2 * tp + fp + fn
    return np.divide(2 * tp, denominator, out=np.zeros_like(tp), where=denominator > 0)


def _binary_mcc(gold: np.ndarray, pred: np.ndarray) -> np.ndarray:
    """scikit-learn's ``matthews_corrcoef`` (0 where it is undefined), per row."""
    tp, tn, fp, fn = _counts(gold, pred)
    denominator = np.sqrt((tp + fp) * (tp + fn) * (tn + fp) * (tn + fn))
    return np.divide(tp * tn - fp * fn, denominator, out=np.zeros_like(tp), where=denominator > 0)


_PAIR_METRICS = {"f1": _binary_f1, "mcc": _binary_mcc}
