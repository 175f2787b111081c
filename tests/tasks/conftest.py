"""Fixtures for task tests: a private cache, the embedded tokenizer, an offline Hub."""

from __future__ import annotations

from pathlib import Path

import pytest

from plora_hpo.tasks import DATA_DIR_ENV
from plora_hpo.tasks._cache import CACHE_ENV


@pytest.fixture(scope="package", autouse=True)
def private_cache(tmp_path_factory) -> Path:
    """Converted data and task YAMLs go to a fresh cache; no data directory unless a test sets one."""
    path = tmp_path_factory.mktemp("plora-task-cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(CACHE_ENV, str(path))
        mp.delenv(DATA_DIR_ENV, raising=False)
        yield path


@pytest.fixture(scope="package")
def tokenizer():
    """SmolLM2's tokenizer read straight from the GGUF (seconds; no model dequantization)."""
    from transformers import AutoTokenizer

    from plora_hpo.models import _prepare_tokenizer, embedded_gguf_path

    gguf = embedded_gguf_path()
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    _prepare_tokenizer(tok)
    return tok


@pytest.fixture
def offline_hub(monkeypatch):
    """Make the Hub unreachable the way HF_HUB_OFFLINE=1 does, even if datasets was imported earlier."""
    import datasets.config
    import huggingface_hub.constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
