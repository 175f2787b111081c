"""Measured packs of the packed engine on one H200, read from the committed benchmark result.

``benchmarks/results/throughput-h200.json`` (written by ``benchmarks/throughput.py`` on the GPU)
lists every packed row it measured in the planner's calibration format under ``observations``,
keyed here by row name, with the bf16 matmul rate measured in the same run. The cost model's
held-out checks run against whatever engine that file last measured, so a new GPU run that the
prior no longer describes fails them.
"""

from __future__ import annotations

import json
from pathlib import Path

_RESULT = Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "throughput-h200.json"
_DATA = json.loads(_RESULT.read_text())

MATMUL_TFLOPS: float = _DATA["matmul_tflops"]
MEASURED: dict[str, dict] = {row["name"]: row for row in _DATA["observations"]}
