"""Save an adapter in PEFT's own format so ``PeftModel.from_pretrained(base, path)`` loads it.

In two steps when asked: the copy out of the pack (:func:`peft_adapter_files`, while the adapter
is in it) and the write (:meth:`PeftAdapterFiles.write`, any time later, from any thread).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
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


@dataclass(frozen=True)
class PeftAdapterFiles:
    """One adapter in PEFT's format, held in host memory until :meth:`write` puts it on disk."""

    tensors: dict[str, torch.Tensor]
    config: dict

    def write(self, directory: str | os.PathLike) -> Path:
        """Write ``adapter_config.json`` + ``adapter_model.safetensors``; atomic (temp dir + rename)."""
        directory = Path(directory)
        directory.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{directory.name}-", dir=directory.parent))
        try:
            save_file(self.tensors, tmp / "adapter_model.safetensors", metadata={"format": "pt"})
            (tmp / "adapter_config.json").write_text(json.dumps(self.config, indent=2, sort_keys=True))
        except BaseException:  # a full disk: nothing half-written stays
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        if directory.is_symlink():  # the earlier export's link to where the tracker keeps it
            directory.unlink()
        elif directory.exists():
            shutil.rmtree(directory)
        tmp.rename(directory)
        return directory


def peft_adapter_files(packed: PackedLoraModel, adapter_id: str, base_model_name: str) -> PeftAdapterFiles | None:
    """The adapter's weights copied to host memory, with its PEFT config; the pack may drop it next.

    A tensor-parallel pack's adapter is gathered whole: every rank of the group calls this, and
    rank 0 of the group gets the files (the others None).
    """
    tensors = host_copies(  # one page-locked buffer: cheaper to lock than one per tensor
        {f"{_PEFT_PREFIX}{key}": value.float() for key, value in packed.state_dict_of(adapter_id).items()},
        shared=True,
    )
    if packed.parallel is not None and packed.parallel.index != 0:
        return None
    return PeftAdapterFiles(tensors, peft_adapter_config(packed, adapter_id, base_model_name))


def export_peft_adapter(
    packed: PackedLoraModel, adapter_id: str, directory: str | os.PathLike, base_model_name: str
) -> Path:
    """:func:`peft_adapter_files` written to ``directory`` at once (by rank 0 of a tensor-parallel group)."""
    files = peft_adapter_files(packed, adapter_id, base_model_name)
    return Path(directory) if files is None else files.write(directory)
