"""Compiling a pack's Triton kernels ahead of its first step: afterwards the steps compile nothing,
and they train exactly what they would have trained without it (same batches, no update).

On the CPU the untimed pass runs with the kernels' compile mode left out (the reference path has
nothing to compile): what it must not change, the batches and the weights, is checked bit for bit.
On a GPU two runs of the same steps can differ in the last bits (split reductions add fp32 partial
sums atomically, in no fixed order), so there the check is that they differ by far less than a
batch or an update would move them.
"""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch

from plora_hpo.adapter import AdapterConfig
from plora_hpo.engine import AdapterJob, OptimizerSettings, PackedLoraModel, PackedTrainer
from plora_hpo.engine import trainer as trainer_module
from plora_hpo.kernels import can_compile_ahead
from plora_hpo.kernels._compiled import AsyncCompileMode

from .conftest import random_examples, tiny_model

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
CONFIGS = [(8, 2), (16, 3), (64, 1), (32, 2)]  # (rank, batch size): three rank tiles, so the merged kernels branch


def _lora_kernels():
    from plora_hpo.kernels._segment_kernels import expand_kernel, outer_kernel, shrink_kernel

    return (shrink_kernel, expand_kernel, outer_kernel)


def _compiled_variants() -> set[tuple[str, str]]:
    """(kernel, specialisation key) of every variant compiled in this process."""
    return {
        (kernel.fn.__name__, str(key))
        for kernel in _lora_kernels()
        for caches in kernel.device_caches.values()
        for key in caches[0]
    }


def _weights(packed: PackedLoraModel, adapters: list[str]) -> dict[str, dict[str, torch.Tensor]]:
    return {a: {k: v.detach().clone() for k, v in packed.state_dict_of(a).items()} for a in adapters}


def _distance(x: dict[str, torch.Tensor], y: dict[str, torch.Tensor]) -> float:
    return sum(float((x[k].double() - y[k].double()).square().sum()) for k in x) ** 0.5


def _train(base: torch.nn.Module, ahead: bool, device: str = "cuda") -> tuple[list[list[float]], dict, set, set, dict]:
    packed = PackedLoraModel(copy.deepcopy(base), TARGETS)
    trainer = PackedTrainer(packed, settings=OptimizerSettings(max_grad_norm=1.0), pad_id=0, device=device)
    for i, (rank, batch) in enumerate(CONFIGS):
        config = AdapterConfig(rank=rank, alpha=2.0 * rank, learning_rate=2e-3, batch_size=batch, seed=i)
        trainer.add_job(AdapterJob(f"a{i}", config, random_examples(24, seed=40 + i, max_len=60), 6))
    start = _weights(packed, list(trainer.jobs))
    if ahead:
        assert trainer.compile_kernels(threads=4)
    on_gpu = device == "cuda"
    after_ahead = _compiled_variants() if on_gpu else set()
    losses = [[r.loss for r in trainer.step()] for _ in range(6)]
    weights = _weights(packed, list(trainer.jobs))
    return losses, weights, after_ahead, _compiled_variants() if on_gpu else set(), start


def test_the_untimed_pass_takes_no_batch_and_updates_nothing(monkeypatch):
    monkeypatch.setattr(trainer_module, "can_compile_ahead", lambda device: True)
    monkeypatch.setattr(trainer_module, "compile_ahead", lambda threads: contextlib.nullcontext())
    base = tiny_model("qwen2")
    reference_losses, reference_weights, *_ = _train(base, ahead=False, device="cpu")
    losses, weights, *_ = _train(base, ahead=True, device="cpu")
    assert losses == reference_losses
    for adapter_id, tensors in reference_weights.items():
        for key, want in tensors.items():
            assert torch.equal(weights[adapter_id][key], want), (adapter_id, key)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.skipif(AsyncCompileMode is None, reason="this Triton does not compile asynchronously")
def test_compiled_ahead_steps_compile_nothing_and_train_the_same():
    assert can_compile_ahead(torch.device("cuda"))
    base = tiny_model("qwen2", hidden_size=256, intermediate_size=688, num_attention_heads=8, num_key_value_heads=2)
    base = base.to("cuda", torch.bfloat16)
    for kernel in _lora_kernels():
        kernel.device_caches.clear()  # nothing compiled yet in this process

    losses, weights, after_ahead, after_steps, start = _train(base, ahead=True)
    assert after_ahead
    assert after_steps == after_ahead, f"compiled by the steps, not ahead: {sorted(after_steps - after_ahead)}"

    plain_losses, plain_weights, *_ = _train(base, ahead=False)
    # The same batches, and no update from the untimed pass: a batch taken or an update made would
    # move the losses and weights by a share of the six steps' travel, not by rounding.
    torch.testing.assert_close(losses, plain_losses, rtol=1e-5, atol=0.0)
    for adapter_id, want in plain_weights.items():
        travelled = _distance(want, start[adapter_id])
        assert travelled > 0
        assert _distance(weights[adapter_id], want) <= 1e-2 * travelled, adapter_id
