"""A finished adapter is stored once: in the run's local MLflow artifact folder, linked from the run directory."""

from __future__ import annotations

import os
from pathlib import Path

import mlflow
import torch
from mlflow.tracking import MlflowClient

from plora_hpo._mlflow_adapter_store import local_artifact_dir
from plora_hpo.adapter import AdapterConfig
from plora_hpo.engine import PackedLoraModel
from plora_hpo.engine.export import export_peft_adapter
from plora_hpo.tracking import SweepTracker, default_tracking_uri


class _Tiny(torch.nn.Module):
    """One projection named like a transformer's, enough for a PEFT-format export."""

    def __init__(self) -> None:
        super().__init__()
        self.q_proj = torch.nn.Linear(8, 8)


def _packed() -> PackedLoraModel:
    packed = PackedLoraModel(_Tiny(), ["q_proj"])
    packed.add_adapter("a", AdapterConfig(rank=4, alpha=8.0, learning_rate=1e-3, batch_size=1))
    return packed


def _regular_files(root: Path) -> list[Path]:
    """Every regular file under ``root``, links not followed: what actually takes disk space."""
    return [Path(d) / f for d, _, files in os.walk(root) for f in files if not (Path(d) / f).is_symlink()]


def test_local_store_keeps_the_only_copy_and_the_run_dir_links_to_it(tmp_path):
    tracker = SweepTracker(default_tracking_uri(tmp_path), "once", artifact_root=tmp_path)
    tracker.start("once", {})
    run_id = tracker.start_trial("a", {}, {})
    exported = export_peft_adapter(_packed(), "a", tmp_path / "adapters" / "a", "tiny")
    weights = (exported / "adapter_model.safetensors").read_bytes()

    kept = tracker.log_adapter(run_id, exported)

    client = MlflowClient(tracker.tracking_uri)
    assert kept == local_artifact_dir(client.get_run(run_id).info.artifact_uri) / "adapter"
    assert exported.is_symlink() and exported.resolve() == kept.resolve()
    assert not Path(os.readlink(exported)).is_absolute()  # the run directory can be moved as a whole
    stored = [p for p in _regular_files(tmp_path) if p.name == "adapter_model.safetensors"]
    assert stored == [kept / "adapter_model.safetensors"] and stored[0].read_bytes() == weights
    assert {a.path for a in client.list_artifacts(run_id, "adapter")} == {
        "adapter/adapter_config.json",
        "adapter/adapter_model.safetensors",
    }
    downloaded = Path(
        mlflow.artifacts.download_artifacts(
            run_id=run_id, artifact_path="adapter", dst_path=tmp_path / "dl", tracking_uri=tracker.tracking_uri
        )
    )
    assert (downloaded / "adapter_model.safetensors").read_bytes() == weights


def test_a_retried_trial_replaces_what_its_predecessor_stored(tmp_path):
    tracker = SweepTracker(default_tracking_uri(tmp_path), "retry", artifact_root=tmp_path)
    tracker.start("retry", {})
    run_id = tracker.start_trial("a", {}, {})
    packed = _packed()
    first = tracker.log_adapter(run_id, export_peft_adapter(packed, "a", tmp_path / "adapters" / "a", "tiny"))
    packed.load_state_dict_of("a", {k: v + 1.0 for k, v in packed.state_dict_of("a").items()})
    again = tracker.log_adapter(run_id, export_peft_adapter(packed, "a", tmp_path / "adapters" / "a", "tiny"))

    assert again == first and (tmp_path / "adapters" / "a").is_symlink()
    stored = [p for p in _regular_files(tmp_path) if p.name == "adapter_model.safetensors"]
    assert stored == [again / "adapter_model.safetensors"]
    saved = export_peft_adapter(packed, "a", tmp_path / "check", "tiny") / "adapter_model.safetensors"
    assert stored[0].read_bytes() == saved.read_bytes()  # the retry's weights, not the first export's


def test_remote_artifact_uris_are_not_local_folders():
    assert local_artifact_dir("mlflow-artifacts:/1/abc/artifacts") is None
    assert local_artifact_dir("s3://bucket/1/abc/artifacts") is None
    assert local_artifact_dir("file:///srv/mlartifacts/1/abc/artifacts") == Path("/srv/mlartifacts/1/abc/artifacts")
