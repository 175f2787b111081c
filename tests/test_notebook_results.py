"""The notebook on `benchmarks/quality.py` result files (its default source): every section runs, per task."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def test_notebook_executes_against_results_files(tmp_path, monkeypatch):
    nbformat = pytest.importorskip("nbformat")
    from nbclient import NotebookClient

    results = json.loads((REPO / "benchmarks" / "results" / "quality-cpu.json").read_text())
    configs = results["tasks"][0]["configs"]
    for i, c in enumerate(configs):  # the GPU run's additions; the last config keeps only loss_by_tenth
        c["pack"] = f"pack-{i // 4}"
        if i < len(configs) - 1:
            c["loss_curve"] = [[10 * (k + 1), loss] for k, loss in enumerate(c["loss_by_tenth"])]
    path = tmp_path / "quality.json"
    path.write_text(json.dumps(results))
    monkeypatch.delenv("PLORA_STORAGE", raising=False)
    mrpc = REPO / "benchmarks" / "results" / "quality-mrpc-h200-seeds.json"  # a second file, another task
    monkeypatch.setenv("PLORA_RESULTS", f"{path}{os.pathsep}{mrpc}")
    monkeypatch.setenv("MLFLOW_DISABLE_TELEMETRY", "true")

    nb = nbformat.read(REPO / "notebooks" / "explore_120.ipynb", as_version=4)
    NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(REPO)}}).execute()
    outputs = [o for cell in nb.cells if cell.cell_type == "code" for o in cell.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    text = "".join(o.get("text", "") + o.get("data", {}).get("text/plain", "") for o in outputs)
    assert text.startswith("quality.json: ") and "COLLAPSED" in text  # the file's collapsed classifiers show
    assert "quality-mrpc-h200-seeds.json: " in text
    assert "-0.020703" in text and "0.028780" in text  # CoLA: the default's seed values, the best one's spread
    assert "0.112745" in text  # MRPC: the best config's mean gain over the default
    assert sum("image/png" in o.get("data", {}) for o in outputs) == 4  # heatmaps and loss curves of each task
