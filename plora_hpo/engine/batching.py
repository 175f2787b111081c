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


ROW_LAYOUTS = ("padded", "varlen")  # right-padded sequences | sequences back to back, no padding


@dataclass
class MicroBatch:
    """One forward/backward of a packed step.

    ``groups`` lists every adapter of the step in pack order with its sequences in this
    micro-batch (possibly zero), so the layers see one route shape whatever the split. Loss
    bookkeeping is precomputed on the host, so a step needs no device→host synchronisation until
    its losses are read: ``label_index`` are the flat positions (into ``input_ids.numel()``) whose
    hidden state predicts a trained token, ``targets`` those tokens, ``label_counts`` how many
    belong to each group and ``label_group`` the group of each.

    Two shapes (see :func:`plan_micro_batches`):

    * ``(rows, T)``: one row per sequence, right-padded to the longest of the micro-batch
      (``padded`` without ``isolate``); the fields below are ``None``.
    * ``(1, tokens)``: the groups' spans back to back in pack order, ``token_counts`` tokens
      each, and within a span its sequences one after another, each right-padded to the longest
      of *its own group* (``padded``) or not at all (``varlen``). ``position_ids`` restart at
      every sequence; ``cu_seqlens`` (int32, ``n_seqs + 1``) are the sequence boundaries
      (padding included) that attention is kept within, and ``seq_runs`` the same sequences as
      ``(count, length)`` runs of equal length, one group each, for attention that batches a
      run at a time (the CPU path).
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
    seq_runs: tuple[tuple[int, int], ...] | None = None

    @property
    def padded_tokens(self) -> int:
        return self.input_ids.numel()


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Host tensor to ``device``; on CUDA through pinned memory without blocking the host."""
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


Row = tuple[int, TokenizedExample]  # (group, sequence)


def _length(row: Row) -> int:
    return len(row[1].input_ids)


def _cut(rows: list[Row], max_tokens: int, padded: bool) -> list[list[Row]]:
    """Cut rows into chunks of at most ``max_tokens`` tokens (padded tokens if ``padded``:
    chunk size × its longest row; real tokens otherwise), in the order given.

    A row longer than the budget gets a chunk of its own.
    """
    chunks: list[list[Row]] = []
    current: list[Row] = []
    longest = used = 0
    for row in rows:
        n = _length(row)
        cost = (len(current) + 1) * max(longest, n) if padded else used + n
        if current and cost > max_tokens:
            chunks.append(current)
            current, longest, used = [], 0, 0
        current.append(row)
        longest, used = max(longest, n), used + n
    if current:
        chunks.append(current)
    return chunks


def _chunk_tokens(chunk: list[Row], padded: bool) -> int:
    lengths = [_length(r) for r in chunk]
    return len(lengths) * max(lengths) if padded else sum(lengths)


def _by_length(rows: list[Row]) -> list[Row]:
    return sorted(rows, key=lambda r: -_length(r))  # stable: equal lengths keep their order


def _split(rows: list[Row], num_groups: int, max_tokens: int | None, padded: bool, isolate: bool) -> list[list[Row]]:
    """Cut a step's rows (in group order) into micro-batches of at most ``max_tokens`` tokens.

    Padded rows are bucketed by length (longest first), so rows of similar length pad together.
    With ``isolate`` each group's rows are cut into chunks on their own and a micro-batch takes
    at most one chunk of each group, groups in pack order and each group's chunks in order: an
    adapter's chunks, and the order its gradients accumulate in, do not depend on its packmates.
    Without it the whole step's rows are bucketed and cut together.
    """
    if max_tokens is None:
        return [rows]
    if not isolate:
        chunks = _cut(_by_length(rows) if padded else rows, max_tokens, padded)
        return [sorted(c, key=lambda r: r[0]) for c in chunks]  # stable: each group's rows keep their order
    queues = []
    for g in range(num_groups):
        own = [r for r in rows if r[0] == g]
        queues.append(_cut(_by_length(own) if padded else own, max_tokens, padded)[::-1])  # pop() takes in order
    out: list[list[Row]] = []
    while any(queues):
        current: list[Row] = []
        used = 0
        for queue in queues:
            if queue and (not current or used + _chunk_tokens(queue[-1], padded) <= max_tokens):
                chunk = queue.pop()
                current += chunk
                used += _chunk_tokens(chunk, padded)
        out.append(current)
    return out


