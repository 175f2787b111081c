"""S-LoRA-style adapter paging: adapters live in host memory and visit the device per batch.

When K adapters do not fit next to the base model and the KV cache, only the adapters that the
current batch routes to are kept on the device; the rest wait in (pinned) host memory. The
weights that arrive are bit-identical copies, so paging never changes a result.

An evicted adapter's parameters point at empty tensors on the device: a forward that routes to
an adapter that is not resident fails loudly instead of silently using stale weights.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from plora_hpo.engine.packed_lora import PackedLoraModel


@dataclass
class PagingStats:
    swaps_in: int = 0
    swaps_out: int = 0
    bytes_in: int = 0


class AdapterResidency:
    """Which adapters are on the device; a context manager that pages them within a budget.

    Args:
        packed: the model whose adapters are paged.
        adapter_ids: the adapters under management (others are left alone).
        budget_bytes: most bytes of adapter weights on the device at once; ``None`` keeps every
            adapter where it is (no paging).

    On entry (with a budget) every managed adapter moves to host memory; :meth:`ensure` brings
    in what a batch needs, evicting the least recently used adapters not in that batch. On exit
    every adapter is back on the device as before.
    """

    def __init__(self, packed: PackedLoraModel, adapter_ids: Sequence[str], *, budget_bytes: int | None) -> None:
        self.packed = packed
        self.adapter_ids = list(adapter_ids)
        self.budget_bytes = budget_bytes
        self.stats = PagingStats()
        self._host: dict[str, list[torch.Tensor]] = {}
        self._resident: OrderedDict[str, None] = OrderedDict()
        self._active = False
        params = packed.parameters_of(self.adapter_ids[0]) if self.adapter_ids else []
        self.device = params[0].device if params else torch.device("cpu")
        self._nbytes = {a: sum(p.numel() * p.element_size() for p in packed.parameters_of(a)) for a in self.adapter_ids}
        if budget_bytes is not None:
            too_big = [a for a, n in self._nbytes.items() if n > budget_bytes]
            if too_big:
                raise ValueError(
                    f"adapter memory budget {budget_bytes} B is below the size of adapter(s) {too_big} "
                    f"({max(self._nbytes[a] for a in too_big)} B); raise the budget"
                )

    @property
    def paging(self) -> bool:
        return self.budget_bytes is not None

    def nbytes(self, adapter_id: str) -> int:
        return self._nbytes[adapter_id]

    def fits(self, adapter_ids: Iterable[str]) -> bool:
        """Whether these adapters can all be on the device at once."""
        return not self.paging or sum(self._nbytes[a] for a in set(adapter_ids)) <= self.budget_bytes

    def resident(self) -> list[str]:
        return list(self._resident) if self.paging else list(self.adapter_ids)

    def resident_bytes(self) -> int:
        return sum(self._nbytes[a] for a in self.resident())

    # --- paging ----------------------------------------------------------------------------
    def __enter__(self) -> AdapterResidency:
        if self.paging:
            pin = self.device.type == "cuda"
            for adapter_id in self.adapter_ids:
                host = []
                for p in self.packed.parameters_of(adapter_id):
                    copy = torch.empty(p.shape, dtype=p.dtype, device="cpu", pin_memory=pin)
                    copy.copy_(p.data)
                    host.append(copy)
                self._host[adapter_id] = host
                self._evict(adapter_id, count=False)
            self._resident.clear()
        self._active = True
        return self

    def __exit__(self, *exc: object) -> None:
        if self.paging:
            for adapter_id in self.adapter_ids:
                if adapter_id not in self._resident:
                    self._load(adapter_id, count=False)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)  # the pinned sources must outlive the copies
            self._host.clear()
            self._resident.clear()
        self._active = False

    def ensure(self, adapter_ids: Iterable[str]) -> None:
        """Make these adapters resident (a batch is about to route to them)."""
        if not self.paging:
            return
        if not self._active:
            raise RuntimeError("AdapterResidency.ensure outside its `with` block")
        needed = list(dict.fromkeys(adapter_ids))
        if not self.fits(needed):
            raise ValueError(
                f"one batch routes to adapters needing {sum(self._nbytes[a] for a in needed)} B, "
                f"above the budget of {self.budget_bytes} B"
            )
        for adapter_id in needed:
            if adapter_id in self._resident:
                self._resident.move_to_end(adapter_id)
        missing = [a for a in needed if a not in self._resident]
        used = self.resident_bytes()
        for adapter_id in missing:
            while used + self._nbytes[adapter_id] > self.budget_bytes:
                victim = next(a for a in self._resident if a not in needed)
                self._evict(victim)
                used -= self._nbytes[victim]
            self._load(adapter_id)
            used += self._nbytes[adapter_id]

    def _load(self, adapter_id: str, *, count: bool = True) -> None:
        for p, host in zip(self.packed.parameters_of(adapter_id), self._host[adapter_id]):
            p.data = host.to(self.device, non_blocking=True, copy=True)
        self._resident[adapter_id] = None
        if count:
            self.stats.swaps_in += 1
            self.stats.bytes_in += self._nbytes[adapter_id]

    def _evict(self, adapter_id: str, *, count: bool = True) -> None:
        for p in self.packed.parameters_of(adapter_id):
            p.data = torch.empty(0, dtype=p.dtype, device=self.device)
        self._resident.pop(adapter_id, None)
        if count:
            self.stats.swaps_out += 1


def adapter_chunks(residency: AdapterResidency, adapter_ids: Sequence[str]) -> list[list[str]]:
    """Split adapters, in order, into consecutive groups that fit the budget together."""
    chunks: list[list[str]] = []
    current: list[str] = []
    for adapter_id in adapter_ids:
        if current and not residency.fits([*current, adapter_id]):
            chunks.append(current)
            current = []
        current.append(adapter_id)
    if current:
        chunks.append(current)
    return chunks
