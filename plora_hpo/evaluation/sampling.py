"""Which evaluation documents a limited evaluation scores: a seeded, stratified random sample.

The first N documents of a dev set are not a sample of it (CoLA's first 300 are all in-domain
sentences). With ``evaluation.limit: N`` every adapter of a sweep is scored on the same N
documents, drawn at random with the sweep's seed; for tasks with a fixed set of answers the
draw keeps each answer's share of the dev set (largest-remainder quotas per class).
"""

from __future__ import annotations

import random
from collections import defaultdict
from typing import Any


def document_sample(task: Any, n: int, *, seed: int) -> list[int] | None:
    """Sorted indices of ``n`` of ``task``'s evaluation documents; None when ``n`` covers them all.

    ``task``: an lm-eval ``Task``. Stratified by the gold answer for ``multiple_choice`` tasks.
    """
    docs = list(task.eval_docs)
    if n >= len(docs):
        return None
    if getattr(task, "OUTPUT_TYPE", None) == "multiple_choice":
        labels = [str(task.doc_to_target(doc)) for doc in docs]
    else:
        labels = [""] * len(docs)
    groups: dict[str, list[int]] = defaultdict(list)
    for index, label in enumerate(labels):
        groups[label].append(index)
    ordered = sorted(groups)
    exact = {label: n * len(groups[label]) / len(docs) for label in ordered}
    quota = {label: int(exact[label]) for label in ordered}
    by_remainder = sorted(ordered, key=lambda label: (-(exact[label] - quota[label]), label))
    for label in by_remainder[: n - sum(quota.values())]:
        quota[label] += 1
    rng = random.Random(seed)
    chosen = [i for label in ordered for i in rng.sample(groups[label], quota[label])]
    return sorted(chosen)


def describe(task: Any, indices: list[int] | None, *, seed: int) -> str:
    """One line saying which documents were scored (for the trial's records)."""
    total = len(task.eval_docs)
    if indices is None:
        return f"all {total} documents"
    kind = "stratified random" if getattr(task, "OUTPUT_TYPE", None) == "multiple_choice" else "random"
    return f"{kind} {len(indices)} of {total} documents (seed {seed})"
