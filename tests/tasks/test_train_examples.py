"""Training examples use lm-eval's own prompts and targets, masked and tokenised as lm-eval scores them."""

from __future__ import annotations

import json

import pytest

from plora_hpo.tasks import build_eval_tasks, get_task, load_train_examples
from plora_hpo.tasks._encode import IGNORE_INDEX


def _split(example):
    n = sum(label == IGNORE_INDEX for label in example.labels)
    assert all(label == IGNORE_INDEX for label in example.labels[:n])
    assert example.labels[n:] == example.input_ids[n:]
    return list(example.input_ids[:n]), list(example.input_ids[n:])


@pytest.mark.parametrize(("name", "size"), [("mrpc", 3668), ("cola", 8551)])
def test_glue_examples_match_lm_eval_prompts(name, size, data_dir, tokenizer):
    examples = load_train_examples(name, tokenizer, seq_len=512, data_dir=data_dir)
    assert len(examples) == size
    task = build_eval_tasks(name, data_dir=data_dir)["tasks"][get_task(name).lm_eval_task]
    docs = task.training_docs()
    for i in (0, 1, 777, size - 1):
        prompt_ids, completion_ids = _split(examples[i])
        doc = docs[i]
        assert task.fewshot_context(doc, 0) == task.doc_to_text(doc)  # what lm-eval asks at 0-shot
        assert prompt_ids == tokenizer(task.doc_to_text(doc))["input_ids"]
        gold = [" no", " yes"][doc["label"]]
        assert completion_ids == tokenizer(gold)["input_ids"] + [tokenizer.eos_token_id]


def test_gsm8k_examples_match_lm_eval_prompts(data_dir, tokenizer):
    examples = load_train_examples("gsm8k", tokenizer, seq_len=1024, data_dir=data_dir, max_examples=40, seed=0)
    assert len(examples) == 40
    rows = [json.loads(line) for line in (data_dir / "gsm8k" / "train.jsonl").read_text().splitlines()]
    answers = {row["question"]: row["answer"] for row in rows}
    for example in examples:
        prompt_ids, completion_ids = _split(example)
        prompt = tokenizer.decode(prompt_ids, clean_up_tokenization_spaces=False)
        assert prompt.startswith("Question: ") and prompt.endswith("\nAnswer:")
        question = prompt[len("Question: ") : -len("\nAnswer:")]
        assert prompt_ids == tokenizer(f"Question: {question}\nAnswer:")["input_ids"]
        assert completion_ids[-1] == tokenizer.eos_token_id
        completion = tokenizer.decode(completion_ids[:-1], clean_up_tokenization_spaces=False)
        assert completion == " " + answers[question]
        assert "\n#### " in completion


def test_subset_is_seeded(data_dir, tokenizer):
    def subset(seed):
        return load_train_examples("cola", tokenizer, seq_len=128, data_dir=data_dir, max_examples=25, seed=seed)

    first = subset(1)
    assert len(first) == 25
    assert first == subset(1)
    assert first != subset(2)


def test_seq_len_truncation_keeps_the_answer(data_dir, tokenizer):
    examples = load_train_examples("gsm8k", tokenizer, seq_len=48, data_dir=data_dir, max_examples=10)
    for example in examples:
        assert len(example.input_ids) <= 48
        assert example.labels[0] == IGNORE_INDEX  # at least one prompt token stays
        assert example.num_trained_tokens > 0


def test_lm_eval_compiles_each_prompt_template_once_and_renders_the_same_text(data_dir):
    """Rendering a training split compiles the task's templates once, not once per document, and
    gives what a template compiled afresh for each document gives."""
    from lm_eval import utils

    from plora_hpo.tasks._lmeval import load_task, training_pairs

    task, _ = load_task(get_task("gsm8k"), data_dir)
    before = utils.env.from_string.cache_info()
    prompts, completions = training_pairs(task)
    after = utils.env.from_string.cache_info()
    assert len(prompts) == 7473
    assert after.misses - before.misses <= 2  # doc_to_text, doc_to_target
    assert after.hits - before.hits >= 2 * 7473 - 2
    compile_afresh = utils.env.from_string.__wrapped__
    docs = task.training_docs()
    for i in (0, 1, 4000, 7472):
        assert prompts[i] == compile_afresh(task.config.doc_to_text).render(**docs[i])
        target = compile_afresh(task.config.doc_to_target).render(**docs[i])
        assert completions[i] == task.config.target_delimiter + target
