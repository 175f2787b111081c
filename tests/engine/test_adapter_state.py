"""An adapter taken out of a pack (to disk or host memory) and put back trains on bit for bit."""

from __future__ import annotations

import copy

import pytest
import torch

from plora_hpo.adapter import AdapterConfig
from plora_hpo.checkpoint_writer import state_bytes
from plora_hpo.checkpoints import CheckpointStore, read_checkpoint
from plora_hpo.engine import AdapterJob, OptimizerSettings, PackedLoraModel, PackedTrainer
from plora_hpo.engine.adapter_state import abort_step, capture, capture_bytes_bound, restore, stream_positions
from plora_hpo.engine.host_copy import _copy_stream
from plora_hpo.errors import CheckpointError

from .conftest import random_examples, tiny_model

TARGETS = ("q_proj", "v_proj", "down_proj")
SETTINGS = OptimizerSettings(lr_schedule="cosine", warmup_ratio=0.25, weight_decay=0.01, max_grad_norm=0.5)
CONFIGS = {
    "a": AdapterConfig(rank=8, alpha=16.0, learning_rate=4e-3, batch_size=3, seed=1),
    "b": AdapterConfig(rank=4, alpha=4.0, learning_rate=2e-3, batch_size=2, seed=2),
}
STEPS = 8
EXAMPLES = {a: random_examples(7, seed=40 + i, max_len=16) for i, a in enumerate(CONFIGS)}  # 7: epochs wrap


def new_trainer(base: torch.nn.Module, device: str = "cpu") -> PackedTrainer:
    packed = PackedLoraModel(copy.deepcopy(base).to(device), TARGETS)
    return PackedTrainer(packed, settings=SETTINGS, pad_id=0, device=device)


def job(adapter_id: str) -> AdapterJob:
    return AdapterJob(adapter_id, CONFIGS[adapter_id], EXAMPLES[adapter_id], STEPS)


def weights(trainer: PackedTrainer, adapter_id: str) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in trainer.packed.state_dict_of(adapter_id).items()}


def test_checkpoint_round_trip_continues_exactly(tmp_path):
    base = tiny_model("qwen2")
    straight = new_trainer(base)
    for a in CONFIGS:
        straight.add_job(job(a))
    straight_losses = [[r.loss for r in straight.step()] for _ in range(STEPS)]

    first = new_trainer(base)
    for a in CONFIGS:
        first.add_job(job(a))
    losses = [[r.loss for r in first.step()] for _ in range(5)]
    store = CheckpointStore(tmp_path / "ckpt")
    for i, a in enumerate(CONFIGS):
        state = capture(first, a, curve=[(5, losses[-1][i], 0.0)])
        assert state_bytes(state) == capture_bytes_bound(first, a)  # one process: the bound is exact
        store.save(i, state, {"run_id": f"run-{a}"})
    del first  # the process dies here

    second = new_trainer(base)
    for i, a in enumerate(CONFIGS):
        state, extra = store.load(i)
        assert extra == {"run_id": f"run-{a}"} and state.steps_done == 5 and state.curve[0][0] == 5
        restore(second, job(a), state)
    losses += [[r.loss for r in second.step()] for _ in range(STEPS - 5)]

    assert losses == straight_losses  # bitwise: weights, AdamW moments, schedule and data order
    for a in CONFIGS:
        for key, value in weights(straight, a).items():
            assert torch.equal(weights(second, a)[key], value), key


