"""A short way to make adapter configs in planner tests."""

from __future__ import annotations

from plora_hpo.adapter import AdapterConfig


def config(rank: int = 16, batch: int = 2, seed: int = 0) -> AdapterConfig:
    return AdapterConfig(rank=rank, alpha=rank, learning_rate=1e-4, batch_size=batch, seed=seed)
