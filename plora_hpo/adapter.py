"""One trial's LoRA hyperparameters: the unit the sampler proposes and the planner packs."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class AdapterConfig:
    """Hyperparameters of one adapter (one Optuna trial).

    Attributes:
        rank: LoRA rank r (rows of A, columns of B).
        alpha: LoRA alpha; the update is scaled by ``alpha / rank`` (``alpha / sqrt(rank)`` with rsLoRA).
        learning_rate: peak AdamW learning rate of this adapter's parameter group.
        batch_size: sequences of this adapter in every packed step.
        seed: seeds this adapter's A initialisation and its data order.
        use_rslora: rank-stabilised scaling, as PEFT's ``use_rslora``.
        lora_dropout: dropout probability on the adapter's input while it trains, as PEFT's
            ``lora_dropout`` (the base layer sees the input undropped; evaluation drops nothing).
    """

    rank: int
    alpha: float
    learning_rate: float
    batch_size: int
    seed: int = 0
    use_rslora: bool = False
    lora_dropout: float = 0.0

    def __post_init__(self) -> None:
        for name in ("rank", "alpha", "learning_rate", "batch_size"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be a positive number, got {value!r}")
        if int(self.rank) != self.rank or int(self.batch_size) != self.batch_size:
            raise ValueError(f"rank and batch_size must be integers, got {self.rank!r}, {self.batch_size!r}")
        if not (isinstance(self.lora_dropout, (int, float)) and 0 <= self.lora_dropout < 1):
            raise ValueError(f"lora_dropout must be in [0, 1), got {self.lora_dropout!r}")

    @property
    def scaling(self) -> float:
        return self.alpha / (math.sqrt(self.rank) if self.use_rslora else self.rank)

    def as_params(self) -> dict[str, float | int | bool]:
        """Flat dict for logging (MLflow params, Optuna user attrs)."""
        return asdict(self)

    def label(self) -> str:
        """Short human-readable id, e.g. ``r16-a16-lr2e-04-b2`` (``…-b2-d0.1`` with dropout)."""
        dropout = f"-d{self.lora_dropout:g}" if self.lora_dropout else ""
        return f"r{self.rank}-a{self.alpha:g}-lr{self.learning_rate:.0e}-b{self.batch_size}{dropout}"
