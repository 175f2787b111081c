"""What a base-model spec names, and the config it resolves to, without loading the model.

A spec is the embedded default (:data:`EMBEDDED_NAME`), a published shape with random weights
(``random:<shape>``), a local model folder or a Hugging Face Hub id. :func:`resolve_config`
finds a folder's or hub id's config with transformers' ``AutoConfig`` alone: a sweep checks its
model this way before anything loads, and a process that never loads the model (one whose
worker processes train) never imports the modeling code, seconds of imports.

Boundary: naming and configs; loading the weights is :mod:`plora_hpo.models`'.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Literal

from plora_hpo.errors import ModelError, first_line
from plora_hpo.shapes import MODEL_SHAPES

if TYPE_CHECKING:
    from transformers import PretrainedConfig

EMBEDDED_NAME = "smollm2-135m"
RANDOM_PREFIX = "random:"

Source = Literal["embedded", "hub", "local", "random"]


def _looks_like_path(spec: str) -> bool:
    return spec.startswith(("/", "./", "../", "~")) or Path(spec).expanduser().exists()


def _hub_offline() -> bool:
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)


def resolve_config(spec: str) -> tuple[str, PretrainedConfig, Source]:
    """The reference ``from_pretrained`` takes, the config and the source of a local directory or
    hub id; one-line :class:`~plora_hpo.errors.ModelError` for everything else."""
    from transformers import AutoConfig

    path = Path(spec).expanduser()
    if path.is_dir():
        ref, source = str(path.resolve()), "local"
    elif _looks_like_path(spec):
        raise ModelError(f"cannot load model {spec!r}: no such directory; pass a model folder or a hub id")
    else:
        ref, source = spec, "hub"
    try:
        config = AutoConfig.from_pretrained(ref)
    except (OSError, ValueError) as err:
        hint = f"; did you mean 'random:{spec.lower()}'?" if spec.lower() in MODEL_SHAPES else ""
        if source == "local":
            reason = f"the directory has no readable config.json ({first_line(err)})"
        elif _hub_offline():
            reason = "not a local directory and the Hugging Face Hub is unreachable (offline)"
        elif "connect" in str(err).lower():
            reason = "not a local directory and the Hugging Face Hub is unreachable (no connection)"
        else:
            reason = f"not a local directory and not loadable from the Hugging Face Hub ({first_line(err)})"
        raise ModelError(
            f"cannot load model {spec!r}: {reason}; pass a local path or use the embedded default "
            f"{EMBEDDED_NAME!r}{hint}"
        ) from None
    return ref, config, source
