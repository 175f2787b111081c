"""lm-eval models for K adapters of one packed base: a shared server and one view per adapter.

lm-eval scores one model per ``evaluate()`` call, but its requests never depend on the model:
every adapter is asked the same prompts. So :class:`MultiAdapterServer` answers a request list
for all K adapters in one batched pass, and :class:`AdapterView` (an lm-eval ``LM`` for one
adapter) hands lm-eval its adapter's answers. ``evaluate()`` runs once per view and does all
filtering and metric aggregation itself; only the first view triggers model work, the others
read the stored answers.

Tokenisation, truncation, stop sequences and post-processing follow lm-eval's ``HFLM``
(``lm_eval.models.huggingface``) so each adapter scores what ``HFLM`` + PEFT would.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from lm_eval.api.model import TemplateLM
from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs, postprocess_generated_text
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

from plora_hpo.engine.packed_lora import PackedLoraModel
from plora_hpo.evaluation._model import model_device
from plora_hpo.evaluation.generation import (
    GenerationJob,
    GenerationStats,
    generate_greedy,
    stop_windows_for,
)
from plora_hpo.evaluation.residency import AdapterResidency, PagingStats, adapter_chunks
from plora_hpo.evaluation.scoring import ScoreRequest, ScoringStats, score_continuations

_DEFAULT_MAX_LENGTH = 2048  # HFLM's fallback when neither config nor tokenizer names one
_TOKENIZER_UNBOUNDED = 10**20


@dataclass
class ServerStats:
    """What the shared passes cost (summed over calls)."""

    scoring: ScoringStats = field(default_factory=ScoringStats)
    generation: GenerationStats = field(default_factory=GenerationStats)
    paging: PagingStats = field(default_factory=PagingStats)
    requests: dict[str, int] = field(default_factory=dict)


def _max_length(model: Any, tokenizer: Any) -> int:
    """The context length HFLM would use: config, then tokenizer, then 2048."""
    config = model.config.get_text_config(decoder=True)
    for attr in ("n_positions", "max_position_embeddings", "n_ctx"):
        value = getattr(config, attr, None)
        if value is not None:
            return int(value)
    limit = getattr(tokenizer, "model_max_length", None)
    if limit is not None and limit < _TOKENIZER_UNBOUNDED:
        return int(limit)
    return _DEFAULT_MAX_LENGTH


def _eos_ids(model: Any, tokenizer: Any) -> set[int]:
    """Tokens that end a sequence: HF ``generate`` stops at the generation config's EOS ids,
    lm-eval's stop criteria at the tokenizer's EOS text; with one prompt per batch both are a stop."""
    ids: set[int] = set()
    configured = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if configured is not None:
        ids.update([configured] if isinstance(configured, int) else configured)
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    return ids


def _gen_key(context: str, gen_kwargs: dict) -> str:
    return json.dumps([context, gen_kwargs], sort_keys=True, default=str)


class MultiAdapterServer:
    """Answers lm-eval requests for every adapter at once and keeps the answers.

    Args:
        packed: the packed model (adapters already trained or loaded).
        tokenizer: the base model's Hugging Face tokenizer.
        adapter_ids: adapters to serve, in routing order.
        batch_size: rows per forward, across adapters (also the most sequences decoding at once).
        max_gen_toks: generation cap for requests that do not set one (HFLM's default is 256).
        max_length: context length; default as HFLM derives it from the model config.
        add_bos_token: as HFLM's ``add_bos_token`` (``None``: the tokenizer's default).
        adapter_memory_budget: bytes of adapter weights allowed on the device at once; beyond
            it adapters are paged from host memory per batch (``None``: no paging).
        prefill_tokens: most padded tokens in one generation prefill forward.
        refill_fraction: share of generation slots that must be free before new sequences join.
    """

    def __init__(
        self,
        packed: PackedLoraModel,
        tokenizer: Any,
        adapter_ids: Sequence[str],
        *,
        batch_size: int = 32,
        max_gen_toks: int = 256,
        max_length: int | None = None,
        add_bos_token: bool | None = None,
        adapter_memory_budget: int | None = None,
        prefill_tokens: int = 8192,
        refill_fraction: float = 0.25,
    ) -> None:
        unknown = [a for a in adapter_ids if a not in packed.configs]
        if unknown:
            raise ValueError(f"adapters {unknown} are not in the packed model (have {packed.adapter_ids})")
        if not adapter_ids:
            raise ValueError("give at least one adapter id to evaluate")
        self.packed = packed
        self.tokenizer = tokenizer
        self.adapter_ids = list(dict.fromkeys(adapter_ids))
        self.batch_size = batch_size
        self.max_gen_toks = max_gen_toks
        self.max_length = max_length or _max_length(packed.model, tokenizer)
        self.add_bos_token = add_bos_token
        self.adapter_memory_budget = adapter_memory_budget
        self.prefill_tokens = prefill_tokens
        self.refill_fraction = refill_fraction
        self.eos_ids = _eos_ids(packed.model, tokenizer)
        self.answers: dict[str, dict[tuple, Any]] = {a: {} for a in self.adapter_ids}
        self.stats = ServerStats()

    def view(self, adapter_id: str) -> AdapterView:
        return AdapterView(self, adapter_id)

    def _residency(self) -> AdapterResidency:
        return AdapterResidency(self.packed, self.adapter_ids, budget_bytes=self.adapter_memory_budget)

    def _count(self, kind: str, n: int) -> None:
        self.stats.requests[kind] = self.stats.requests.get(kind, 0) + n

    # --- loglikelihood -----------------------------------------------------------------------
    def score(self, requests: list[tuple[tuple[str, str] | None, list[int], list[int]]]) -> None:
        """Score tokenised (key, context, continuation) requests for every adapter; store by key."""
        self._count("loglikelihood", len(requests))
        per_adapter = self._score_tokens([(ctx, cont) for _, ctx, cont in requests])
        for adapter_id, answers in per_adapter.items():
            store = self.answers[adapter_id]
            for (key, _, _), answer in zip(requests, answers):
                store[("loglikelihood", key)] = answer

    def _score_tokens(self, pairs: list[tuple[list[int], list[int]]]) -> dict[str, list[tuple[float, bool]]]:
        residency = self._residency()
        with residency:
            out = score_continuations(
                self.packed,
                self.adapter_ids,
                [ScoreRequest(ctx, cont) for ctx, cont in pairs],
                batch_size=self.batch_size,
                max_length=self.max_length,
                residency=residency,
                pad_id=0,  # HFLM pads scored inputs with 0 (no attention mask: causal, right padding)
                stats=self.stats.scoring,
            )
        self._add_paging(residency)
        return out

    def score_rolling(self, strings: list[str], token_lists: list[list[int]], prefix_token_id: int) -> None:
        """Whole-string log-likelihoods in HFLM's disjoint rolling windows, for every adapter."""
        self._count("loglikelihood_rolling", len(strings))
        windows, owner = [], []
        for index, tokens in enumerate(token_lists):
            for window in get_rolling_token_windows(
                token_list=tokens, prefix_token=prefix_token_id, max_seq_len=self.max_length, context_len=1
            ):
                windows.append(make_disjoint_window(window))
                owner.append(index)
        per_adapter = self._score_tokens(windows)
        for adapter_id, answers in per_adapter.items():
            totals = [0.0] * len(strings)
            for index, (logprob, _) in zip(owner, answers):
                totals[index] += logprob
            for string, total in zip(strings, totals):
                self.answers[adapter_id][("loglikelihood_rolling", string)] = total

    # --- generation --------------------------------------------------------------------------
    def generate(self, requests: list[tuple[str, dict]], encode: Any) -> None:
        """Greedy ``generate_until`` for every adapter (continuous batching across adapters)."""
        self._count("generate_until", len(requests))
        eos_text = self.tokenizer.decode(self.tokenizer.eos_token_id, skip_special_tokens=False)
        prepared = []
        for context, gen_kwargs in requests:
            kwargs = normalize_gen_kwargs(gen_kwargs, self.max_gen_toks)
            if kwargs.get("do_sample"):
                raise NotImplementedError("the multi-adapter evaluator decodes greedily (do_sample=False) only")
            until = handle_stop_sequences(kwargs.pop("until", None), eos=eos_text)
            max_gen_toks = int(kwargs.pop("max_gen_toks"))
            room = self.max_length - max_gen_toks
            if room <= 0:
                raise ValueError(f"max_gen_toks {max_gen_toks} leaves no room in max length {self.max_length}")
            prompt = tuple(encode(context)[-room:])
            prepared.append((_gen_key(context, gen_kwargs), prompt, max_gen_toks, tuple(until)))
        # Longest prompts first (as HFLM orders them); adapters in groups that fit the budget.
        order = sorted(range(len(prepared)), key=lambda i: -len(prepared[i][1]))
        residency = self._residency()
        groups = adapter_chunks(residency, self.adapter_ids) if residency.paging else [self.adapter_ids]
        jobs, owners = [], []
        for group in groups:
            for i in order:
                _, prompt, max_gen_toks, until = prepared[i]
                for adapter_id in group:
                    jobs.append(GenerationJob(adapter_id, prompt, max_gen_toks, until))
                    owners.append((adapter_id, i))
        with residency:
            outputs = generate_greedy(
                self.packed,
                jobs,
                max_batch_size=self.batch_size,
                eos_token_ids=sorted(self.eos_ids),
                stop_windows=stop_windows_for(self.tokenizer),
                residency=residency,
                prefill_tokens=self.prefill_tokens,
                refill_fraction=self.refill_fraction,
                stats=self.stats.generation,
            )
        self._add_paging(residency)
        for (adapter_id, i), tokens in zip(owners, outputs):
            key, _, _, until = prepared[i]
            text = self.tokenizer.decode(tokens, skip_special_tokens=True)
            self.answers[adapter_id][("generate_until", key)] = postprocess_generated_text(
                generation=text, stop=list(until), think_end_token=None
            )

    def _add_paging(self, residency: AdapterResidency) -> None:
        self.stats.paging.swaps_in += residency.stats.swaps_in
        self.stats.paging.swaps_out += residency.stats.swaps_out
        self.stats.paging.bytes_in += residency.stats.bytes_in


