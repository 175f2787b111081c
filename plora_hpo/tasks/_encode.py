"""Turning one (prompt, completion) pair into a training sequence the way lm-eval scores it.

lm-eval's HF model tokenises ``context + continuation`` as one string and splits it at the
length of the tokenised context (after moving the context's trailing spaces into the
continuation). Doing the same here means the tokens an adapter learns to produce are exactly
the tokens the evaluator later scores.
"""

from __future__ import annotations

from collections.abc import Sequence

from transformers import PreTrainedTokenizerBase

from plora_hpo.tasks._base import TrainExample

IGNORE_INDEX = -100


def split_trailing_space(prompt: str, completion: str) -> tuple[str, str]:
    """Move the prompt's trailing whitespace to the completion (lm-eval's ``_encode_pair`` rule)."""
    stripped = prompt.rstrip()
    return stripped, prompt[len(stripped) :] + completion


def truncate(prompt_ids: list[int], completion_ids: list[int], seq_len: int) -> tuple[list[int], list[int]]:
    """Fit a pair into ``seq_len`` tokens, keeping what is trained.

    Too-long pairs lose prompt tokens from the left first (as lm-eval left-truncates contexts),
    keeping at least one prompt token, then completion tokens from the right.
    """
    if len(prompt_ids) + len(completion_ids) <= seq_len:
        return prompt_ids, completion_ids
    keep_prompt = min(len(prompt_ids), max(1, seq_len - len(completion_ids)))
    return prompt_ids[len(prompt_ids) - keep_prompt :], completion_ids[: seq_len - keep_prompt]


def encode_pairs(
    tokenizer: PreTrainedTokenizerBase,
    prompts: Sequence[str],
    completions: Sequence[str],
    *,
    seq_len: int,
) -> list[TrainExample]:
    """Tokenise pairs with the tokenizer's own special-token defaults (as lm-eval does); append EOS."""
    if seq_len < 2:
        raise ValueError(f"seq_len must be at least 2 (one prompt and one completion token), got {seq_len}")
    pairs = [split_trailing_space(p, c) for p, c in zip(prompts, completions, strict=True)]
    contexts = tokenizer([p for p, _ in pairs])["input_ids"]
    wholes = tokenizer([p + c for p, c in pairs])["input_ids"]
    eos = tokenizer.eos_token_id
    examples = []
    for context, whole in zip(contexts, wholes):
        prompt_ids, completion_ids = list(whole[: len(context)]), list(whole[len(context) :])
        if eos is not None and (not completion_ids or completion_ids[-1] != eos):
            completion_ids.append(eos)
        prompt_ids, completion_ids = truncate(prompt_ids, completion_ids, seq_len)
        examples.append(
            TrainExample(
                input_ids=tuple(prompt_ids + completion_ids),
                labels=(IGNORE_INDEX,) * len(prompt_ids) + tuple(completion_ids),
            )
        )
    return examples
