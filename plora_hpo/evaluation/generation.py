"""Greedy generation for K adapters with continuous batching over one KV cache.

Sequences of every adapter decode together, one token per row per step, rows grouped by
adapter so each forward routes every row through its own adapter. Finished sequences stop
counting at once; when enough slots are free (``refill_fraction`` of the batch), finished rows
are dropped and queued sequences join: they are prefilled in their own forward and their KV
rows are merged into the running cache (:mod:`~plora_hpo.evaluation.kv_cache`).

A sequence ends, as in lm-eval's HF model, at an end-of-sequence token, after
``max_new_tokens`` tokens, or when one of its stop strings appears in the decoded tail of
the generated tokens (lm-eval's window: the stop string's token count plus two). The result
is the generated token ids; callers cut the decoded text at the first stop string.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from plora_hpo.engine.packed_lora import PackedLoraModel
from plora_hpo.evaluation._model import (
    decoder_of,
    hidden_states,
    model_device,
    num_decoder_layers,
    run_lengths,
)
from plora_hpo.evaluation.attention import folded_decode_attention
from plora_hpo.evaluation.fast_paths import fast_forwards, segment_gemms_on
from plora_hpo.evaluation.frozen import frozen_adapter_weights, full_route
from plora_hpo.evaluation.kv_cache import RowKVCache, assemble
from plora_hpo.evaluation.residency import AdapterResidency

Decode = Callable[[list[list[int]]], list[str]]

# Forwards of at most this many tokens (decode steps: one per row) apply the adapters as two
# dense GEMMs on the GPU (plora_hpo.evaluation.frozen): fewer launches, no per-call planning.
DENSE_MAX_TOKENS = 1024


def _dense_tokens(device: torch.device) -> int:
    """The dense path's token cap: on CUDA only (on the CPU the segment path is kept, bit for bit)."""
    return DENSE_MAX_TOKENS if device.type == "cuda" else 0


@dataclass(frozen=True)
class GenerationJob:
    """One prompt (token ids) to continue greedily under one adapter."""

    adapter_id: str
    prompt: tuple[int, ...]
    max_new_tokens: int
    stop_strings: tuple[str, ...] = ()


@dataclass
class GenerationStats:
    prefill_forwards: int = 0
    prefill_tokens: int = 0  # real prompt tokens prefilled
    decode_steps: int = 0
    decode_rows: int = 0  # rows summed over decode steps (finished rows still in the batch count)
    generated_tokens: int = 0
    admissions: int = 0
    peak_rows: int = 0
    seconds: float = 0.0
    prefill_seconds: float = 0.0  # host wall time in prefill forwards (each ends in a device sync)
    decode_seconds: float = 0.0  # host wall time in decode steps (each ends in a device sync)


class StopWindows:
    """lm-eval's stop-string test on the last tokens of each sequence, decoded in one batch."""

    def __init__(self, decode: Decode, encode: Callable[[str], list[int]]) -> None:
        self.decode = decode
        self.encode = encode
        self._window: dict[str, int] = {}

    def window(self, strings: Sequence[str]) -> int:
        for s in strings:
            if s not in self._window:
                self._window[s] = len(self.encode(s)) + 2
        return max((self._window[s] for s in strings), default=0)

    def hits(self, tails: list[tuple[Sequence[str], list[int]]]) -> list[bool]:
        """For each (stop strings, generated tokens): does a stop string end the text so far?"""
        if not tails:
            return []
        windows = [tokens[-self.window(strings) :] for strings, tokens in tails]
        texts = self.decode(windows)
        return [any(s in text for s in strings) for (strings, _), text in zip(tails, texts)]


def stop_windows_for(tokenizer: object) -> StopWindows:
    """Stop-string checking with a Hugging Face tokenizer (decoded without skipping specials)."""
    return StopWindows(
        decode=lambda seqs: tokenizer.batch_decode(seqs, skip_special_tokens=False),
        encode=lambda s: tokenizer.encode(s, add_special_tokens=False),
    )


class _Batch:
    """The running rows: which job each row serves, grouped by adapter, and the KV cache."""

    def __init__(self) -> None:
        self.cache: RowKVCache | None = None
        self.jobs: list[int] = []
        self.adapters: list[str] = []
        self.live: list[bool] = []
        self.last: torch.Tensor | None = None

    @property
    def live_count(self) -> int:
        return sum(self.live)

    def live_adapters(self) -> set[str]:
        return {a for a, alive in zip(self.adapters, self.live) if alive}