def test_a_restored_adapter_leaves_the_state_it_came_from_as_saved():
    """A host-memory state (an out-of-memory split parks adapters this way) can be restored again:
    training after a restore must not update the saved moments in place."""
    base = tiny_model("qwen2")
    first = new_trainer(base)
    first.add_job(job("a"))
    first.step()
    state = capture(first, "a", curve=[])
    saved = [{k: v.clone() for k, v in moments.items()} for moments in state.optimizer_state]
    second = new_trainer(base)
    restore(second, job("a"), state)
    second.step()
    for moments, want in zip(state.optimizer_state, saved):
        for key, value in want.items():
            assert torch.equal(moments[key], value), key


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_capture_on_the_gpu_keeps_its_step_while_the_next_steps_update_the_adapter(tmp_path):
    """The capture's copies run beside the next steps: its state is still the captured step's."""
    trainer = new_trainer(tiny_model("qwen2"), device="cuda")
    for a in CONFIGS:
        trainer.add_job(job(a))
    for _ in range(3):
        trainer.step()
    want = {k: v.cpu() for k, v in trainer.packed.state_dict_of("a").items()}  # read now, waited for
    moments = [{k: v.cpu() for k, v in trainer.optimizer.state[p].items()} for p in _params(trainer, "a")]
    with torch.cuda.stream(_copy_stream(trainer.device)):
        torch.cuda._sleep(200_000_000)  # the copies queue behind this: the next update must wait for them
    state = capture(trainer, "a", curve=[])
    assert state.copied  # queued, not waited for
    for _ in range(2):  # a step's forward and backward take far less than the delay; its update waits
        trainer.step()
    now = trainer.packed.state_dict_of("a")
    assert not all(torch.equal(now[k].cpu(), v) for k, v in want.items())  # training went on

    CheckpointStore(tmp_path).save(0, state)
    saved, _ = read_checkpoint(CheckpointStore(tmp_path).path(0))
    for key, value in want.items():
        assert torch.equal(saved.weights[key], value), key
    for got, expected in zip(saved.optimizer_state, moments):
        for key, value in expected.items():
            assert torch.equal(got[key].cpu(), value), key


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_member_parked_on_the_gpu_keeps_its_step_while_another_trains_in_its_place():
    """Rotation's park and swap on a device: the capture is still queued (its copy stream held up)
    while the member leaves the pack (its storage and AdamW state freed), a new adapter joins and
    two steps rebuild the pack's storage and update it. The parked state is the captured step's,
    and it joins again with exactly those weights and moments."""
    trainer = new_trainer(tiny_model("qwen2"), device="cuda")
    for a in CONFIGS:
        trainer.add_job(job(a))
    for _ in range(3):
        trainer.step()
    want = {k: v.cpu() for k, v in trainer.packed.state_dict_of("a").items()}
    moments = [{k: v.cpu() for k, v in trainer.optimizer.state[p].items()} for p in _params(trainer, "a")]
    with torch.cuda.stream(_copy_stream(trainer.device)):
        torch.cuda._sleep(1_000_000_000)  # the copies queue behind this, past the swap below
    state = capture(trainer, "a", curve=[])
    assert state.copied
    trainer.remove_job("a")
    trainer.packed.remove_adapter("a")
    newcomer = AdapterConfig(rank=16, alpha=16.0, learning_rate=1e-3, batch_size=3, seed=3)
    trainer.add_job(AdapterJob("c", newcomer, EXAMPLES["a"], STEPS))
    assert not any(event.query() for event in state.copied)  # swapped while the copies still waited
    for _ in range(2):  # the first update waits for the copies; the storage is rebuilt before it
        trainer.step()

    state.wait_copied()
    for key, value in want.items():
        assert torch.equal(state.weights[key], value), key
    for got, expected in zip(state.optimizer_state, moments):
        for key, value in expected.items():
            assert torch.equal(got[key].cpu(), value), key
    restore(trainer, job("a"), state)
    for key, value in trainer.packed.state_dict_of("a").items():
        assert torch.equal(value.cpu(), want[key]), key
    for p, expected in zip(_params(trainer, "a"), moments):
        for key, value in expected.items():
            assert torch.equal(trainer.optimizer.state[p][key].cpu(), value), key
    assert trainer.steps_done["a"] == 3


def _params(trainer: PackedTrainer, adapter_id: str) -> list[torch.nn.Parameter]:
    [group] = [g for g in trainer.optimizer.param_groups if g["adapter_id"] == adapter_id]
    return list(group["params"])


def test_restore_refuses_a_different_config(tmp_path):
    trainer = new_trainer(tiny_model("llama"))
    trainer.add_job(job("a"))
    trainer.step()
    state = capture(trainer, "a", curve=[])
    other = new_trainer(tiny_model("llama"))
    with pytest.raises(ValueError, match="belongs to"):
        restore(other, AdapterJob("a", CONFIGS["b"], EXAMPLES["a"], STEPS), state)


def test_aborted_step_leaves_no_trace():
    """An out-of-memory step is undone: data rewound, gradients dropped, nothing updated."""
    base = tiny_model("mistral")
    reference, faulty = new_trainer(base), new_trainer(base)
    for t in (reference, faulty):
        for a in CONFIGS:
            t.add_job(job(a))
        t.step()
    positions = stream_positions(faulty)
    faulty._ensure_storage()
    for mb in faulty.next_micro_batches():  # a step that dies after its backward, before its update
        faulty._forward_backward(mb, torch.ones(len(CONFIGS)))
    abort_step(faulty, positions)
    for _ in range(3):
        assert [r.loss for r in faulty.step()] == [r.loss for r in reference.step()]


def test_corrupt_checkpoint_is_one_clear_error(tmp_path):
    trainer = new_trainer(tiny_model("llama"))
    trainer.add_job(job("a"))
    trainer.step()
    store = CheckpointStore(tmp_path)
    path = store.save(3, capture(trainer, "a", curve=[]))
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])  # torn write of another tool
    with pytest.raises(CheckpointError, match=r"t3\.pt is unreadable .*delete it to retrain"):
        store.validate_all()
    with pytest.raises(CheckpointError) as caught:
        read_checkpoint(path)
    assert "\n" not in str(caught.value)
