"""Decoder shapes by name: what the cost model, the planner and random-init benchmarks need.

Importable with the standard library alone, so the planner runs without torch/transformers.
"""

from __future__ import annotations

from dataclasses import dataclass

TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class ModelShape:
    """Dimensions of a Llama-style decoder (Llama, Qwen2, Mistral, SmolLM2)."""

    family: str  # "llama" | "qwen2" | "mistral": the transformers model_type
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    vocab: int
    tie_embeddings: bool = False
    max_position_embeddings: int = 32768
    rope_theta: float = 1_000_000.0

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def linear_dims(self, module: str) -> tuple[int, int]:
        """(d_in, d_out) of one target projection."""
        h, i, kv = self.hidden, self.intermediate, self.kv_heads * self.head_dim
        dims = {
            "q_proj": (h, h),
            "k_proj": (h, kv),
            "v_proj": (h, kv),
            "o_proj": (h, h),
            "gate_proj": (h, i),
            "up_proj": (h, i),
            "down_proj": (i, h),
        }
        if module not in dims:
            raise KeyError(f"unknown target module {module!r}; choose from {', '.join(TARGET_MODULES)}")
        return dims[module]

    def decoder_linear_params(self) -> int:
        """Weights of all decoder projections (P in the 4·P·tokens FLOP count of a LoRA training step)."""
        per_layer = sum(a * b for a, b in (self.linear_dims(m) for m in TARGET_MODULES))
        return per_layer * self.layers

    def total_params(self) -> int:
        embed = self.vocab * self.hidden
        norms = (2 * self.layers + 1) * self.hidden
        return self.decoder_linear_params() + embed * (1 if self.tie_embeddings else 2) + norms

    def lora_params(self, rank: int, target_modules: tuple[str, ...] = TARGET_MODULES) -> int:
        """Parameters of one rank-``rank`` adapter on ``target_modules`` of every layer."""
        per_layer = sum(rank * (d_in + d_out) for d_in, d_out in map(self.linear_dims, target_modules))
        return per_layer * self.layers


# Real published shapes (config.json of each model); used for random-init benchmark models.
MODEL_SHAPES: dict[str, ModelShape] = {
    "smollm2-135m": ModelShape("llama", 576, 1536, 30, 9, 3, 49152, True, 8192, 100000.0),
    "qwen2.5-0.5b": ModelShape("qwen2", 896, 4864, 24, 14, 2, 151936, True),
    "qwen2.5-1.5b": ModelShape("qwen2", 1536, 8960, 28, 12, 2, 151936, True),
    "qwen2.5-3b": ModelShape("qwen2", 2048, 11008, 36, 16, 2, 151936, True),
    "qwen2.5-7b": ModelShape("qwen2", 3584, 18944, 28, 28, 4, 152064, False),
    "llama-3.2-3b": ModelShape("llama", 3072, 8192, 28, 24, 8, 128256, True, 131072, 500000.0),
    "llama-3.1-8b": ModelShape("llama", 4096, 14336, 32, 32, 8, 128256, False, 131072, 500000.0),
}


def shape_by_name(name: str) -> ModelShape:
    """Look up a named shape; the error lists the names that exist."""
    key = name.removeprefix("random:").lower()
    if key not in MODEL_SHAPES:
        raise KeyError(f"unknown model shape {name!r}; known shapes: {', '.join(MODEL_SHAPES)}")
    return MODEL_SHAPES[key]
