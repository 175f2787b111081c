"""Fixtures: the embedded SmolLM2 with three adapters of different ranks, exported for PEFT too."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from plora_hpo.adapter import AdapterConfig
from plora_hpo.engine import PackedLoraModel, export_peft_adapter

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# Different ranks and scalings; B drawn at random so every adapter really changes the model.
ADAPTERS = {
    "r4": AdapterConfig(rank=4, alpha=8.0, learning_rate=1e-4, batch_size=1, seed=1),
    "r8": AdapterConfig(rank=8, alpha=8.0, learning_rate=1e-4, batch_size=1, seed=2),
    "r16": AdapterConfig(rank=16, alpha=32.0, learning_rate=1e-4, batch_size=1, seed=3, use_rslora=True),
}
B_STD = 0.03


def randomize_b(packed: PackedLoraModel, adapter_id: str, seed: int, std: float = B_STD) -> None:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for layer in packed.layers.values():
            b = layer.lora_B[adapter_id]
            b.copy_(torch.randn(b.shape, generator=generator) * std)


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Pin intra-op threads: fp32 reductions then do not depend on how work is split between
    threads (the parity tolerance is ~1e-5), and a shared 2-core machine is not oversubscribed."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@dataclass
class SmolPack:
    """SmolLM2 (fp32, CPU) wrapped with the three adapters; ``peft_dirs`` hold their PEFT exports."""

    packed: PackedLoraModel
    tokenizer: object
    base_dir: Path
    peft_dirs: dict[str, Path]


@pytest.fixture(scope="session")
def smol_pack(tmp_path_factory) -> SmolPack:
    from plora_hpo.models import embedded_cache_dir, load_base_model

    loaded = load_base_model("smollm2-135m", dtype=torch.float32, device="cpu")
    packed = PackedLoraModel(loaded.model, TARGETS)
    out = tmp_path_factory.mktemp("peft")
    dirs = {}
    for index, (adapter_id, config) in enumerate(ADAPTERS.items()):
        packed.add_adapter(adapter_id, config)
        randomize_b(packed, adapter_id, seed=100 + index)
        dirs[adapter_id] = export_peft_adapter(packed, adapter_id, out / adapter_id, loaded.name)
    return SmolPack(packed, loaded.tokenizer, embedded_cache_dir(), dirs)
