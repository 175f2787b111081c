"""An adapter's A is drawn by its device's generator from the adapter's seed; B starts at zero."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM

from plora_hpo.adapter import AdapterConfig
from plora_hpo.engine.packed_lora import PackedLoraModel

CUDA = pytest.param(
    "cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
)


@pytest.mark.parametrize("device", ["cpu", CUDA])
def test_a_is_the_device_generator_s_draw_for_the_adapter_s_seed(device):
    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2)  # fmt: skip
    with torch.device(device):
        model = LlamaForCausalLM(config)
    packed = PackedLoraModel(model, ["q_proj", "down_proj"])
    packed.add_adapter("t0", AdapterConfig(8, 8.0, 1e-4, 2, seed=5))

    generator = torch.Generator(device=device).manual_seed(5)
    for layer in packed.layers.values():  # drawn layer after layer, in the model's order
        expected = torch.empty(8, layer.in_features, device=device)
        nn.init.kaiming_uniform_(expected, a=math.sqrt(5), generator=generator)
        assert layer.lora_A["t0"].device.type == device
        torch.testing.assert_close(layer.lora_A["t0"].data, expected, rtol=0, atol=0)
        assert not layer.lora_B["t0"].any()
