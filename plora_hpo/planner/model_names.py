"""Model names → decoder shapes, so a sweep's hub id plans (and calibrates) like its shape name.

Why: sweep files name hub ids (``Qwen/Qwen2.5-7B-Instruct``) or local paths, while the cost model
needs dimensions. Instruction-tuned and base variants share a shape, so the id's last path part
minus a variant suffix is looked up among :data:`plora_hpo.shapes.MODEL_SHAPES`.
"""

from __future__ import annotations

import re

from plora_hpo.errors import ConfigError
from plora_hpo.shapes import MODEL_SHAPES, ModelShape, shape_by_name

_VARIANT_SUFFIX = re.compile(r"-(instruct|chat|base|it)$")


def shape_name_for_model(model: str) -> str | None:
    """The MODEL_SHAPES name for a shape name, ``random:<shape>``, hub id or path; None if unknown.

    >>> shape_name_for_model("Qwen/Qwen2.5-7B-Instruct")
    'qwen2.5-7b'
    """
    key = model.strip().removeprefix("random:").rstrip("/").rsplit("/", 1)[-1].lower()
    key = _VARIANT_SUFFIX.sub("", key)
    return key if key in MODEL_SHAPES else None


def shape_name_for_shape(shape: ModelShape) -> str | None:
    """The MODEL_SHAPES name whose dimensions equal ``shape``; None for a shape not listed there."""
    return next((name for name, known in MODEL_SHAPES.items() if known == shape), None)


def resolve_model(model: str) -> tuple[str, ModelShape]:
    """(shape name, shape) for ``model`` (as :func:`shape_name_for_model` reads it); a one-line
    error lists the known shapes."""
    name = shape_name_for_model(model)
    if name is None:
        raise ConfigError(f"unknown model shape {model!r}; pass --model with one of: {', '.join(MODEL_SHAPES)}")
    return name, shape_by_name(name)
