"""Per-adapter data order and the micro-batches that feed every adapter of a pack in one step."""

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


ROW_LAYOUTS = ("padded", "varlen")  # one right-padded row per sequence | sequences concatenated into one row


@dataclass
class MicroBatch:
    """One forward/backward of a packed step.

    ``groups`` lists every adapter of the step in pack order with its rows in this micro-batch
    (possibly zero), so the layers see one route shape whatever the split. Loss bookkeeping is
    precomputed on the host, so a step needs no device→host synchronisation until its losses
    are read: ``label_index`` are the flat positions (into ``input_ids.numel()``) whose hidden
    state predicts a trained token, ``targets`` those tokens, ``label_counts`` how many belong
    to each group and ``label_group`` the group of each.

    Padded micro-batches are ``(rows, T)`` right-padded to their longest row. Padding-free
    (``varlen``) micro-batches hold all their sequences back to back in one row;
    ``position_ids`` restart at every sequence and ``cu_seqlens`` (int32, ``n_seqs + 1``) are the
    sequence boundaries the attention kernel needs.
    """

    input_ids: torch.Tensor
    groups: list[tuple[str, int]]
    label_index: torch.Tensor
    targets: torch.Tensor
    label_group: torch.Tensor
    label_counts: list[int]
    real_tokens: int
    tokens_per_group: list[int]
    position_ids: torch.Tensor | None = None
    token_counts: list[int] | None = None
    cu_seqlens: torch.Tensor | None = None
    max_seqlen: int = 0

    @property
    def padded_tokens(self) -> int:
        return self.input_ids.numel()


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Host tensor to ``device``; on CUDA through pinned memory without blocking the host."""
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def _rows_by_group(rows: list[tuple[int, TokenizedExample]]) -> list[tuple[int, TokenizedExample]]:
    return sorted(rows, key=lambda r: r[0])  # stable: keeps each adapter's own row order


def _split_padded(rows: list[tuple[int, TokenizedExample]], max_tokens: int | None) -> list[list]:
    """Cut rows into micro-batches of at most ``max_tokens`` padded tokens.

    With a budget, rows are bucketed by length (longest first), so rows of similar length pad
    together; a row longer than the budget gets a micro-batch of its own.
    """
    if max_tokens is None:
        return [rows]
    ordered = sorted(rows, key=lambda r: -len(r[1].input_ids))
    chunks: list[list] = []
    current: list = []
    longest = 0
    for row in ordered:
        n = len(row[1].input_ids)
        if current and (len(current) + 1) * max(longest, n) > max_tokens:
            chunks.append(current)
            current, longest = [], 0
        current.append(row)
        longest = max(longest, n)
    if current:
        chunks.append(current)
    return [_rows_by_group(c) for c in chunks]


def _split_varlen(rows: list[tuple[int, TokenizedExample]], max_tokens: int | None) -> list[list]:
    """Cut rows (in group order) into micro-batches of at most ``max_tokens`` real tokens."""
    if max_tokens is None:
        return [rows]
    chunks: list[list] = []
    current: list = []
    used = 0
    for row in rows:
        n = len(row[1].input_ids)
        if current and used + n > max_tokens:
            chunks.append(current)
            current, used = [], 0
        current.append(row)
        used += n
    if current:
        chunks.append(current)
    return chunks


def plan_micro_batches(
    groups: Sequence[tuple[str, Sequence[TokenizedExample]]],
    pad_id: int,
    device: torch.device | str,
    *,
    row_layout: str = "padded",
    max_tokens: int | None = None,
) -> list[MicroBatch]:
    """Split one packed step's examples into micro-batches (all of them in one by default).

    Args:
        groups: ``(adapter_id, examples)`` per adapter, in pack order.
        pad_id: token id written into padding positions (never trained, never attended).
        device: where the tensors go (pinned, non-blocking copies on CUDA).
        row_layout: ``"padded"`` (rows right-padded to the micro-batch's longest) or ``"varlen"``
            (padding-free: sequences concatenated back to back, attention kept within each sequence).
        max_tokens: tokens per micro-batch (padded tokens for ``padded``, real tokens for
            ``varlen``); ``None`` puts the whole step in one micro-batch.
    """
    if row_layout not in ROW_LAYOUTS:
        raise ValueError(f"unknown row_layout {row_layout!r}; use one of {ROW_LAYOUTS}")
    if max_tokens is not None and max_tokens <= 0:
        raise ValueError(f"max_tokens must be positive, got {max_tokens}")
    device = torch.device(device)
    ids = [a for a, _ in groups]
    rows = [(g, ex) for g, (_, exs) in enumerate(groups) for ex in exs]
    if not rows:
        raise ValueError("a packed step needs at least one example")
    split = _split_varlen if row_layout == "varlen" else _split_padded
    return [_build(chunk, ids, pad_id, device, row_layout) for chunk in split(rows, max_tokens)]


def _build(
    rows: list[tuple[int, TokenizedExample]], ids: list[str], pad_id: int, device: torch.device, row_layout: str
) -> MicroBatch:
    k = len(ids)
    row_counts = [0] * k
    tokens = [0] * k
    lengths = [len(ex.input_ids) for _, ex in rows]
    varlen = row_layout == "varlen"
    width = sum(lengths) if varlen else max(lengths)
    n_rows = 1 if varlen else len(rows)
    input_ids = torch.full((n_rows * width,), pad_id, dtype=torch.long)
    next_label = torch.full((n_rows * width,), IGNORE_INDEX, dtype=torch.long)  # label of token t+1
    group_of = torch.zeros((n_rows * width,), dtype=torch.long)
    offset = 0
    for (g, ex), n in zip(rows, lengths):
        row_counts[g] += 1
        tokens[g] += n
        input_ids[offset : offset + n] = torch.as_tensor(ex.input_ids, dtype=torch.long)
        next_label[offset : offset + n - 1] = torch.as_tensor(ex.labels[1:n], dtype=torch.long)
        group_of[offset : offset + n] = g
        offset += n if varlen else width
    index = (next_label != IGNORE_INDEX).nonzero().squeeze(1)
    label_group = group_of[index]
    label_counts = torch.bincount(label_group, minlength=k).tolist()
    batch = MicroBatch(
        input_ids=to_device(input_ids.view(n_rows, width), device),
        groups=[(a, row_counts[g]) for g, a in enumerate(ids)],
        label_index=to_device(index, device),
        targets=to_device(next_label[index], device),
        label_group=to_device(label_group, device),
        label_counts=label_counts,
        real_tokens=sum(lengths),
        tokens_per_group=tokens,
    )
    if varlen:
        positions = torch.cat([torch.arange(n, dtype=torch.long) for n in lengths]).unsqueeze(0)
        cu = torch.tensor([0, *lengths], dtype=torch.int64).cumsum(0).to(torch.int32)
        batch.position_ids = to_device(positions, device)
        batch.token_counts = tokens
        batch.cu_seqlens = to_device(cu, device)
        batch.max_seqlen = max(lengths)
    return batch
