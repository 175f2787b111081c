"""benchmarks/eval.py runs end to end on CPU (tiny sizes) and its two paths agree exactly there."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_eval_benchmark_smoke(tmp_path):
    out = tmp_path / "eval-smoke.json"
    done = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "eval.py"), "--smoke", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    keys = {"speedup_generate_4", "speedup_loglikelihood_4", "speedup_loglikelihood_4_ceiling"}
    assert keys <= set(result["summary"])
    assert not result["lm_eval_imported"]  # the GPU image has no lm-eval
    modes = {(r["workload"], r["mode"]) for r in result["rows"]}
    assert modes == {
        (w, m) for w in ("generate", "loglikelihood") for m in ("batched", "sequential", "sequential-batch1")
    } | {("loglikelihood", "ceiling")}
    assert "written:" in done.stdout.splitlines()[-1]
