"""Standard errors and answer balance from per-document results; the best-vs-default verdict."""

from __future__ import annotations

import numpy as np
import optuna
import pytest
from sklearn.metrics import f1_score, matthews_corrcoef

from plora_hpo.evaluation.uncertainty import (
    BOOTSTRAP_RESAMPLES,
    _binary_f1,
    _binary_mcc,
    collapsed,
    document_statistics,
)
from plora_hpo.report import gap_line


def _docs(gold, pred, metrics=("mcc", "f1", "acc")):
    out = []
    for g, p in zip(gold, pred):
        doc = {"filter": "none", "metrics": list(metrics), "filtered_resps": [(-1.0 - p, False), (-2.0 + p, False)]}
        for m in metrics:
            doc[m] = float(g == p) if m == "acc" else (int(g), int(p))
        out.append(doc)
    return out


def test_vectorised_f1_and_mcc_equal_scikit_learn_on_every_resample():
    rng = np.random.default_rng(3)
    gold = rng.integers(0, 2, size=(50, 40))
    pred = np.where(rng.random((50, 40)) < 0.7, gold, 1 - gold)
    pred[0] = 1  # one row answers a single class: MCC is undefined there, scikit-learn says 0
    f1 = [f1_score(g, p, zero_division=0) for g, p in zip(gold, pred)]
    mcc = [matthews_corrcoef(g, p) for g, p in zip(gold, pred)]
    np.testing.assert_allclose(_binary_f1(gold, pred), f1, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(_binary_mcc(gold, pred), mcc, rtol=1e-12, atol=1e-12)


def test_stderrs_are_the_bootstrap_of_the_aggregate_and_the_sample_stderr_of_means():
    rng = np.random.default_rng(0)
    gold = rng.integers(0, 2, 300)
    pred = np.where(rng.random(300) < 0.8, gold, 1 - gold)
    stats = document_statistics(_docs(gold, pred), ["no", "yes"], seed=7)
    idx = np.random.default_rng(7).integers(0, 300, size=(BOOTSTRAP_RESAMPLES, 300))
    expected_mcc = np.std([matthews_corrcoef(gold[i], pred[i]) for i in idx], ddof=1)
    assert stats["mcc_stderr,none"] == pytest.approx(expected_mcc, rel=1e-9)
    correct = (gold == pred).astype(float)
    assert stats["acc_stderr,none"] == pytest.approx(correct.std(ddof=1) / np.sqrt(300), rel=1e-12)
    assert stats["pred_share_yes,none"] == pytest.approx(pred.mean())
    assert stats["pred_share_no,none"] == pytest.approx(1 - pred.mean())
    # fewer documents, more noise
    few = document_statistics(_docs(gold[:30], pred[:30]), ["no", "yes"], seed=7)
    assert few["acc_stderr,none"] > stats["acc_stderr,none"]


def test_a_classifier_answering_one_class_is_flagged_and_a_balanced_one_is_not():
    gold = np.array([0, 1] * 150)
    stuck = document_statistics(_docs(gold, np.array([1] * 299 + [0])), ["no", "yes"])
    assert collapsed(stuck) and stuck["pred_share_yes,none"] == pytest.approx(299 / 300)
    assert not collapsed(document_statistics(_docs(gold, gold), ["no", "yes"]))


def _trial(value, stderr, **params):
    params = {"rank": 16, "alpha_multiplier": 1.0, "learning_rate": 2e-4, "batch_size": 2, **params}
    dists = {k: optuna.distributions.CategoricalDistribution([v]) for k, v in params.items()}
    metrics = {"mcc,none": value, "mcc_stderr,none": stderr}
    return optuna.trial.create_trial(value=value, params=params, distributions=dists, user_attrs={"metrics": metrics})


def test_the_best_versus_default_verdict_follows_the_standard_errors():
    default = _trial(0.00, 0.01)
    assert "larger than the noise" in gap_line(_trial(0.08, 0.01, rank=64), default, "mcc,none")
    # the same lead, measured on few documents: within the noise
    assert "within the noise" in gap_line(_trial(0.08, 0.06, rank=64), _trial(0.0, 0.06), "mcc,none")
    assert "no standard errors" in gap_line(_trial(0.08, float("nan"), rank=64), default, "mcc,none")
