"""A KV cache for continuous batching: rows leave and join between decode steps.

Rows are left-padded to a common column count; row r's real tokens fill its last
``real_len[r]`` columns. Keys and values live in preallocated buffers with room to grow, so
a decode step writes one column instead of re-concatenating the whole cache (what
``DynamicCache`` does). :func:`assemble` builds the next batch's cache from rows of older
caches (survivors and newly prefilled rows) in one copy per source, re-aligning them to the
right and dropping columns that have become padding for every row.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers.cache_utils import Cache, DynamicLayer


class RowLayer(DynamicLayer):
    """One decoder layer's keys/values in a buffer ``(rows, kv_heads, capacity, head_dim)``."""

    def __init__(self, headroom: int = 0) -> None:
        super().__init__()
        self.headroom = headroom
        self.length = 0
        self.key_buffer: torch.Tensor | None = None
        self.value_buffer: torch.Tensor | None = None

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.is_initialized = True

    def adopt(self, keys: torch.Tensor, values: torch.Tensor, length: int) -> None:
        """Take over prepared buffers whose first ``length`` columns are filled."""
        self.key_buffer, self.value_buffer, self.length = keys, values, length
        self.dtype, self.device = keys.dtype, keys.device
        self.is_initialized = True
        self._refresh_views()

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: object, **kwargs: object
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        new = key_states.shape[-2]
        end = self.length + new
        if self.key_buffer is None or end > self.key_buffer.shape[-2]:
            self._grow(key_states, value_states, end + self.headroom)
        self.key_buffer[:, :, self.length : end] = key_states
        self.value_buffer[:, :, self.length : end] = value_states
        self.length = end
        self._refresh_views()
        return self.keys, self.values

    def _grow(self, key_states: torch.Tensor, value_states: torch.Tensor, capacity: int) -> None:
        rows, heads, _, dim = key_states.shape
        keys = key_states.new_zeros(rows, heads, capacity, dim)
        values = value_states.new_zeros(rows, heads, capacity, value_states.shape[-1])
        if self.key_buffer is not None and self.length:
            keys[:, :, : self.length] = self.key_buffer[:, :, : self.length]
            values[:, :, : self.length] = self.value_buffer[:, :, : self.length]
        self.key_buffer, self.value_buffer = keys, values

    def _refresh_views(self) -> None:
        self.keys = self.key_buffer[:, :, : self.length]
        self.values = self.value_buffer[:, :, : self.length]

    def get_seq_length(self) -> int:
        return self.length

    def zero_columns(self, pad: torch.Tensor) -> None:
        """Zero the keys/values where ``pad`` (rows, length) is True (left padding).

        Padded positions are masked out of attention, but a NaN there would still poison
        ``softmax · V`` (0 · NaN); zeros make the masked columns inert.
        """
        keep = (~pad)[:, None, :, None].to(self.keys.dtype)
        self.keys.mul_(keep)
        self.values.mul_(keep)


class RowKVCache(Cache):
    """A ``transformers`` cache of :class:`RowLayer` s plus each row's real token count."""

    def __init__(self, num_layers: int, *, headroom: int = 0) -> None:
        super().__init__(layers=[RowLayer(headroom) for _ in range(num_layers)])
        self.real_len: torch.Tensor | None = None  # (rows,) int64, on the cache's device

    @property
    def length(self) -> int:
        return self.layers[0].length

    @property
    def rows(self) -> int:
        return 0 if self.real_len is None else int(self.real_len.shape[0])

    def attention_mask(self, extra: int = 0) -> torch.Tensor:
        """``(rows, length + extra)`` 1 where a row has a real token (``extra`` new ones at the end)."""
        total = self.length + extra
        columns = torch.arange(total, device=self.real_len.device)
        return (columns[None, :] >= (total - self.real_len - extra)[:, None]).long()


def assemble(
    sources: Sequence[tuple[RowKVCache, torch.Tensor, torch.Tensor]],
    *,
    rows: int,
    headroom: int,
) -> RowKVCache:
    """A new cache of ``rows`` rows built from rows of older caches.

    Args:
        sources: ``(cache, source_rows, target_rows)``: row ``source_rows[i]`` of ``cache``
            becomes row ``target_rows[i]`` of the result (index tensors on the cache device).
        rows: row count of the result; every target row must be written by one source.
        headroom: free columns to allocate beyond the current length (decode steps to come).

    Every row keeps its real tokens, right-aligned; the new length is the longest real length.
    """
    real_len = None
    length = 0
    for cache, src, _ in sources:
        if src.numel():
            length = max(length, int(cache.real_len[src].max()))
    template = sources[0][0]
    device = template.real_len.device
    real_len = torch.zeros(rows, dtype=torch.long, device=device)
    for cache, src, dst in sources:
        real_len[dst] = cache.real_len[src]
    out = RowKVCache(len(template.layers), headroom=headroom)
    for index, layer in enumerate(template.layers):
        keys = layer.keys.new_zeros(rows, layer.keys.shape[1], length + headroom, layer.keys.shape[3])
        values = layer.values.new_zeros(rows, layer.values.shape[1], length + headroom, layer.values.shape[3])
        for cache, src, dst in sources:
            if not src.numel():
                continue
            source = cache.layers[index]
            take = min(length, source.length)
            keys[dst, :, length - take : length] = source.keys[src, :, source.length - take :]
            values[dst, :, length - take : length] = source.values[src, :, source.length - take :]
        out.layers[index].adopt(keys, values, length)
    out.real_len = real_len
    return out
