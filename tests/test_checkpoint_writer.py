"""CheckpointWriter: checkpoint saves and deletes off the training loop, in order, with failures raised back;
removals side by side."""

from __future__ import annotations

import threading

import pytest
import torch

from plora_hpo.adapter import AdapterConfig
from plora_hpo.checkpoint_writer import CheckpointWriter, state_bytes
from plora_hpo.checkpoints import CheckpointStore, NoSpaceLeft
from plora_hpo.engine.adapter_state import AdapterState


def state(steps: int, n: int = 64) -> AdapterState:
    weight = torch.full((n,), float(steps))
    return AdapterState(
        config=AdapterConfig(8, 8.0, 1e-4, 2),
        steps_done=steps,
        weights={"w": weight},
        optimizer_state=[{"exp_avg": torch.zeros(n), "exp_avg_sq": torch.zeros(n)}],
        stream_position=(0, steps),
    )


class GatedStore(CheckpointStore):
    """A real store whose saves wait for a gate, and fail (as a full disk) for chosen lineages."""

    def __init__(self, directory, failing=()):
        super().__init__(directory)
        self.gate = threading.Event()
        self.failing = set(failing)

    def save(self, lineage, state, extra=None):
        self.gate.wait(10)
        if lineage in self.failing:
            raise NoSpaceLeft(f"no space left for t{lineage}")
        return super().save(lineage, state, extra)


def test_saves_and_deletes_reach_disk_in_the_order_asked(tmp_path):
    store = GatedStore(tmp_path)
    writer = CheckpointWriter("test")
    writer.save(store, 1, state(5), {"run_id": "a"})
    writer.save(store, 1, state(9), {"run_id": "a"})
    writer.delete(store, 2)
    writer.save(store, 2, state(3), {})
    writer.delete(store, 1)  # the trial finished: its queued saves must not resurrect the file
    assert not any(tmp_path.iterdir())  # nothing written while the writer waits
    store.gate.set()
    writer.flush()
    assert not store.path(1).exists()
    loaded, _ = store.load(2)
    assert loaded.steps_done == 3 and torch.equal(loaded.weights["w"], torch.full((64,), 3.0))


def test_a_failed_write_is_raised_at_the_next_call_and_drops_the_saves_queued_behind_it(tmp_path):
    store = GatedStore(tmp_path, failing={1})
    CheckpointStore(tmp_path).save(2, state(1))  # an earlier checkpoint of lineage 2
    writer = CheckpointWriter("test")
    writer.save(store, 1, state(4), {})
    writer.save(store, 2, state(7), {})  # queued behind the failing one: dropped
    writer.delete(store, 3)
    store.gate.set()
    with pytest.raises(NoSpaceLeft, match="t1"):
        writer.flush()
    assert store.load(2)[0].steps_done == 1  # the previous checkpoint stays
    writer.flush()  # raised once; the writer serves on
    writer.save(store, 2, state(8), {})
    writer.flush()
    assert store.load(2)[0].steps_done == 8


def test_a_save_waits_while_the_queue_holds_too_many_bytes(tmp_path):
    store = GatedStore(tmp_path)
    one = state(1, n=1024)
    writer = CheckpointWriter("test", max_queued_bytes=2 * state_bytes(one) + 1)
    assert state_bytes(one) == 3 * 1024 * 4
    writer.save(store, 1, one, {})  # the writer takes it and waits at the gate
    writer.save(store, 2, state(2, n=1024), {})  # queued: one state pending beside the one being written
    third = threading.Thread(target=writer.save, args=(store, 3, state(3, n=1024), {}))
    third.start()
    third.join(0.5)
    assert third.is_alive()  # two states pending: the third waits for room
    store.gate.set()
    third.join(10)
    assert not third.is_alive()
    writer.flush()
    assert [store.load(i)[0].steps_done for i in (1, 2, 3)] == [1, 2, 3]