class AdapterView(TemplateLM):
    """lm-eval's model for one adapter; answers come from the shared server's batched passes."""

    def __init__(self, server: MultiAdapterServer, adapter_id: str) -> None:
        super().__init__()
        if adapter_id not in server.answers:
            raise ValueError(f"adapter {adapter_id!r} is not served (serving {server.adapter_ids})")
        self.server = server
        self.adapter_id = adapter_id
        self.tokenizer = server.tokenizer
        self._device = model_device(server.packed.model)

    # --- tokenisation, as HFLM ---------------------------------------------------------------
    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_token_id

    @property
    def prefix_token_id(self) -> int:
        bos = self.tokenizer.bos_token_id
        return bos if bos is not None else self.tokenizer.eos_token_id

    @property
    def max_length(self) -> int:
        return self.server.max_length

    @property
    def max_gen_toks(self) -> int:
        return self.server.max_gen_toks

    @property
    def tokenizer_name(self) -> str:
        return str(getattr(self.tokenizer, "name_or_path", "tokenizer")).replace("/", "__")

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs: Any) -> list[int]:
        if add_special_tokens is None:
            add_special_tokens = self.server.add_bos_token
            if string.startswith(self.tokenizer.decode(self.prefix_token_id)):
                add_special_tokens = False  # the text already starts with BOS
        kw = {} if add_special_tokens is None else {"add_special_tokens": add_special_tokens}
        return self.tokenizer.encode(string, **kw)

    def _encode_prompt(self, string: str) -> list[int]:
        """A generation context, encoded as HFLM's ``tok_batch_encode`` does (before padding)."""
        bos = getattr(self.tokenizer, "bos_token", None)
        if bos is not None and string.startswith(bos):
            kw = {"add_special_tokens": False}
        elif self.server.add_bos_token is not None:
            kw = {"add_special_tokens": self.server.add_bos_token}
        else:
            kw = {}
        return self.tokenizer(string, **kw)["input_ids"]

    # --- requests ----------------------------------------------------------------------------
    def loglikelihood(self, requests: list, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        store = self.server.answers[self.adapter_id]
        missing = [r for r in requests if ("loglikelihood", r.args) not in store]
        if missing:
            super().loglikelihood(missing, disable_tqdm=True)  # tokenises, then _loglikelihood_tokens
        return [store[("loglikelihood", r.args)] for r in requests]

    def _loglikelihood_tokens(self, requests: list, **kwargs: Any) -> list[tuple[float, bool]]:
        self.server.score([(tuple(key), ctx, cont) for key, ctx, cont in requests])
        store = self.server.answers[self.adapter_id]
        return [store[("loglikelihood", tuple(key))] for key, _, _ in requests]

    def loglikelihood_rolling(self, requests: list, disable_tqdm: bool = False) -> list[float]:
        store = self.server.answers[self.adapter_id]
        missing = list(dict.fromkeys(r.args[0] for r in requests if ("loglikelihood_rolling", r.args[0]) not in store))
        if missing:
            self.server.score_rolling(missing, [self.tok_encode(s) for s in missing], self.prefix_token_id)
        return [store[("loglikelihood_rolling", r.args[0])] for r in requests]

    def generate_until(self, requests: list, disable_tqdm: bool = False) -> list[str]:
        store = self.server.answers[self.adapter_id]
        missing: dict[str, tuple[str, dict]] = {}
        for r in requests:
            context, gen_kwargs = r.args
            key = _gen_key(context, gen_kwargs)
            if ("generate_until", key) not in store:
                missing[key] = (context, gen_kwargs)
        if missing:
            self.server.generate(list(missing.values()), self._encode_prompt)
        return [store[("generate_until", _gen_key(*r.args))] for r in requests]
