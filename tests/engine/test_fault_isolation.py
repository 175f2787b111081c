"""A non-finite adapter leaves its pack before the update; the others train as if it never existed."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from plora_hpo.adapter import AdapterConfig
from plora_hpo.engine import AdapterJob, OptimizerSettings, PackedLoraModel, PackedTrainer

from .conftest import random_examples, tiny_model

TARGETS = ("q_proj", "v_proj", "gate_proj", "down_proj")
SETTINGS = OptimizerSettings(lr_schedule="linear", warmup_ratio=0.2, weight_decay=0.01, max_grad_norm=0.5)
CONFIGS = {
    "good0": AdapterConfig(rank=8, alpha=16.0, learning_rate=4e-3, batch_size=3, seed=21),
    "bad": AdapterConfig(rank=4, alpha=8.0, learning_rate=2e-3, batch_size=2, seed=22),
    "good1": AdapterConfig(rank=4, alpha=4.0, learning_rate=5e-3, batch_size=2, seed=23),
}
STEPS = 5
FAULT_STEP = 3  # the bad adapter's weights turn NaN just before this packed step


def train(ids, *, poison: str | None = None, flat_storage: bool = True, max_grad_norm=0.5):
    base = tiny_model("llama")
    packed = PackedLoraModel(copy.deepcopy(base), TARGETS)
    settings = OptimizerSettings(**{**SETTINGS.__dict__, "max_grad_norm": max_grad_norm})
    trainer = PackedTrainer(packed, settings=settings, pad_id=0, device="cpu", flat_storage=flat_storage)
    for i, adapter_id in enumerate(CONFIGS):
        if adapter_id in ids:
            examples = random_examples(12, seed=500 + i, min_len=4, max_len=20)
            trainer.add_job(AdapterJob(adapter_id, CONFIGS[adapter_id], examples, STEPS))
    reports, snapshot = [], {}
    original_step = trainer.step

    def step():  # fault injection only: poison the bad adapter's lora_B before step FAULT_STEP
        if poison is not None and trainer.stats.steps == FAULT_STEP - 1:
            with torch.no_grad():
                packed.parameters_of(poison)[1].fill_(float("nan"))  # first layer's lora_B
            snapshot.update({k: v.clone() for k, v in packed.state_dict_of(poison).items()})
        return original_step()

    trainer.step = step
    trainer.run(lambda r: reports.append(r) or True)
    weights = {a: {k: v.clone() for k, v in packed.state_dict_of(a).items()} for a in ids}
    return reports, weights, snapshot, trainer


@pytest.mark.parametrize("flat_storage", [True, False])
@pytest.mark.parametrize("max_grad_norm", [0.5, None])
def test_nan_adapter_leaves_pack_and_others_are_bitwise_unchanged(flat_storage, max_grad_norm):
    reports, weights, snapshot, trainer = train(
        list(CONFIGS), poison="bad", flat_storage=flat_storage, max_grad_norm=max_grad_norm
    )
    alone_reports, alone_weights, _, _ = train(
        ["good0", "good1"], flat_storage=flat_storage, max_grad_norm=max_grad_norm
    )

    bad = [r for r in reports if r.adapter_id == "bad"]
    assert [r.failed for r in bad] == [False] * (FAULT_STEP - 1) + [True]  # removed at once
    assert bad[-1].step == FAULT_STEP and "non-finite" in bad[-1].fail_reason
    assert "bad" not in trainer.jobs
    for key, before in snapshot.items():  # the faulty step did not update it (NaN compared as NaN)
        assert torch.equal(weights["bad"][key].nan_to_num(7.0), before.nan_to_num(7.0)), key
    for adapter_id in ("good0", "good1"):
        got = [r.loss for r in reports if r.adapter_id == adapter_id]
        want = [r.loss for r in alone_reports if r.adapter_id == adapter_id]
        assert got == want and len(got) == STEPS
        for key, w in alone_weights[adapter_id].items():
            assert torch.equal(weights[adapter_id][key], w), (adapter_id, key)


@pytest.mark.slow
def test_sweep_fails_only_the_nan_trial_in_optuna_and_mlflow(tmp_path, monkeypatch):
    """Through optimize_in_packs on the embedded model: the NaN trial is FAIL with its reason
    (Optuna user attr, MLflow tag and status) and not exported; its pack-mate completes."""
    import optuna
    import yaml
    from mlflow.tracking import MlflowClient

    from plora_hpo import PackedSweep, SweepTracker, create_study, load_sweep, optimize_in_packs
    from plora_hpo.tracking import default_tracking_uri

    data = yaml.safe_load((Path(__file__).resolve().parents[2] / "search_spaces" / "demo.yaml").read_text())
    data.update(
        name="nan",
        budget={"steps": 3},
        space={
            "rank": {"choices": [8]},
            "alpha_multiplier": {"choices": [1]},
            "learning_rate": {"choices": [2e-5, 4e-4]},
            "batch_size": {"choices": [2]},
        },
        evaluation={"limit": 4, "batch_size": 8},
    )
    (tmp_path / "nan.yaml").write_text(yaml.safe_dump(data))
    config = load_sweep(tmp_path / "nan.yaml")
    run_dir = tmp_path / "runs"
    run_dir.mkdir()
    tracker = SweepTracker(default_tracking_uri(run_dir), config.name, artifact_root=run_dir)
    sweep = PackedSweep(config, tracker=tracker, run_dir=run_dir, device="cpu")
    tracker.start(config.name, {})
    study = create_study(config, "synthetic", f"sqlite:///{tmp_path / 'optuna.db'}")

    original_step = PackedTrainer.step

    def step(trainer):  # fault injection only: trial 0's lora_B turns NaN before packed step 2
        if trainer.stats.steps == 1:
            [zero] = [a for a in trainer.jobs if a.startswith("synthetic-t0-")]
            with torch.no_grad():
                trainer.packed.parameters_of(zero)[1].fill_(float("nan"))
        return original_step(trainer)

    monkeypatch.setattr(PackedTrainer, "step", step)
    outcomes = optimize_in_packs(study, sweep, "synthetic", n_trials=2, pack_size=2)
    tracker.finish()

    failed, ok = outcomes
    assert failed.failed and not ok.failed and failed.adapter_dir is None and failed.losses
    t0, t1 = study.trials
    assert t0.state == optuna.trial.TrialState.FAIL and "non-finite" in t0.user_attrs["fail_reason"]
    assert t1.state == optuna.trial.TrialState.COMPLETE
    client = MlflowClient(tracker.tracking_uri)
    run = client.get_run(failed.run_id)
    assert run.info.status == "FAILED" and run.data.tags["plora.fail_reason"] == failed.fail_reason
    assert client.get_run(ok.run_id).info.status == "FINISHED"
    assert not list((run_dir / "adapters").glob("synthetic-t0-*"))
