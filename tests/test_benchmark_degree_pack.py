"""benchmarks/degree_pack.py's pure helpers: the loss agreement it reports and the runs it plans."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

from degree_pack import agreement, make_plans, pack_configs  # noqa: E402


def test_agreement_takes_the_worst_step_of_every_adapter_over_the_steps_both_have():
    reference = {"a": [2.0, 4.0, 5.0], "b": [1.0, 1.0], "c": [3.0]}
    other = {"a": [2.0, 4.2, 4.0], "b": [1.0, 0.9, 7.0]}  # b's extra step and the missing c are not compared
    result = agreement(reference, other)
    assert result["adapters"] == 2
    assert result["per_adapter"]["a"]["steps"] == 3 and result["per_adapter"]["b"]["steps"] == 2
    assert result["per_adapter"]["a"]["max_abs_diff"] == pytest.approx(1.0)
    assert result["per_adapter"]["a"]["max_rel_diff"] == pytest.approx(0.2)  # 1.0 / 5.0 beats 0.2 / 4.0
    assert result["max_abs_diff"] == pytest.approx(1.0)
    assert result["max_rel_diff"] == pytest.approx(0.2)
    assert agreement(reference, {})["max_abs_diff"] is None


def test_a_degree_without_enough_gpus_is_skipped_with_its_reason(tmp_path):
    args = argparse.Namespace(shape="qwen2.5-7b", k=3, steps=4, warmup=1, seq=16, seed=0, degree=2)
    result: dict = {"runs": {}}
    plans = make_plans(args, "cuda", 1, 8, tmp_path / "gpu", result)
    assert list(plans) == ["degree1"] and plans["degree1"].devices == ("cuda:0",)
    assert plans["degree1"].configs == tuple(pack_configs(3))
    assert result["runs"]["degree2"] == {
        "status": "skipped",
        "reason": "needs 2 GPUs, 1 visible (NCCL takes one GPU per rank)",
    }
    cpu = make_plans(args, "cpu", 0, 8, tmp_path / "cpu", {"runs": {}})
    assert cpu["degree2"].devices == ("cpu", "cpu") and cpu["degree2"].threads == 4 and cpu["degree1"].threads == 8
