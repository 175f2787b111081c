"""Log-likelihood of continuations under K adapters at once (multiple-choice scoring).

Requests do not depend on the adapter, so every distinct model input is built once and run
for every adapter: rows of all adapters share one forward, grouped by adapter for the packed
LoRA route. Inputs and read-out follow lm-eval's HF model exactly — the scored input is
``(context + continuation)[-(max_length + 1):][:-1]``, right-padded, no attention mask, and a
continuation's score is the sum of its tokens' log-softmax values at the last positions —
so the numbers equal ``HFLM`` + PEFT run per adapter. Requests whose inputs coincide (the
answer choices ``" no"``/``" yes"`` of one prompt) share a row, like HFLM's one-token cache.

Every adapter gets the same inputs, so on CUDA the adapters are routed in (rank, scaling) order
and each forward applies them as batched GEMMs per rank run (:mod:`~plora_hpo.evaluation.segment_gemms`);
the scores stay on the device until the last forward has been queued (one transfer, no sync
between forwards).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from plora_hpo.engine.packed_lora import PackedLoraModel
from plora_hpo.evaluation._model import decoder_of, hidden_states, model_device
from plora_hpo.evaluation.fast_paths import fast_forwards, segment_gemms_on
from plora_hpo.evaluation.frozen import frozen_adapter_weights
from plora_hpo.evaluation.residency import AdapterResidency, adapter_chunks

_HEAD_CHUNK = 2048  # positions per LM-head call: bounds the (positions × vocab) fp32 block


@dataclass(frozen=True)
class ScoreRequest:
    """Score ``continuation`` after ``context`` (token ids; ``context`` is non-empty)."""

    context: Sequence[int]
    continuation: Sequence[int]


@dataclass
class ScoringStats:
    forwards: int = 0
    rows: int = 0
    tokens: int = 0
    padded_tokens: int = 0
    seconds: float = 0.0
    unique_inputs: int = 0
    requests: int = 0


@dataclass
class _Input:
    tokens: tuple[int, ...]
    positions: int  # how many trailing positions any request reads
    readers: list[tuple[int, tuple[int, ...]]] = field(default_factory=list)  # (request, continuation)


def _inputs(requests: Sequence[ScoreRequest], max_length: int) -> list[_Input]:
    by_tokens: dict[tuple[int, ...], _Input] = {}
    for index, request in enumerate(requests):
        if not request.context or not request.continuation:
            raise ValueError(f"request {index} needs a non-empty context and continuation")
        whole = (tuple(request.context) + tuple(request.continuation))[-(max_length + 1) :]
        tokens = whole[:-1]
        continuation = tuple(request.continuation)[-len(tokens) :]
        item = by_tokens.setdefault(tokens, _Input(tokens, 0))
        item.positions = max(item.positions, len(continuation))
        item.readers.append((index, continuation))
    return list(by_tokens.values())


def score_continuations(
    packed: PackedLoraModel,
    adapter_ids: Sequence[str],
    requests: Sequence[ScoreRequest],
    *,
    batch_size: int,
    max_length: int,
    residency: AdapterResidency | None = None,
    pad_id: int = 0,
    stats: ScoringStats | None = None,
    progress: Callable[[int], None] | None = None,
) -> dict[str, list[tuple[float, bool]]]:
    """``{adapter: [(logprob, is_greedy) per request]}`` for every adapter and request.

    ``batch_size`` caps rows per forward across adapters. With a paging ``residency``, adapters
    are processed in groups that fit the device budget, each group resident for its batches.
    """
    stats = stats if stats is not None else ScoringStats()
    started = time.perf_counter()
    model = packed.model
    decoder, head = decoder_of(model), model.get_output_embeddings()
    device = model_device(model)
    items = sorted(_inputs(requests, max_length), key=lambda i: (-len(i.tokens), i.tokens))
    stats.unique_inputs += len(items)
    stats.requests += len(requests)

    paging = residency is not None and residency.paging
    ordered = _routing_order(packed, adapter_ids)
    chunks = adapter_chunks(residency, ordered) if paging else [ordered]
    reads: list[_Reads] = []
    gemms = segment_gemms_on(device)
    with fast_forwards(model):
        for group in chunks:
            if residency is not None:
                residency.ensure(group)
            with frozen_adapter_weights(packed, group, enabled=not paging, segment_gemms=gemms) as frozen:
                for sub in _split(group, batch_size):
                    per_adapter = max(1, batch_size // len(sub))
                    # prebuilt factors serve routes over the whole group (adapters of other turns: no rows)
                    order = group if frozen else sub
                    for start in range(0, len(items), per_adapter):
                        batch = items[start : start + per_adapter]
                        reads.append(_score_batch(decoder, head, packed, order, sub, batch, device, pad_id, stats))
                        if progress is not None:
                            progress(len(batch) * len(sub))

    results: dict[str, list[tuple[float, bool] | None]] = {a: [None] * len(requests) for a in adapter_ids}
    if reads:
        scores = torch.cat([r.scores for r in reads]).tolist()
        misses = torch.cat([r.misses for r in reads]).tolist()
        owners = [owner for r in reads for owner in r.owners]
        for (adapter_id, request), score, miss in zip(owners, scores, misses):
            results[adapter_id][request] = (score, miss == 0)
    stats.seconds += time.perf_counter() - started
    return {a: [r for r in rows if r is not None] for a, rows in results.items()}


def _routing_order(packed: PackedLoraModel, adapter_ids: Sequence[str]) -> list[str]:
    """Adapters of equal rank and scaling side by side: few, long runs for the batched GEMMs."""
    return sorted(adapter_ids, key=lambda a: (packed.configs[a].rank, packed.configs[a].scaling))


@dataclass
class _Reads:
    """One forward's answers, still on the device: ``owners[i]`` = (adapter, request) of entry i."""

    owners: list[tuple[str, int]]
    scores: torch.Tensor  # summed log-probabilities, fp32
    misses: torch.Tensor  # continuation tokens that are not the argmax; 0: greedy


