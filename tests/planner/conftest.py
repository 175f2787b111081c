"""Every planner test gets an empty calibration cache of its own (never ~/.cache)."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def calibration_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("PLORA_HPO_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache" / "calibration"
