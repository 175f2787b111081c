"""Host copies of device tensors: equal values, own memory, contiguous; page-locked from a GPU."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from plora_hpo.engine.host_copy import host_copies, queue_host_copies

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


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_shared_copies_are_views_of_one_buffer_per_dtype_and_save_it_once(tmp_path):
    generator = torch.Generator(device="cuda").manual_seed(0)
    packed = torch.randn(64, 48, device="cuda", generator=generator)
    tensors = {
        "a": packed[8:24],
        "b": packed.t(),
        "scalar": torch.tensor(3.0, device="cuda"),
        "bf16": packed[:4].to(torch.bfloat16),
        "bf16-2": torch.randn(7, device="cuda", generator=generator).to(torch.bfloat16),
        "step": torch.tensor(7.0),
    }
    copies = host_copies(tensors, shared=True)

    assert list(copies) == list(tensors)
    for key, tensor in tensors.items():
        copy = copies[key]
        assert copy.dtype == tensor.dtype and copy.shape == tensor.shape and copy.is_contiguous()
        assert torch.equal(copy, tensor.cpu())
    storages = {k: copies[k].untyped_storage().data_ptr() for k in ("a", "b", "scalar", "bf16", "bf16-2")}
    assert storages["a"] == storages["b"] == storages["scalar"] != storages["bf16"] == storages["bf16-2"]
    assert copies["a"].is_pinned()
    before = copies["a"].clone()
    packed.add_(1.0)  # its own memory, not the device's
    assert torch.equal(copies["a"], before) and not torch.equal(copies["a"], tensors["a"].cpu())

    fp32_bytes = sum(copies[k].numel() * 4 for k in ("a", "b", "scalar"))
    bf16_bytes = sum(copies[k].numel() * 2 for k in ("bf16", "bf16-2"))
    torch.save(copies, tmp_path / "state.pt")
    assert (tmp_path / "state.pt").stat().st_size < fp32_bytes + bf16_bytes + 8192  # each buffer once
    loaded = torch.load(tmp_path / "state.pt")
    assert all(torch.equal(loaded[k], copies[k]) for k in copies)
    save_file(copies, tmp_path / "adapter.safetensors")  # views of one buffer that do not overlap: accepted
    assert all(torch.equal(t, copies[k]) for k, t in load_file(tmp_path / "adapter.safetensors").items())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_queued_copies_hold_the_values_as_of_the_work_queued_before_them():
    stream = torch.cuda.current_stream()
    source = torch.zeros(1 << 24, device="cuda")
    torch.cuda._sleep(200_000_000)  # the write below reaches the device long after the host moves on
    source.fill_(1.0)
    copies, events = queue_host_copies({"source": source, "step": torch.tensor(3.0)})
    assert copies["step"].item() == 3.0  # a host tensor is copied at once
    for event in events:  # the rule for writing into a source while its copy may still run
        stream.wait_event(event)
    source.fill_(2.0)
    for event in events:
        event.synchronize()

    assert copies["source"].is_pinned()
    assert torch.equal(copies["source"], torch.ones(1 << 24))  # after the first fill, before the second


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_source_freed_while_its_copy_is_queued_keeps_its_memory_until_copied():
    source = torch.full((1 << 24,), 3.0, device="cuda")
    torch.cuda._sleep(200_000_000)  # the side stream's copy waits behind this
    copies, events = queue_host_copies({"source": source})
    address = source.data_ptr()
    del source
    reused = torch.empty(1 << 24, device="cuda")  # on the current stream: must not take the source's memory
    reused.fill_(4.0)
    for event in events:
        event.synchronize()

    assert reused.data_ptr() != address
    assert torch.equal(copies["source"], torch.full((1 << 24,), 3.0))
