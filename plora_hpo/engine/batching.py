"""Per-adapter data order and the packed batch that feeds all adapters in one step."""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

IGNORE_INDEX = -100


class TokenizedExample(Protocol):
    """A training sequence; ``labels`` is ``IGNORE_INDEX`` where no loss is taken (the prompt)."""

    input_ids: Sequence[int]
    labels: Sequence[int]


class DataStream:
    """An adapter's own endless, seeded pass over its examples: reshuffled every epoch.

    The position (epoch, cursor) is all the state there is, so a stream can be checkpointed
    and restored exactly.
    """

    def __init__(self, examples: Sequence[TokenizedExample], seed: int) -> None:
        if not examples:
            raise ValueError("an adapter needs at least one training example")
        self.examples = examples
        self.seed = seed
        self.epoch = 0
        self.cursor = 0
        self._order = self._permutation(0)

    def _permutation(self, epoch: int) -> list[int]:
        order = list(range(len(self.examples)))
        random.Random(self.seed * 1_000_003 + epoch).shuffle(order)
        return order

    def take(self, n: int) -> list[TokenizedExample]:
        out: list[TokenizedExample] = []
        while len(out) < n:
            if self.cursor == len(self._order):
                self.epoch += 1
                self.cursor = 0
                self._order = self._permutation(self.epoch)
            out.append(self.examples[self._order[self.cursor]])
            self.cursor += 1
        return out

    def position(self) -> tuple[int, int]:
        return self.epoch, self.cursor

    def seek(self, epoch: int, cursor: int) -> None:
        self.epoch, self.cursor = epoch, cursor
        self._order = self._permutation(epoch)


@dataclass
class PackedBatch:
    """Rows grouped by adapter, right-padded to a common length."""

    input_ids: torch.Tensor  # (rows, T)
    attention_mask: torch.Tensor  # (rows, T)
    labels: torch.Tensor  # (rows, T), IGNORE_INDEX on prompt and padding
    groups: list[tuple[str, int]]  # (adapter_id, rows) in row order

    @property
    def real_tokens(self) -> int:
        return int(self.attention_mask.sum())

    def rows_of(self) -> dict[str, slice]:
        out, start = {}, 0
        for adapter_id, n in self.groups:
            out[adapter_id] = slice(start, start + n)
            start += n
        return out


def collate(
    groups: Sequence[tuple[str, Sequence[TokenizedExample]]], pad_id: int, device: torch.device | str
) -> PackedBatch:
    """Stack every adapter's examples (in group order) into one right-padded batch."""
    rows = [ex for _, exs in groups for ex in exs]
    length = max(len(ex.input_ids) for ex in rows)
    input_ids = torch.full((len(rows), length), pad_id, dtype=torch.long)
    labels = torch.full((len(rows), length), IGNORE_INDEX, dtype=torch.long)
    mask = torch.zeros((len(rows), length), dtype=torch.long)
    for i, ex in enumerate(rows):
        n = len(ex.input_ids)
        input_ids[i, :n] = torch.tensor(ex.input_ids)
        labels[i, :n] = torch.tensor(ex.labels)
        mask[i, :n] = 1
    return PackedBatch(
        input_ids=input_ids.to(device),
        attention_mask=mask.to(device),
        labels=labels.to(device),
        groups=[(a, len(exs)) for a, exs in groups],
    )
