"""The packed training engine: torch + transformers only (runs on the GPU image as is)."""

from plora_hpo.engine.batching import DataStream
from plora_hpo.engine.export import export_peft_adapter
from plora_hpo.engine.packed_lora import FrozenFactors, PackedLoraLinear, PackedLoraModel
from plora_hpo.engine.trainer import AdapterJob, OptimizerSettings, PackedTrainer, PackStats, StepReport

__all__ = [
    "AdapterJob",
    "DataStream",
    "FrozenFactors",
    "OptimizerSettings",
    "PackStats",
    "PackedLoraLinear",
    "PackedLoraModel",
    "PackedTrainer",
    "StepReport",
    "export_peft_adapter",
]
