"""An adapter's checkpointed state does not depend on the tensor-parallel degree that wrote it.

A pack trained on 2 processes (gloo, CPU, fp32) captures whole weights and whole AdamW moments;
that state restores into a pack on one process exactly, and a state captured on one process
restores into the split pack and trains on as it would have there.
"""

from __future__ import annotations

import multiprocessing
import os
from pathlib import Path

import torch
import torch.distributed as dist

from plora_hpo.checkpoint_writer import state_bytes
from plora_hpo.engine import AdapterJob, PackedLoraModel, PackedTrainer
from plora_hpo.engine.adapter_state import AdapterState, capture, capture_bytes_bound, restore
from plora_hpo.engine.tensor_parallel import shard_model

from .test_tensor_parallel import CONFIGS, EXAMPLES, SETTINGS, TARGETS, _free_port, tiny_model

ADAPTERS = ("a0", "a2")
FIRST, MORE = 3, 2  # steps before the checkpoint, steps after it


def _trainer(packed: PackedLoraModel) -> PackedTrainer:
    return PackedTrainer(packed, settings=SETTINGS, pad_id=0, device="cpu")


def _job(adapter_id: str) -> AdapterJob:
    return AdapterJob(adapter_id, CONFIGS[adapter_id], EXAMPLES[adapter_id], FIRST + MORE)


def _train(trainer: PackedTrainer, steps: int) -> dict[str, list[float]]:
    losses: dict[str, list[float]] = {a: [] for a in trainer.jobs}
    for _ in range(steps):
        for report in trainer.step():
            losses[report.adapter_id].append(report.loss)
    return losses


def _states(trainer: PackedTrainer) -> dict[str, AdapterState]:
    states = {a: capture(trainer, a, []) for a in ADAPTERS}
    for adapter_id, state in states.items():  # the room a worker asks its checkpoint writer for is enough
        assert 0 < state_bytes(state) <= capture_bytes_bound(trainer, adapter_id)
    return states


def checkpointed_then_resumed(packed: PackedLoraModel, resume_from: dict[str, AdapterState] | None) -> dict:
    """Train ``FIRST`` steps and capture; then, in a fresh trainer, restore (the captured state, or
    ``resume_from``) and train ``MORE`` steps."""
    trainer = _trainer(packed)
    for adapter_id in ADAPTERS:
        trainer.add_job(_job(adapter_id))
    _train(trainer, FIRST)
    saved = _states(trainer)
    for adapter_id in ADAPTERS:
        trainer.remove_job(adapter_id)
        packed.remove_adapter(adapter_id)
    resumed = _trainer(packed)
    for adapter_id in ADAPTERS:
        restore(resumed, _job(adapter_id), (resume_from or saved)[adapter_id])
    restored = _states(resumed)
    losses = _train(resumed, MORE)
    for adapter_id in ADAPTERS:
        resumed.remove_job(adapter_id)
        packed.remove_adapter(adapter_id)
    return {"saved": saved, "restored": restored, "losses": losses}


def _worker(rank: int, port: int, out: str, resume_from: str) -> None:
    torch.set_num_threads(1)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        base = tiny_model()
        shard_model(base)
        states = {a: AdapterState.from_dict(d) for a, d in torch.load(resume_from).items()}
        packed = PackedLoraModel(base, TARGETS)
        result = checkpointed_then_resumed(packed, states)
        result["own"] = checkpointed_then_resumed(packed, None)["restored"]
        if rank == 0:
            torch.save(result, Path(out) / "degree2.pt")
    finally:
        dist.destroy_process_group()


def _assert_same_state(got: AdapterState, want: AdapterState, what: str, exact: bool) -> None:
    assert got.steps_done == want.steps_done and got.stream_position == want.stream_position, what
    assert got.weights.keys() == want.weights.keys(), what
    pairs = [(got.weights[k], want.weights[k], k) for k in want.weights]
    assert len(got.optimizer_state) == len(want.optimizer_state), what
    for g, w in zip(got.optimizer_state, want.optimizer_state):
        assert g.keys() == w.keys() == {"step", "exp_avg", "exp_avg_sq"}, what
        pairs += [(g[k], w[k], k) for k in w]
    for g, w, key in pairs:
        assert g.shape == w.shape, f"{what} {key}"
        if exact:
            assert torch.equal(g, w), f"{what} {key}"
        else:  # split matmuls sum in another order: fp32 rounding, amplified by AdamW's 1/√v
            assert float((g - w).norm()) <= 1e-5 * float(w.norm()) + 1e-12, f"{what} {key}"


def test_states_move_between_degree_two_and_degree_one(tmp_path):
    one = checkpointed_then_resumed(PackedLoraModel(tiny_model(), TARGETS), None)
    torch.save({a: s.to_dict() for a, s in one["saved"].items()}, tmp_path / "degree1.pt")
    multiprocessing.get_context("forkserver").set_forkserver_preload([__name__])
    torch.multiprocessing.start_processes(
        _worker, args=(_free_port(), str(tmp_path), str(tmp_path / "degree1.pt")), nprocs=2, start_method="forkserver"
    )
    two = torch.load(tmp_path / "degree2.pt", weights_only=False)
    for adapter_id in ADAPTERS:
        # degree 2 captures what degree 1 holds after the same steps (whole factors and moments)
        _assert_same_state(two["saved"][adapter_id], one["saved"][adapter_id], f"{adapter_id} at degree 2", False)
        # a degree-2 checkpoint restores into a degree-1 pack exactly, and back into degree 2 exactly
        trainer = _trainer(PackedLoraModel(tiny_model(), TARGETS))
        restore(trainer, _job(adapter_id), two["saved"][adapter_id])
        _assert_same_state(capture(trainer, adapter_id, []), two["saved"][adapter_id], adapter_id, True)
        _assert_same_state(two["own"][adapter_id], two["saved"][adapter_id], f"{adapter_id} degree 2 again", True)
        # a degree-1 checkpoint restored at degree 2 is the same state, and trains on as at degree 1
        _assert_same_state(two["restored"][adapter_id], one["saved"][adapter_id], f"{adapter_id} 1→2", True)
        torch.testing.assert_close(
            torch.tensor(two["losses"][adapter_id]), torch.tensor(one["losses"][adapter_id]), rtol=1e-5, atol=1e-6
        )
        assert len(one["losses"][adapter_id]) == MORE
