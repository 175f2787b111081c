"""Hub ids and shape names map to the same decoder shape."""

from __future__ import annotations

import pytest

from plora_hpo.errors import ConfigError
from plora_hpo.planner.model_names import resolve_model, shape_name_for_model, shape_name_for_shape
from plora_hpo.shapes import shape_by_name


@pytest.mark.parametrize(
    ("model", "name"),
    [
        ("qwen2.5-7b", "qwen2.5-7b"),
        ("Qwen/Qwen2.5-7B-Instruct", "qwen2.5-7b"),
        ("random:qwen2.5-0.5b", "qwen2.5-0.5b"),
        ("meta-llama/Llama-3.1-8B-Instruct", "llama-3.1-8b"),
        ("HuggingFaceTB/SmolLM2-135M-Instruct", "smollm2-135m"),
        ("/models/Qwen2.5-3B/", "qwen2.5-3b"),
        ("mistralai/Mistral-7B-v0.3", None),
    ],
)
def test_shape_names(model, name):
    assert shape_name_for_model(model) == name


def test_resolve_and_reverse_lookup():
    name, shape = resolve_model("Qwen/Qwen2.5-1.5B")
    assert name == "qwen2.5-1.5b" and shape == shape_by_name(name) and shape_name_for_shape(shape) == name
    with pytest.raises(ConfigError, match="pass --model with one of: smollm2-135m"):
        resolve_model("gpt-9")
