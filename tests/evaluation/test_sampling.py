"""evaluation.limit scores a seeded, stratified random sample of the dev set, not its first rows."""

from __future__ import annotations

from collections import Counter

from plora_hpo.evaluation.runner import lm_eval_tasks
from plora_hpo.evaluation.sampling import describe, document_sample
from plora_hpo.tasks import build_eval_tasks


def test_limit_sample_is_stratified_reproducible_and_not_the_first_rows(data_dir):
    [task] = list(lm_eval_tasks(build_eval_tasks("cola", data_dir=str(data_dir))))
    docs = list(task.eval_docs)
    labels = [task.doc_to_target(d) for d in docs]
    sample = document_sample(task, 300, seed=0)
    assert sample == document_sample(task, 300, seed=0)  # the same documents for every adapter
    assert sample != document_sample(task, 300, seed=1)
    assert len(sample) == len(set(sample)) == 300 and sample != list(range(300))
    whole, drawn = Counter(labels), Counter(labels[i] for i in sample)
    for label, count in whole.items():  # each answer keeps its share of the dev set (to one document)
        assert abs(drawn[label] - 300 * count / len(docs)) < 1
    assert document_sample(task, len(docs), seed=0) is None
    assert describe(task, sample, seed=0) == f"stratified random 300 of {len(docs)} documents (seed 0)"
