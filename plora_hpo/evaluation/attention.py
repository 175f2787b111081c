"""Decode-step attention that reads a grouped-query KV cache once, not once per query head.

With a padding mask, transformers' SDPA path expands every cached key and value to all query
heads (``repeat_kv``) before attending: for Qwen2.5 (12 query, 2 KV heads) a decode step of a
large continuous batch then writes and reads six copies of the whole KV cache per layer,
which dwarfs the rest of the step. For one new token per row the query heads that share a KV
head can instead be folded into the query-length axis: ``(rows, kv_heads, heads_per_kv, dim)``
attends to the un-expanded cache under the same (broadcast) mask — the same arithmetic.

Registered with transformers as ``"plora_sdpa"`` and switched on only inside
:func:`folded_decode_attention`; everything else (prefill, training) runs the stock SDPA path.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

NAME = "plora_sdpa"


def folded_sdpa_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature; folds GQA heads when there is one query token."""
    rows, heads, q_len, dim = query.shape
    kv_heads = key.shape[1]
    if q_len != 1 or kv_heads == heads or dropout or key.shape[-1] != value.shape[-1]:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    folded = query.reshape(rows, kv_heads, heads // kv_heads, dim)  # query head h uses KV head h // group
    out = F.scaled_dot_product_attention(folded, key, value, attn_mask=attention_mask, scale=scaling)
    return out.reshape(rows, heads, 1, dim).transpose(1, 2).contiguous(), None


AttentionInterface.register(NAME, folded_sdpa_forward)
AttentionMaskInterface.register(NAME, sdpa_mask)


@contextmanager
def folded_decode_attention(model: nn.Module) -> Iterator[None]:
    """Within the block a model configured for SDPA attends through :func:`folded_sdpa_forward`."""
    config = model.config
    original = getattr(config, "_attn_implementation", None)
    if original != "sdpa":
        yield
        return
    config._attn_implementation = NAME
    try:
        yield
    finally:
        config._attn_implementation = original
