"""benchmarks/quality.py's continuation: a later call reuses an earlier search only when it matches."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

from quality import earlier_search, gains  # noqa: E402

SETTINGS = {"steps": 1000, "seq_len": 128, "space": "subset", "eval_limit": None}


def results(tmp_path: Path, **settings) -> Path:
    rows = [{"params": {"rank": 16}, "value": 0.1}]
    path = tmp_path / "earlier.json"
    path.write_text(json.dumps({"settings": {**SETTINGS, **settings}, "tasks": [{"task": "cola", "configs": rows}]}))
    return path


def test_an_earlier_search_with_the_same_settings_is_reused(tmp_path):
    args = argparse.Namespace(search_from=results(tmp_path), **SETTINGS)
    assert earlier_search(args, "cola") == [{"params": {"rank": 16}, "value": 0.1}]


def test_an_earlier_search_with_other_settings_or_tasks_is_refused(tmp_path):
    args = argparse.Namespace(search_from=results(tmp_path, steps=100), **SETTINGS)
    with pytest.raises(SystemExit, match="its steps is 100, this run's 1000"):
        earlier_search(args, "cola")
    args = argparse.Namespace(search_from=results(tmp_path), **SETTINGS)
    with pytest.raises(SystemExit, match="no finished search of mrpc"):
        earlier_search(args, "mrpc")


def test_the_gain_over_fresh_seeds_leaves_out_the_searchs_biased_maximum():
    out = gains({"default": [0.0, 0.1, 0.0, 0.05], "best": [0.9, 0.4, 0.42, 0.41]})
    assert out["gain_fresh_seeds"] == pytest.approx(0.41 - 0.05)
    assert out["gain_mean_best_minus_default"] > out["gain_fresh_seeds"]
    assert out["gain_fresh_exceeds_twice_spread"]
