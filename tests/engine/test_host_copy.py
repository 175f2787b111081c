"""Host copies of device tensors: equal values, own memory, contiguous; page-locked from a GPU."""

from __future__ import annotations

import pytest
import torch

from plora_hpo.engine.host_copy import host_copies

CUDA = pytest.param(
    "cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
)


@pytest.mark.parametrize("device", ["cpu", CUDA])
def test_copies_are_equal_contiguous_and_independent(device):
    generator = torch.Generator(device=device).manual_seed(0)
    packed = torch.randn(64, 48, device=device, generator=generator)
    tensors = {
        "slice": packed[8:24],  # a view into a packed buffer, as an adapter's factor is
        "transposed": packed.t(),
        "bf16": packed[:4].to(torch.bfloat16),
        ("moment", 3): torch.randn(5, device=device, generator=generator),
        "step": torch.tensor(7.0),  # AdamW's step count stays on the host
    }
    copies = host_copies(tensors)

    assert list(copies) == list(tensors)
    for key, tensor in tensors.items():
        copy = copies[key]
        assert copy.device.type == "cpu" and copy.dtype == tensor.dtype and copy.shape == tensor.shape
        assert copy.is_contiguous()
        assert torch.equal(copy, tensor.cpu())
        assert copy.is_pinned() == (tensor.device.type == "cuda")
    before = copies["slice"].clone()
    packed.add_(1.0)  # training goes on after the capture: the copy must not follow
    assert torch.equal(copies["slice"], before)
    assert not torch.equal(copies["slice"], tensors["slice"].cpu())
