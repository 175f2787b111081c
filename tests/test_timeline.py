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
