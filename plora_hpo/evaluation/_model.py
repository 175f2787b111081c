"""Thin calls into a Hugging Face causal LM that the evaluators share.

Evaluation never asks the model for full-vocabulary logits of every position: it runs the
decoder for hidden states and applies the LM head only where a score or a next token is
needed (a 152k-wide vocabulary times every prompt token would dominate memory otherwise).
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable
from itertools import groupby

import torch
from torch import nn
from transformers.cache_utils import Cache


def run_lengths(row_adapters: Iterable[str]) -> list[tuple[str, int]]:
    """``["a", "a", "b"] -> [("a", 2), ("b", 1)]``: the route groups of rows already grouped."""
    return [(adapter_id, sum(1 for _ in rows)) for adapter_id, rows in groupby(row_adapters)]


def model_device(model: nn.Module) -> torch.device:
    return next(model.parameters()).device


def decoder_of(model: nn.Module) -> nn.Module:
    """The transformer body (``model.model`` for Llama/Qwen2/Mistral) that returns hidden states."""
    config = model.config
    for attr in ("final_logit_softcapping", "logit_scale"):
        if getattr(config, attr, None):
            raise NotImplementedError(
                f"{type(model).__name__} post-processes logits ({attr}); the evaluator applies the "
                "LM head directly and supports Llama/Qwen2/Mistral-style heads only"
            )
    return model.base_model


def _cache_keyword(decoder: nn.Module) -> str:
    """transformers renamed ``past_key_values`` to ``cache`` (5.2x); accept both."""
    params = inspect.signature(decoder.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def hidden_states(
    decoder: nn.Module,
    input_ids: torch.Tensor,
    *,
    attention_mask: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
    cache: Cache | None = None,
) -> torch.Tensor:
    """Last hidden states ``(rows, tokens, hidden)``; fills ``cache`` when one is given."""
    kwargs: dict = {"input_ids": input_ids, "use_cache": cache is not None}
    if attention_mask is not None:
        kwargs["attention_mask"] = attention_mask
    if position_ids is not None:
        kwargs["position_ids"] = position_ids
    if cache is not None:
        kwargs[_cache_keyword(decoder)] = cache
    return decoder(**kwargs).last_hidden_state


def num_decoder_layers(model: nn.Module) -> int:
    config = model.config.get_text_config(decoder=True)
    return int(config.num_hidden_layers)