def plan_micro_batches(
    groups: Sequence[tuple[str, Sequence[TokenizedExample]]],
    pad_id: int,
    device: torch.device | str,
    *,
    row_layout: str = "padded",
    max_tokens: int | None = None,
    isolate: bool = True,
) -> list[MicroBatch]:
    """Split one packed step's examples into micro-batches (all of them in one by default).

    Args:
        groups: ``(adapter_id, examples)`` per adapter, in pack order.
        pad_id: token id written into padding positions (never trained, never attended by a
            real token).
        device: where the tensors go (pinned, non-blocking copies on CUDA).
        row_layout: ``"padded"`` (right-padded sequences) or ``"varlen"`` (no padding); see
            :class:`MicroBatch`.
        max_tokens: tokens per micro-batch (padded tokens for ``padded``, real tokens for
            ``varlen``); ``None`` puts the whole step in one micro-batch.
        isolate: build each adapter's part of a micro-batch from its own sequences alone: a
            padded sequence is padded to the longest of its own adapter's (one ``(1, tokens)``
            row), and micro-batching cuts each adapter's sequences into chunks on their own.
            Off: padded micro-batches are ``(rows, T)``, padded to the longest of all adapters,
            and micro-batching buckets all adapters' sequences together.
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
    padded = row_layout == "padded"
    chunks = _split(rows, len(ids), max_tokens, padded, isolate)
    return [_build(chunk, ids, pad_id, device, padded, isolate) for chunk in chunks]


def _build(
    rows: list[Row], ids: list[str], pad_id: int, device: torch.device, padded: bool, isolate: bool
) -> MicroBatch:
    k = len(ids)
    row_counts, tokens, widths = [0] * k, [0] * k, [0] * k
    for g, ex in rows:
        row_counts[g] += 1
        tokens[g] += len(ex.input_ids)
        widths[g] = max(widths[g], len(ex.input_ids))
    one_row = isolate or not padded
    # each sequence's span: its own length (varlen), its group's longest or the micro-batch's
    spans = [widths[g] if isolate else max(widths) for g, _ in rows] if padded else [_length(r) for r in rows]
    total = sum(spans)
    input_ids = torch.full((total,), pad_id, dtype=torch.long)
    next_label = torch.full((total,), IGNORE_INDEX, dtype=torch.long)  # label of token t+1
    group_of = torch.zeros((total,), dtype=torch.long)
    offset = 0
    for (g, ex), span in zip(rows, spans):
        n = len(ex.input_ids)
        input_ids[offset : offset + n] = torch.as_tensor(ex.input_ids, dtype=torch.long)
        next_label[offset : offset + n - 1] = torch.as_tensor(ex.labels[1:n], dtype=torch.long)
        group_of[offset : offset + span] = g
        offset += span
    index = (next_label != IGNORE_INDEX).nonzero().squeeze(1)
    label_group = group_of[index]
    label_counts = torch.bincount(label_group, minlength=k).tolist()
    batch = MicroBatch(
        input_ids=to_device(input_ids.view(1, total) if one_row else input_ids.view(len(rows), -1), device),
        groups=[(a, row_counts[g]) for g, a in enumerate(ids)],
        label_index=to_device(index, device),
        targets=to_device(next_label[index], device),
        label_group=to_device(label_group, device),
        label_counts=label_counts,
        real_tokens=sum(tokens),
        tokens_per_group=tokens,
    )
    if one_row:
        positions = torch.cat([torch.arange(span, dtype=torch.long) for span in spans]).unsqueeze(0)
        cu = torch.tensor([0, *spans], dtype=torch.int64).cumsum(0).to(torch.int32)
        batch.position_ids = to_device(positions, device)
        batch.token_counts = [row_counts[g] * widths[g] for g in range(k)] if padded else tokens
        batch.cu_seqlens = to_device(cu, device)
        batch.max_seqlen = max(spans)
        if padded:
            batch.seq_runs = tuple((row_counts[g], widths[g]) for g in range(k) if row_counts[g])
        else:
            batch.seq_runs = tuple((1, span) for span in spans)
    return batch
