"""The phase timeline: one JSON line per phase when switched on, nothing when off."""

from __future__ import annotations

import gc
import json
import threading

import pytest

from plora_hpo.timeline import ENV, phase, record, watch_collections


def test_phases_are_recorded_only_when_the_timeline_is_on(tmp_path, monkeypatch):
    path = tmp_path / "timeline.jsonl"
    monkeypatch.delenv(ENV, raising=False)
    with phase("train"):
        pass
    assert not path.exists()

    monkeypatch.setenv(ENV, str(path))
    with phase("train"), phase("mlflow"):
        pass
    rows = [r for r in map(json.loads, path.read_text().splitlines()) if r["phase"] != "gc"]  # collections: any time
    assert [r["phase"] for r in rows] == ["mlflow", "train"]  # inner phase ends first
    assert all(r["start"] <= r["end"] for r in rows)
    assert rows[1]["start"] <= rows[0]["start"] and rows[0]["end"] <= rows[1]["end"]


def test_triton_compiles_are_watched_only_when_the_timeline_is_on(monkeypatch):
    """Off, Triton's compile hooks stay as they were (no cost on every compile of a user's
    process); on, they are installed once, whatever the number of workers that ask."""
    from triton import knobs

    from plora_hpo.timeline import watch_triton_compiles

    for hook in ("jit_cache_hook", "jit_post_compile_hook"):
        monkeypatch.setattr(knobs.runtime, hook, None)
    monkeypatch.delenv(ENV, raising=False)
    watch_triton_compiles()
    assert knobs.runtime.jit_cache_hook is None and knobs.runtime.jit_post_compile_hook is None

    monkeypatch.setenv(ENV, "timeline.jsonl")
    watch_triton_compiles()
    installed = (knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook)
    assert all(callable(h) for h in installed)
    watch_triton_compiles()
    assert (knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook) == installed


def test_what_a_phase_is_told_is_recorded_with_it(tmp_path, monkeypatch):
    path = tmp_path / "timeline.jsonl"
    monkeypatch.setenv(ENV, str(path))
    with phase("train") as details:
        details["alloc_retries"] = 2
    (row,) = [json.loads(line) for line in path.read_text().splitlines()]
    assert row["phase"] == "train" and row["alloc_retries"] == 2


class _Cycle:
    def __init__(self) -> None:
        self.me = self


@pytest.fixture
def collector_callbacks():
    """The collector's own callback list (the C side holds that very list), as it was afterwards."""
    before = list(gc.callbacks)
    yield gc.callbacks
    gc.callbacks[:] = before


def test_full_collections_are_recorded_as_gc_phases_of_the_thread_that_set_them_off(
    tmp_path, monkeypatch, collector_callbacks
):
    from plora_hpo import timeline

    path = tmp_path / "timeline.jsonl"
    monkeypatch.setenv(ENV, str(path))
    collector_callbacks[:] = []
    watch_collections()
    watch_collections()  # once per process
    assert collector_callbacks == [timeline._on_collection]
    gc.disable()  # no automatic collection frees part of them first
    try:
        for _ in range(1000):
            _Cycle()  # garbage only a collection frees
        gc.collect()
    finally:
        gc.enable()
    assert not path.exists()  # noted, not written: the collector may run inside record()
    record("train", 1.0, 2.0)
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert rows[0]["phase"] == "train"
    full = [r for r in rows if r["phase"] == "gc" and r["generation"] == 2]
    assert sum(r["collected"] for r in full) >= 1000  # the cycles, freed by full collections
    assert {r["thread"] for r in full} == {threading.current_thread().name}
    assert all(r["start"] <= r["end"] for r in full)


def test_collections_inside_record_neither_deadlock_nor_break_lines(tmp_path, monkeypatch, collector_callbacks):
    from plora_hpo import timeline

    path = tmp_path / "timeline.jsonl"
    monkeypatch.setenv(ENV, str(path))
    monkeypatch.setattr(timeline, "SLOW_COLLECTION_S", 0.0)  # every collection noted, the youngest too
    collector_callbacks[:] = []
    watch_collections()
    thresholds = gc.get_threshold()

    def many() -> None:
        for i in range(300):
            _Cycle()
            record("mlflow", float(i), float(i) + 0.5, details={"step": [i] * 3})

    gc.set_threshold(2, 1, 10**9)  # a young collection at nearly every allocation, record()'s own included
    try:
        writer = threading.Thread(target=many, name="plora-cpu")
        writer.start()
        writer.join(timeout=60)
    finally:
        gc.set_threshold(*thresholds)
    assert not writer.is_alive()
    rows = [json.loads(line) for line in path.read_text().splitlines()]  # every line whole
    assert sum(r["phase"] == "mlflow" for r in rows) == 300
    assert any(r["phase"] == "gc" and r["thread"] == "plora-cpu" for r in rows)