def _split(adapters: list[str], most: int) -> list[list[str]]:
    """More adapters than rows per forward: score them in turns."""
    return [adapters[i : i + most] for i in range(0, len(adapters), most)]


@torch.no_grad()
def _score_batch(
    decoder: torch.nn.Module,
    head: torch.nn.Module,
    packed: PackedLoraModel,
    order: list[str],
    adapters: list[str],
    batch: list[_Input],
    device: torch.device,
    pad_id: int,
    stats: ScoringStats,
) -> _Reads:
    width = max(len(item.tokens) for item in batch)
    # every adapter's rows are the same right-padded inputs: sent once, repeated per adapter
    inputs = [t for item in batch for t in item.tokens + (pad_id,) * (width - len(item.tokens))]
    flat = []  # flat (row · width + position) indices whose next-token scores are read
    for a_index in range(len(adapters)):
        for i_index, item in enumerate(batch):
            row = (a_index * len(batch) + i_index) * width
            flat += range(row + len(item.tokens) - item.positions, row + len(item.tokens))
    # Every (adapter, request) read: its continuation's positions in ``flat``, gathered at once.
    read_pos, read_tok, read_id, owners = [], [], [], []
    cursor = 0
    for adapter_id in adapters:
        for item in batch:
            end = cursor + item.positions
            for request, continuation in item.readers:
                read_pos += range(end - len(continuation), end)
                read_tok += continuation
                read_id += [len(owners)] * len(continuation)
                owners.append((adapter_id, request))
            cursor = end
    inputs, flat, pos, tok, idx = _to_device(device, inputs, flat, read_pos, read_tok, read_id)
    ids = inputs.view(len(batch), width).repeat(len(adapters), 1)
    stats.forwards += 1
    stats.rows += ids.shape[0]
    stats.tokens += len(adapters) * sum(len(item.tokens) for item in batch)
    stats.padded_tokens += ids.numel()

    rows_of = dict.fromkeys(adapters, len(batch))
    with packed.route([(a, rows_of.get(a, 0)) for a in order]):
        hidden = hidden_states(decoder, ids)
    picked = hidden.reshape(-1, hidden.shape[-1])[flat]
    logprob = torch.empty(picked.shape[0], head.out_features, dtype=torch.float32, device=device)
    for start in range(0, picked.shape[0], _HEAD_CHUNK):
        logits = head(picked[start : start + _HEAD_CHUNK])
        logprob[start : start + _HEAD_CHUNK] = F.log_softmax(logits.float(), dim=-1)
    argmax = logprob.argmax(dim=-1)
    scores = torch.zeros(len(owners), dtype=torch.float32, device=device).index_add_(0, idx, logprob[pos, tok])
    misses = torch.zeros(len(owners), dtype=torch.long, device=device).index_add_(0, idx, (argmax[pos] != tok).long())
    return _Reads(owners, scores, misses)


def _to_device(device: torch.device, *lists: list[int]) -> list[torch.Tensor]:
    """The int lists as int64 tensors on ``device``: one (pinned, asynchronous) copy for all."""
    host = torch.tensor([v for values in lists for v in values], dtype=torch.long)
    if device.type == "cuda":
        host = host.pin_memory()
    return list(host.to(device, non_blocking=True).split([len(values) for values in lists]))
