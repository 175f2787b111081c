"""Prompt/completion → tokens: lm-eval's split rule, masking, EOS and truncation."""

from __future__ import annotations

import pytest

from plora_hpo.tasks import TrainExample
from plora_hpo.tasks._encode import IGNORE_INDEX, encode_pairs, split_trailing_space, truncate


def test_trailing_space_moves_to_completion():
    assert split_trailing_space("Answer: ", "yes") == ("Answer:", " yes")
    assert split_trailing_space("Answer:", " yes") == ("Answer:", " yes")


def test_truncate_keeps_completion_and_one_prompt_token():
    prompt, completion = list(range(10)), [100, 101, 102]
    assert truncate(prompt, completion, 20) == (prompt, completion)
    assert truncate(prompt, completion, 8) == (list(range(5, 10)), completion)
    assert truncate(prompt, completion, 3) == ([9], [100, 101])


def test_masks_and_eos(tokenizer):
    [example] = encode_pairs(tokenizer, ["Word: lion\nGroup A or B?\nAnswer:"], [" A"], seq_len=64)
    n_prompt = len(tokenizer("Word: lion\nGroup A or B?\nAnswer:")["input_ids"])
    assert example.labels[:n_prompt] == (IGNORE_INDEX,) * n_prompt
    assert example.labels[n_prompt:] == example.input_ids[n_prompt:]
    assert example.input_ids[-1] == tokenizer.eos_token_id
    assert tokenizer.decode(example.input_ids[n_prompt:-1]) == " A"
    assert example.num_trained_tokens == 2


def test_seq_len_bound(tokenizer):
    examples = encode_pairs(tokenizer, ["x " * 50 + "Answer:"], [" a long answer " * 10], seq_len=16)
    assert len(examples[0].input_ids) == 16
    assert examples[0].labels[0] == IGNORE_INDEX and examples[0].labels[-1] != IGNORE_INDEX


def test_train_example_checks_lengths():
    with pytest.raises(ValueError, match="differ in length"):
        TrainExample((1, 2), (IGNORE_INDEX,))
