"""CoLA (GLUE): is a sentence grammatically acceptable? Scored by lm-eval's built-in ``cola``.

Multiple choice between `` no`` and `` yes`` (label 0/1), Matthews correlation on validation.

Example item (train split, as lm-eval renders it; the completion `` yes`` is trained):

    Our friends won't buy this analysis, let alone the next one we propose.
    Question: Does this sentence make sense?
    Answer: yes

Local files: GLUE's ``<data_dir>/cola/{train,dev}.tsv``: no header, columns source, label,
author's mark, sentence; literal ``"`` in sentences; ``dev.tsv`` has no final newline. They
become the Hub dataset's columns ``sentence, label, idx``; ``dev`` is lm-eval's ``validation``.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from plora_hpo.tasks._base import TaskSpec
from plora_hpo.tasks._tsv import read_tsv


def read_local(paths: Mapping[str, Path]) -> dict[str, list[dict[str, Any]]]:
    """GLUE CoLA TSV files → rows with the Hub ``nyu-mll/glue`` (cola) columns."""
    return {
        split: [
            {"sentence": row[3], "label": int(row[1]), "idx": idx} for idx, row in enumerate(read_tsv(path, columns=4))
        ]
        for split, path in paths.items()
    }


TASK = TaskSpec(
    name="cola",
    lm_eval_task="cola",
    description="CoLA grammatical acceptability (lm-eval glue cola, Matthews corr. on validation)",
    primary_metric="mcc,none",
    metrics=("mcc,none",),
    eval_split="validation",
    builtin_config="glue/cola/default.yaml",
    local_files={"train": "train.tsv", "validation": "dev.tsv"},
    read_local=read_local,
)
