"""Calibration factors: how far real packs on one (model, GPU) sit from the analytic prior.

Why separate factors per term: launch-bound small models, compute-bound large models and the
memory of activations vs weights err in different directions; one global factor would trade one
error for another. All factors are 1.0 for the uncalibrated prior. The factors are fitted from
measured packs, stored and loaded by :mod:`plora_hpo.planner.observations`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields

TIME_FACTORS = ("launch", "fixed", "base", "lora", "optimizer", "comm")
MEMORY_FACTORS = ("memory_fixed", "memory_activations", "memory_adapters")


@dataclass(frozen=True)
class Calibration:
    """Multipliers on the prior's terms (see :class:`~plora_hpo.planner.cost_model.StepTerms`).

    Attributes:
        launch: × host launch seconds per step.
        fixed: × GPU seconds per step that do not grow with tokens.
        base: × base-model seconds (FLOPs and activation traffic).
        lora: × LoRA kernel and adapter-cast seconds.
        optimizer: × gradient clipping + AdamW + zeroing seconds (GPU).
        comm: × tensor-parallel all-reduce seconds (packs of degree > 1; fitted only once such
            packs have been measured, 1.0 until then).
        memory_fixed: × weights + reserve + logits chunk bytes.
        memory_activations: × saved activation bytes.
        memory_adapters: × adapter parameter, gradient and AdamW bytes.
        observations: how many measured packs the factors were fitted to (0: pure prior).
    """

    launch: float = 1.0
    fixed: float = 1.0
    base: float = 1.0
    lora: float = 1.0
    optimizer: float = 1.0
    comm: float = 1.0
    memory_fixed: float = 1.0
    memory_activations: float = 1.0
    memory_adapters: float = 1.0
    observations: int = 0

    def factors(self) -> dict[str, float]:
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "observations"}

    def to_dict(self) -> dict[str, float | int]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, float | int]) -> Calibration:
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})
