"""MRPC (GLUE): do two sentences mean the same thing? Scored by lm-eval's built-in ``mrpc``.

Multiple choice between `` no`` and `` yes`` (label 0/1), ``acc`` and ``f1`` on validation.

Example item (train split, as lm-eval renders it; the completion `` yes`` is trained):

    Sentence 1: Amrozi accused his brother , whom he called " the witness " , of deliberately [...]
    Sentence 2: Referring to him as only " the witness " , Amrozi accused his brother of [...]
    Question: Do both sentences mean the same thing?
    Answer: yes

Local files: GLUE's ``<data_dir>/mrpc/{train,dev}.tsv`` (UTF-8 BOM, header
``Quality  #1 ID  #2 ID  #1 String  #2 String``, literal ``"`` in sentences). They become the
Hub dataset's columns ``sentence1, sentence2, label, idx``; ``dev`` is lm-eval's ``validation``.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from plora_hpo.tasks._base import TaskSpec
from plora_hpo.tasks._tsv import read_tsv

HEADER = ("Quality", "#1 ID", "#2 ID", "#1 String", "#2 String")


def read_local(paths: Mapping[str, Path]) -> dict[str, list[dict[str, Any]]]:
    """GLUE MRPC TSV files → rows with the Hub ``nyu-mll/glue`` (mrpc) columns."""
    return {
        split: [
            {"sentence1": row[3], "sentence2": row[4], "label": int(row[0]), "idx": idx}
            for idx, row in enumerate(read_tsv(path, columns=len(HEADER), header=HEADER))
        ]
        for split, path in paths.items()
    }


TASK = TaskSpec(
    name="mrpc",
    lm_eval_task="mrpc",
    description="MRPC paraphrase detection (lm-eval glue mrpc, acc and f1 on validation)",
    primary_metric="acc,none",
    metrics=("acc,none", "f1,none"),
    eval_split="validation",
    builtin_config="glue/mrpc/default.yaml",
    local_files={"train": "train.tsv", "validation": "dev.tsv"},
    read_local=read_local,
)
