"""The phase timeline: one JSON line per phase when switched on, nothing when off."""

from __future__ import annotations

import json

from plora_hpo.timeline import ENV, phase


def test_phases_are_recorded_only_when_the_timeline_is_on(tmp_path, monkeypatch):
    path = tmp_path / "timeline.jsonl"
    monkeypatch.delenv(ENV, raising=False)
    with phase("train"):
        pass
    assert not path.exists()

    monkeypatch.setenv(ENV, str(path))
    with phase("train"), phase("mlflow"):
        pass
    rows = [json.loads(line) for line in path.read_text().splitlines()]
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