def generate_greedy(
    packed: PackedLoraModel,
    jobs: Sequence[GenerationJob],
    *,
    max_batch_size: int,
    eos_token_ids: Sequence[int] = (),
    stop_windows: StopWindows | None = None,
    residency: AdapterResidency | None = None,
    prefill_tokens: int = 8192,
    refill_fraction: float = 0.25,
    stats: GenerationStats | None = None,
    progress: Callable[[int], None] | None = None,
) -> list[list[int]]:
    """Generated token ids for every job (in ``jobs`` order).

    Jobs join the batch in the order given (callers sort them, e.g. by adapter then length).
    ``prefill_tokens`` bounds rows × padded length of one prefill forward; ``refill_fraction``
    is the share of the batch that must be free before finished rows are swapped for new ones
    (each refill copies the KV cache once, so refilling every step would cost more than it saves).
    """
    if max_batch_size < 1:
        raise ValueError(f"max_batch_size must be ≥ 1, got {max_batch_size}")
    if any(j.max_new_tokens < 1 or not j.prompt for j in jobs):
        raise ValueError("every job needs a non-empty prompt and max_new_tokens ≥ 1")
    if any(j.stop_strings for j in jobs) and stop_windows is None:
        raise ValueError("jobs with stop strings need stop_windows (a tokenizer to decode with)")
    stats = stats if stats is not None else GenerationStats()
    started = time.perf_counter()
    engine = _Engine(
        packed,
        jobs,
        max_rows=max_batch_size,
        eos=set(eos_token_ids),
        stop_windows=stop_windows,
        residency=residency,
        prefill_tokens=prefill_tokens,
        refill_fraction=refill_fraction,
        stats=stats,
        progress=progress,
    )
    paging = residency is not None and residency.paging
    dense, gemms = _dense_tokens(engine.device), segment_gemms_on(engine.device)
    with (
        torch.no_grad(),
        folded_decode_attention(packed.model),
        fast_forwards(packed.model),
        frozen_adapter_weights(
            packed, engine.order, enabled=not paging, dense_max_tokens=dense, segment_gemms=gemms
        ) as frozen,
    ):
        engine.frozen = frozen
        engine.run()
    stats.seconds += time.perf_counter() - started
    return engine.outputs


