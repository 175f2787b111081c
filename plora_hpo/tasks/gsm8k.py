"""GSM8K: grade-school math word problems, scored by lm-eval's built-in ``gsm8k`` task.

lm-eval asks 5-shot by default and generates until ``Question:``; ``exact_match`` is reported
under two filters: ``strict-match`` (the ``#### N`` answer line) and ``flexible-extract`` (the
last number in the output). Training uses the zero-shot prompt and the full reference solution.

Example item (train split, as lm-eval renders it; the completion is trained):

    Question: Natalia sold clips to 48 of her friends in April, and then she sold half as many
    clips in May. How many clips did Natalia sell altogether in April and May?
    Answer: Natalia sold 48/2 = <<48/2=24>>24 clips in May.
    Natalia sold 48+24 = <<48+24=72>>72 clips altogether in April and May.
    #### 72

Local files: ``<data_dir>/gsm8k/{train,test}.jsonl`` with ``{"question", "answer"}`` per line,
the columns of the Hub dataset, so lm-eval reads them as they are.
"""

from __future__ import annotations

from plora_hpo.tasks._base import TaskSpec

TASK = TaskSpec(
    name="gsm8k",
    lm_eval_task="gsm8k",
    description="GSM8K grade-school math (lm-eval gsm8k, 5-shot, exact match on test)",
    primary_metric="exact_match,flexible-extract",
    metrics=("exact_match,flexible-extract", "exact_match,strict-match"),
    eval_split="test",
    builtin_config="gsm8k/gsm8k.yaml",
    local_files={"train": "train.jsonl", "test": "test.jsonl"},
)