def test_has_room_says_whether_a_save_would_wait(tmp_path):
    store = GatedStore(tmp_path)
    one = state(1, n=1024)
    writer = CheckpointWriter("test", max_queued_bytes=2 * state_bytes(one))
    assert writer.has_room(10 * state_bytes(one))  # nothing queued: any size goes in (and waits for nothing)
    writer.save(store, 1, one, {})  # held at the gate, its bytes still queued
    assert writer.has_room(state_bytes(one))
    assert not writer.has_room(state_bytes(one) + 1)
    store.gate.set()
    writer.flush()
    assert writer.has_room(10 * state_bytes(one))


def test_writes_show_on_the_timeline_as_the_writer_thread_s_own_phase(tmp_path, monkeypatch):
    import json

    from plora_hpo.timeline import ENV

    timeline = tmp_path / "timeline.jsonl"
    monkeypatch.setenv(ENV, str(timeline))
    writer = CheckpointWriter("plora-cpu")
    store = CheckpointStore(tmp_path / "ckpt")
    writer.save(store, 0, state(3), {})
    writer.delete(store, 0)
    writer.flush()
    rows = [json.loads(line) for line in timeline.read_text().splitlines()]
    assert [(r["phase"], r["thread"]) for r in rows] == [
        ("checkpoint-write", "plora-cpu-checkpoints"),
        ("checkpoint-delete", "plora-cpu-checkpoint-deletes_0"),
    ]


class SlowRemovals(CheckpointStore):
    """A real store whose removals wait: for each other (``together`` at once), or for a gate."""

    def __init__(self, directory, together=1):
        super().__init__(directory)
        self.together = threading.Barrier(together, timeout=5)
        self.gate = threading.Event()
        self.gate.set()

    def delete(self, lineage):
        self.together.wait()  # broken (and raised) unless that many removals run at once
        self.gate.wait(10)
        super().delete(lineage)


def test_removals_run_side_by_side(tmp_path):
    store = SlowRemovals(tmp_path, together=3)
    writer = CheckpointWriter("test")
    for lineage in (1, 2, 3):
        writer.save(store, lineage, state(lineage), {})
    for lineage in (1, 2, 3):
        writer.delete(store, lineage)
    writer.flush()  # one after the other, the first removal would wait for the others in vain
    assert not any(tmp_path.glob("t*.pt"))


def test_a_save_after_a_removal_of_its_lineage_waits_for_it(tmp_path):
    store = SlowRemovals(tmp_path)
    writer = CheckpointWriter("test")
    writer.save(store, 1, state(2), {})
    writer.flush()
    store.gate.clear()
    writer.delete(store, 1)
    writer.save(store, 1, state(6), {})  # the lineage again (a retry): written after the file is gone
    writer.save(store, 2, state(4), {})
    threading.Event().wait(0.3)
    assert store.load(1)[0].steps_done == 2 and not store.path(2).exists()  # both wait behind the removal
    store.gate.set()
    writer.flush()
    assert store.load(1)[0].steps_done == 6 and store.load(2)[0].steps_done == 4


def test_a_failed_removal_is_raised_by_flush_once(tmp_path):
    class Refusing(CheckpointStore):
        def delete(self, lineage):
            raise PermissionError(f"cannot remove {self.path(lineage)} (injected)")

    store = Refusing(tmp_path)
    writer = CheckpointWriter("test")
    writer.save(store, 1, state(3), {})
    writer.delete(store, 1)
    with pytest.raises(PermissionError, match="injected"):
        writer.flush()
    writer.flush()
    assert store.load(1)[0].steps_done == 3


def test_a_written_state_is_let_go_at_once(tmp_path):
    """Its host buffers go back to the allocator when its write ends, not when the next job comes:
    a capture copies into page-locked memory, and a freed buffer is what the next capture reuses."""
    import gc
    import weakref

    store = GatedStore(tmp_path)
    store.gate.set()
    writer = CheckpointWriter("test")
    captured = state(4)
    alive = weakref.ref(captured.weights["w"])
    writer.save(store, 1, captured, {})
    del captured
    writer.flush()
    gc.collect()
    assert alive() is None