class _Engine:
    """The scheduling loop of :func:`generate_greedy` (admission, prefill, decode, stops)."""

    def __init__(
        self,
        packed: PackedLoraModel,
        jobs: Sequence[GenerationJob],
        *,
        max_rows: int,
        eos: set[int],
        stop_windows: StopWindows | None,
        residency: AdapterResidency | None,
        prefill_tokens: int,
        refill_fraction: float,
        stats: GenerationStats,
        progress: Callable[[int], None] | None,
    ) -> None:
        self.packed, self.jobs, self.eos = packed, list(jobs), eos
        self.max_rows = max_rows
        self.stop_windows, self.residency = stop_windows, residency
        self.prefill_tokens, self.stats, self.progress = prefill_tokens, stats, progress
        self.refill_at = max(1, math.ceil(refill_fraction * max_rows))
        model = packed.model
        self.decoder, self.head = decoder_of(model), model.get_output_embeddings()
        self.device = model_device(model)
        self.layers = num_decoder_layers(model)
        self.order = list(dict.fromkeys(j.adapter_id for j in jobs))
        self.rank_of = {a: i for i, a in enumerate(self.order)}
        self.frozen = False  # routes list every adapter (prebuilt factors) instead of those present
        self.queue = deque(range(len(jobs)))
        self.outputs: list[list[int]] = [[] for _ in jobs]
        self.batch = _Batch()

    # --- the loop ---------------------------------------------------------------------------
    def run(self) -> None:
        while self.queue or self.batch.live_count:
            live = self.batch.live_count
            free = self.max_rows - live
            dead = len(self.batch.live) - live
            if self.queue and (live == 0 or free >= min(self.refill_at, len(self.queue))):
                self._refill(free)
            elif dead and dead >= len(self.batch.live) // 2:
                self._refill(0)  # drop finished rows without admitting anyone
            if self.batch.live_count:
                self._decode_step()

    def _admissible(self, free: int) -> list[int]:
        """Queued jobs that join now: FIFO, while slots are free and their adapters fit."""
        chosen: list[int] = []
        adapters = self.batch.live_adapters()
        while self.queue and len(chosen) < free:
            adapter_id = self.jobs[self.queue[0]].adapter_id
            if self.residency is not None and not self.residency.fits(adapters | {adapter_id}):
                break
            adapters.add(adapter_id)
            chosen.append(self.queue.popleft())
        return chosen

    def _refill(self, free: int) -> None:
        """Drop finished rows, prefill joiners and merge everyone into one adapter-grouped cache."""
        batch = self.batch
        joiners = self._admissible(free)
        survivors = [r for r, alive in enumerate(batch.live) if alive]
        if not joiners and len(survivors) == len(batch.live):
            return
        if self.residency is not None:
            self.residency.ensure(sorted(batch.live_adapters() | {self.jobs[j].adapter_id for j in joiners}))
        joiners.sort(key=lambda j: self.rank_of[self.jobs[j].adapter_id])
        prefills = self._prefill(joiners)

        # Rows of the new batch: survivors (kind 0) and joiners (kind 1), grouped by adapter.
        members = [(batch.jobs[r], 0, i) for i, r in enumerate(survivors)]
        members += [(j, 1, i) for i, j in enumerate(joiners)]
        members.sort(key=lambda m: (self.rank_of[self.jobs[m[0]].adapter_id], m[1], m[2]))
        target = {(kind, i): row for row, (_, kind, i) in enumerate(members)}
        rows = len(members)
        last = torch.zeros(rows, dtype=torch.long, device=self.device)
        sources = []
        if survivors:
            src = torch.tensor(survivors, device=self.device)
            dst = torch.tensor([target[(0, i)] for i in range(len(survivors))], device=self.device)
            sources.append((batch.cache, src, dst))
            last[dst] = batch.last[src]
        offset = 0
        for cache, first_tokens in prefills:
            dst = torch.tensor([target[(1, offset + i)] for i in range(cache.rows)], device=self.device)
            sources.append((cache, torch.arange(cache.rows, device=self.device), dst))
            last[dst] = first_tokens
            offset += cache.rows
        row_jobs = [job for job, _, _ in members]
        headroom = max(self.jobs[j].max_new_tokens - len(self.outputs[j]) for j in row_jobs)
        batch.cache = assemble(sources, rows=rows, headroom=headroom)
        batch.jobs = row_jobs
        batch.adapters = [self.jobs[j].adapter_id for j in row_jobs]
        batch.last = last
        batch.live = [True] * rows
        self.stats.admissions += bool(joiners)
        self.stats.peak_rows = max(self.stats.peak_rows, rows)
        if joiners:
            first = torch.cat([tokens for _, tokens in prefills]).tolist()
            self._advance([(target[(1, i)], j, first[i]) for i, j in enumerate(joiners)])

    def _prefill(self, joiners: list[int]) -> list[tuple[RowKVCache, torch.Tensor]]:
        """Prefill joiners in forwards of ≤ ``prefill_tokens`` padded tokens; (cache, first token)."""
        out = []
        start = 0
        while start < len(joiners):
            end = start + 1
            width = len(self.jobs[joiners[start]].prompt)
            while end < len(joiners):
                w = max(width, len(self.jobs[joiners[end]].prompt))
                if w * (end - start + 1) > self.prefill_tokens:
                    break
                width, end = w, end + 1
            out.append(self._prefill_chunk(joiners[start:end], width))
            start = end
        return out

    def _groups(self, row_adapters: list[str]) -> list[tuple[str, int]]:
        """Route groups for rows grouped by adapter: every adapter (prebuilt factors) or those present."""
        return full_route(row_adapters, self.order) if self.frozen else run_lengths(row_adapters)

    def _prefill_chunk(self, chunk: list[int], width: int) -> tuple[RowKVCache, torch.Tensor]:
        started = time.perf_counter()
        prompts = [self.jobs[j].prompt for j in chunk]
        ids = torch.tensor([(0,) * (width - len(p)) + p for p in prompts], dtype=torch.long)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], dtype=torch.long)
        ids, mask = ids.to(self.device, non_blocking=True), mask.to(self.device, non_blocking=True)
        positions = (mask.cumsum(-1) - 1).clamp_min(0)
        cache = RowKVCache(self.layers)
        with self.packed.route(self._groups([self.jobs[j].adapter_id for j in chunk])):
            hidden = hidden_states(self.decoder, ids, attention_mask=mask, position_ids=positions, cache=cache)
        cache.real_len = mask.sum(-1)
        pad = mask == 0
        if pad.any():
            for layer in cache.layers:
                layer.zero_columns(pad)
        first = self.head(hidden[:, -1]).argmax(dim=-1)
        self.stats.prefill_forwards += 1
        self.stats.prefill_tokens += sum(map(len, prompts))
        if first.is_cuda:
            torch.cuda.synchronize(first.device)  # so prefill_seconds is device time, not launch time
        self.stats.prefill_seconds += time.perf_counter() - started
        return cache, first

    def _decode_step(self) -> None:
        started = time.perf_counter()
        batch = self.batch
        cache = batch.cache
        mask = cache.attention_mask(extra=1)
        positions = cache.real_len[:, None]
        with self.packed.route(self._groups(batch.adapters)):
            hidden = hidden_states(
                self.decoder, batch.last[:, None], attention_mask=mask, position_ids=positions, cache=cache
            )
        cache.real_len = cache.real_len + 1
        batch.last = self.head(hidden[:, -1]).argmax(dim=-1)
        tokens = batch.last.tolist()
        self.stats.decode_seconds += time.perf_counter() - started
        self.stats.decode_steps += 1
        self.stats.decode_rows += len(tokens)
        self._advance([(row, batch.jobs[row], tokens[row]) for row, alive in enumerate(batch.live) if alive])

    def _advance(self, steps: list[tuple[int, int, int]]) -> None:
        """Append each live row's new token; mark rows whose sequence has ended."""
        to_check = []
        for row, job_index, token in steps:
            job = self.jobs[job_index]
            out = self.outputs[job_index]
            out.append(token)
            self.stats.generated_tokens += 1
            if token in self.eos or len(out) >= job.max_new_tokens:
                self._finish(row)
            elif job.stop_strings:
                to_check.append((row, job_index))
        if to_check:
            hits = self.stop_windows.hits([(self.jobs[j].stop_strings, self.outputs[j]) for _, j in to_check])
            for (row, _), hit in zip(to_check, hits):
                if hit:
                    self._finish(row)

    def _finish(self, row: int) -> None:
        self.batch.live[row] = False
        if self.progress is not None:
            self.progress(1)
