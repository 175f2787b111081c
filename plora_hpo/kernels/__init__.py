"""Packed multi-LoRA operators: K adapters of mixed rank applied to their own token segments.

Importable with torch alone (Triton is optional): the engine, the evaluator and the GPU
benchmarks call :func:`adapted_linear` (base layer and adapters in one node),
:func:`packed_lora_add` or :func:`packed_lora` and get the Triton kernels on CUDA, the
pure-PyTorch reference elsewhere; :func:`compile_ahead` compiles a pass's Triton kernels on a
pool of threads instead of one by one as they are first launched.
"""

from plora_hpo.kernels._compiled import can_compile_ahead, compile_ahead
from plora_hpo.kernels.dispatch import adapted_linear, packed_lora, packed_lora_add
from plora_hpo.kernels.layout import SegmentLayout
from plora_hpo.kernels.torch_lora import adapted_linear_reference, packed_lora_reference

__all__ = [
    "SegmentLayout",
    "adapted_linear",
    "adapted_linear_reference",
    "can_compile_ahead",
    "compile_ahead",
    "packed_lora",
    "packed_lora_add",
    "packed_lora_reference",
]
