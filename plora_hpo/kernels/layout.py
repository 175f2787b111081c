"""Where each adapter's tokens and rank columns sit inside a packed batch."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import accumulate, pairwise
from typing import Any

import torch


@dataclass(frozen=True)
class SegmentLayout:
    """Adapter k owns token rows ``token_offsets[k]:token_offsets[k+1]`` of the flattened input
    and rank columns ``rank_offsets[k]:rank_offsets[k+1]`` of the concatenated A/B matrices.

    Segments are contiguous and ordered; a segment may be empty (an adapter with no rows in
    this batch). Tokens before ``token_offsets[0]`` or after ``token_offsets[-1]`` get no
    adapter (base model only), which lets evaluation mix base and adapter rows.
    """

    token_offsets: tuple[int, ...]
    rank_offsets: tuple[int, ...]
    scalings: tuple[float, ...]
    _device_cache: dict = field(default_factory=dict, compare=False, repr=False, hash=False)

    def __post_init__(self) -> None:
        k = len(self.scalings)
        if len(self.token_offsets) != k + 1 or len(self.rank_offsets) != k + 1:
            raise ValueError(
                f"SegmentLayout needs K+1 offsets for K={k} scalings, got "
                f"{len(self.token_offsets)} token and {len(self.rank_offsets)} rank offsets"
            )
        for name, offsets in (("token", self.token_offsets), ("rank", self.rank_offsets)):
            if any(b < a for a, b in pairwise(offsets)) or offsets[0] < 0:
                raise ValueError(f"SegmentLayout {name}_offsets must be non-negative and sorted: {offsets}")

    @classmethod
    def from_counts(
        cls,
        tokens_per_adapter: list[int],
        ranks: list[int],
        scalings: list[float],
        token_start: int = 0,
    ) -> SegmentLayout:
        """Build offsets from per-adapter token counts and ranks."""
        return cls(
            token_offsets=tuple(accumulate(tokens_per_adapter, initial=token_start)),
            rank_offsets=tuple(accumulate(ranks, initial=0)),
            scalings=tuple(float(s) for s in scalings),
        )

    @property
    def num_adapters(self) -> int:
        return len(self.scalings)

    @property
    def total_rank(self) -> int:
        return self.rank_offsets[-1]

    def segment_lengths(self) -> list[int]:
        return [b - a for a, b in zip(self.token_offsets, self.token_offsets[1:])]

    def ranks(self) -> list[int]:
        return [b - a for a, b in zip(self.rank_offsets, self.rank_offsets[1:])]

    def device_tensors(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(token_offsets int32, rank_offsets int32, scalings fp32) on ``device``, built once."""
        key = str(device)
        if key not in self._device_cache:
            self._device_cache[key] = (
                torch.tensor(self.token_offsets, dtype=torch.int32, device=device),
                torch.tensor(self.rank_offsets, dtype=torch.int32, device=device),
                torch.tensor(self.scalings, dtype=torch.float32, device=device),
            )
        return self._device_cache[key]

    def cached(self, key: Any, build: Callable[[], Any]) -> Any:
        """Memoise ``build()`` under ``key`` on this layout, so per-layout device data (e.g. the
        Triton kernels' tile maps) is built once however many layers call with the same layout."""
        if key not in self._device_cache:
            self._device_cache[key] = build()
        return self._device_cache[key]
