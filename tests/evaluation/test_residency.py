"""Adapter paging (S-LoRA): LRU eviction within a byte budget, loud failure when not resident."""

from __future__ import annotations

import pytest
import torch

from plora_hpo.evaluation import AdapterResidency
from plora_hpo.evaluation.kv_cache import RowKVCache, assemble
from plora_hpo.evaluation.residency import adapter_chunks

from .test_generation import RANKS, tiny_pack


def sizes(packed) -> dict[str, int]:
    return {a: AdapterResidency(packed, list(RANKS), budget_bytes=None).nbytes(a) for a in RANKS}


def test_lru_eviction_within_budget_and_exact_restore(tmp_path):
    _, packed, _ = tiny_pack("llama", tmp_path)
    before = {a: [p.detach().clone() for p in packed.parameters_of(a)] for a in RANKS}
    size = sizes(packed)
    residency = AdapterResidency(packed, list(RANKS), budget_bytes=size["b"] + size["c"])
    with residency:
        assert residency.resident() == []
        residency.ensure(["a"])
        residency.ensure(["b"])
        residency.ensure(["a"])  # a is now the most recently used
        residency.ensure(["c"])  # must evict one: b, the least recently used
        assert set(residency.resident()) == {"a", "c"}
        assert residency.resident_bytes() <= residency.budget_bytes
        evicted = next(a for a in RANKS if a not in residency.resident())
        assert all(p.numel() == 0 for p in packed.parameters_of(evicted))
        x = torch.randint(1, 90, (1, 5))
        with pytest.raises(RuntimeError), packed.route([(evicted, 1)]):
            packed.model(x)  # routing to a paged-out adapter fails instead of using stale weights
    assert residency.stats.swaps_in >= 3
    for adapter_id, tensors in before.items():
        for p, t in zip(packed.parameters_of(adapter_id), tensors):
            assert torch.equal(p, t)


def test_budget_below_one_adapter_is_an_error(tmp_path):
    _, packed, _ = tiny_pack("llama", tmp_path)
    with pytest.raises(ValueError, match="raise the budget"):
        AdapterResidency(packed, list(RANKS), budget_bytes=sizes(packed)["c"] - 1)


def test_adapter_chunks_fit_the_budget(tmp_path):
    _, packed, _ = tiny_pack("llama", tmp_path)
    size = sizes(packed)
    residency = AdapterResidency(packed, list(RANKS), budget_bytes=size["b"] + size["c"])
    assert adapter_chunks(residency, list(RANKS)) == [["a", "b"], ["c"]]
    unlimited = AdapterResidency(packed, list(RANKS), budget_bytes=None)
    assert adapter_chunks(unlimited, list(RANKS)) == [list(RANKS)]


def test_assemble_right_aligns_rows_and_drops_shared_padding():
    def cache(lengths: list[int], width: int, fill: float) -> RowKVCache:
        c = RowKVCache(1)
        keys = torch.zeros(len(lengths), 1, width, 2)
        for row, n in enumerate(lengths):
            keys[row, 0, width - n :] = fill + row + torch.arange(n, dtype=torch.float32)[:, None]
        c.layers[0].adopt(keys, keys.clone(), width)
        c.real_len = torch.tensor(lengths)
        return c

    old = cache([2, 5, 3], width=7, fill=100.0)  # two padding columns every row shares
    new = cache([4], width=4, fill=200.0)
    merged = assemble(
        [(old, torch.tensor([2, 0]), torch.tensor([0, 2])), (new, torch.tensor([0]), torch.tensor([1]))],
        rows=3,
        headroom=3,
    )
    assert merged.length == 4 and merged.layers[0].key_buffer.shape[2] == 7
    assert merged.real_len.tolist() == [3, 4, 2]
    keys = merged.layers[0].keys[:, 0, :, 0]
    assert keys[0].tolist() == [0, 102, 103, 104]
    assert keys[1].tolist() == [200, 201, 202, 203]
    assert keys[2].tolist() == [0, 0, 100, 101]
    assert merged.attention_mask(extra=1).tolist() == [[0, 1, 1, 1, 1], [1, 1, 1, 1, 1], [0, 0, 1, 1, 1]]
