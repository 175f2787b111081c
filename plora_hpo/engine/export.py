"""Save an adapter in PEFT's own format so ``PeftModel.from_pretrained(base, path)`` loads it."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

from safetensors.torch import save_file

from plora_hpo.engine.host_copy import host_copies
from plora_hpo.engine.packed_lora import PackedLoraModel

_PEFT_PREFIX = "base_model.model."


def peft_adapter_config(packed: PackedLoraModel, adapter_id: str, base_model_name: str) -> dict:
    """The ``adapter_config.json`` fields PEFT's ``LoraConfig`` reads for this adapter."""
    config = packed.configs[adapter_id]
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model_name,
        "r": config.rank,
        "lora_alpha": config.alpha,
        "use_rslora": config.use_rslora,
        "lora_dropout": config.lora_dropout,
        "bias": "none",
        "target_modules": sorted(packed.target_modules),
        "fan_in_fan_out": False,
        "init_lora_weights": True,
        "inference_mode": True,
    }


def export_peft_adapter(
    packed: PackedLoraModel, adapter_id: str, directory: str | os.PathLike, base_model_name: str
) -> Path:
    """Write ``adapter_config.json`` + ``adapter_model.safetensors``; atomic (temp dir + rename).

    A tensor-parallel pack's adapter is written whole: every rank of the group calls this (the
    factors are gathered) and rank 0 of the group writes.
    """
    directory = Path(directory)
    tensors = host_copies(
        {f"{_PEFT_PREFIX}{key}": value.float() for key, value in packed.state_dict_of(adapter_id).items()}
    )
    if packed.parallel is not None and packed.parallel.index != 0:
        return directory
    directory.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{directory.name}-", dir=directory.parent))
    save_file(tensors, tmp / "adapter_model.safetensors", metadata={"format": "pt"})
    config = peft_adapter_config(packed, adapter_id, base_model_name)
    (tmp / "adapter_config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    if directory.is_symlink():  # the earlier export's link to where the tracker keeps it
        directory.unlink()
    elif directory.exists():
        shutil.rmtree(directory)
    tmp.rename(directory)
    return directory
