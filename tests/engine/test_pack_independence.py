"""An adapter trains the same, bit for bit, whichever adapters share its pack (fp32, CPU).

A sweep that is stopped and resumed from checkpoints packs its trials differently afterwards;
its results must not depend on that. So nothing an adapter computes may depend on its
packmates: not the padding of its sequences, not the length attention runs over, not the
token count of its LoRA weight-gradient reductions, not how micro-batching cuts its batch.
The packmates here have longer sequences (more padding and longer attention for the adapter
if rows were padded pack-wide), shorter ones, other ranks and batch sizes; they sit before or
after the adapter in the pack, and leave it before it finishes.
"""

from __future__ import annotations

import copy

import pytest
import torch

from plora_hpo.adapter import AdapterConfig
from plora_hpo.engine import AdapterJob, OptimizerSettings, PackedLoraModel, PackedTrainer

from .conftest import random_examples, tiny_model

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
SETTINGS = OptimizerSettings(lr_schedule="linear", warmup_ratio=0.25, max_grad_norm=0.5)
ADAPTER = AdapterJob(
    "x", AdapterConfig(rank=8, alpha=16.0, learning_rate=4e-3, batch_size=4, seed=31), random_examples(9, seed=1), 4
)
MATES = {
    "long": AdapterJob(
        "long",
        AdapterConfig(rank=16, alpha=8.0, learning_rate=2e-3, batch_size=3, seed=32),
        random_examples(6, seed=2, min_len=60, max_len=110),
        2,
    ),
    "short": AdapterJob(
        "short",
        AdapterConfig(rank=4, alpha=4.0, learning_rate=5e-3, batch_size=6, seed=33),
        random_examples(8, seed=3, min_len=4, max_len=8),
        3,
    ),
    "alike": AdapterJob(  # sequences as long as the adapter's: length bucketing would mix them
        "alike",
        AdapterConfig(rank=8, alpha=16.0, learning_rate=1e-3, batch_size=5, seed=34),
        random_examples(10, seed=4),
        3,
    ),
}


@pytest.fixture(scope="module")
def base() -> torch.nn.Module:
    return tiny_model("llama")


@pytest.fixture
def one_thread():
    """As a sweep trains on the CPU (the thread count is the same before and after a resume)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def train_adapter(base, knobs, before=(), after=()) -> tuple[list[float], dict[str, torch.Tensor]]:
    """The adapter's per-step losses and final weights, trained in a pack with these mates."""
    packed = PackedLoraModel(copy.deepcopy(base), TARGETS)
    trainer = PackedTrainer(packed, settings=SETTINGS, pad_id=0, device="cpu", **knobs)
    for job in [*(MATES[m] for m in before), ADAPTER, *(MATES[m] for m in after)]:
        trainer.add_job(job)
    losses: list[float] = []
    trainer.run(lambda r: (r.adapter_id == ADAPTER.adapter_id and losses.append(r.loss)) or True)
    return losses, {k: v.clone() for k, v in packed.state_dict_of(ADAPTER.adapter_id).items()}


@pytest.mark.parametrize(
    "knobs",
    [{}, {"row_layout": "varlen"}, {"micro_batch_tokens": 64}, {"row_layout": "varlen", "micro_batch_tokens": 40}],
    ids=["padded", "varlen", "padded-micro-batched", "varlen-micro-batched"],
)
def test_an_adapter_trains_the_same_whoever_shares_its_pack(base, knobs, one_thread):
    want_losses, want_weights = train_adapter(base, knobs)
    assert len(want_losses) == ADAPTER.total_steps
    for mates in ({"after": ["long"]}, {"before": ["short", "alike"], "after": ["long"]}, {"before": ["alike"]}):
        losses, weights = train_adapter(base, knobs, **mates)
        assert losses == want_losses, mates
        for key, want in want_weights.items():
            assert torch.equal(weights[key], want), (mates, key)
