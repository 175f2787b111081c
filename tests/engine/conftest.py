"""Tiny real architectures (Llama, Qwen2, Mistral) with random weights and random training data."""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen2Config

from plora_hpo.engine.batching import IGNORE_INDEX

VOCAB = 97


def tiny_model(family: str, seed: int = 0, **overrides) -> torch.nn.Module:
    common = dict(
        vocab_size=VOCAB,
        hidden_size=48,
        intermediate_size=80,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        attn_implementation="sdpa",
    )
    config = {"llama": LlamaConfig, "qwen2": Qwen2Config, "mistral": MistralConfig}[family](**{**common, **overrides})
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


@dataclass(frozen=True)
class Example:
    input_ids: tuple[int, ...]
    labels: tuple[int, ...]


def random_examples(n: int, seed: int, min_len: int = 6, max_len: int = 20) -> list[Example]:
    """Sequences of random length whose first part is an untrained prompt."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        length = rng.randint(min_len, max_len)
        ids = tuple(rng.randrange(1, VOCAB) for _ in range(length))
        prompt = rng.randint(1, length - 2)
        out.append(Example(ids, (IGNORE_INDEX,) * prompt + ids[prompt:]))
    return out


@pytest.fixture(params=["llama", "qwen2", "mistral"])
def family(request) -> str:
    return request.param
