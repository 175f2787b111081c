"""The sweep's CUDA path on a real GPU: Triton kernels, bf16 base, real MRPC data, real out-of-memory.

``pytest -m gpu`` (skipped without CUDA). Each test runs the real CLI (``plora_hpo.cli.main``) on
a random-weight model at SmolLM2-135M's shape; MRPC comes from ``$PLORA_HPO_TEST_DATA``.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import optuna
import torch
import yaml
from optuna.trial import TrialState

from plora_hpo.cli import main

REPO = Path(__file__).resolve().parents[2]
TASK = "mrpc"
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def sweep_file(tmp: Path, model_dir: Path, name: str, *, trials: int = 4, steps: int = 6, **overrides) -> Path:
    data = {
        "name": name,
        "model": str(model_dir),
        "tasks": [TASK],
        "target_modules": TARGETS,
        "seq_len": 256,
        "seed": 0,
        "budget": {"steps": steps},
        "space": {
            "rank": {"choices": [8, 64]},
            "alpha_multiplier": {"choices": [1]},
            "learning_rate": {"choices": [1e-4, 4e-4]},
            "batch_size": {"choices": [2, 8]},
        },
        "sampler": "grid",
        "n_trials": trials,
        "pack": {"size": 8, "gather_seconds": 5},
        "evaluation": {"limit": 16, "batch_size": 16},
    }
    data.update(overrides)
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def study_of(run_dir: Path, name: str) -> optuna.Study:
    return optuna.load_study(study_name=f"{name}-{TASK}", storage=f"sqlite:///{run_dir / 'optuna.db'}")


def packs_of(run_dir: Path) -> list[dict]:
    record = json.loads((run_dir / "packs" / "packs.json").read_text())
    return record["segments"] if isinstance(record, dict) else record


def test_bf16_evaluation_matches_hflm_with_peft(tmp_path, model_dir, data_dir):
    """Batched multi-adapter scoring in bf16 on the GPU vs lm-eval's HFLM + PEFT, one adapter at a time."""
    from lm_eval.evaluator import evaluate
    from lm_eval.models.huggingface import HFLM

    from plora_hpo.adapter import AdapterConfig
    from plora_hpo.engine import PackedLoraModel, export_peft_adapter
    from plora_hpo.evaluation import evaluate_adapters_report
    from plora_hpo.evaluation.runner import FEWSHOT_SEED, lm_eval_tasks
    from plora_hpo.models import load_base_model
    from plora_hpo.tasks import build_eval_tasks

    limit = 48
    loaded = load_base_model(str(model_dir), device="cuda")
    packed = PackedLoraModel(loaded.model, TARGETS)
    ids = {"r8": AdapterConfig(8, 16.0, 1e-4, 1, seed=1), "r32": AdapterConfig(32, 32.0, 1e-4, 1, seed=2)}
    dirs = {}
    for index, (adapter_id, config) in enumerate(ids.items()):
        packed.add_adapter(adapter_id, config)
        generator = torch.Generator().manual_seed(100 + index)
        with torch.no_grad():
            for layer in packed.layers.values():
                b = layer.lora_B[adapter_id]
                b.copy_((torch.randn(b.shape, generator=generator) * 0.03).to(b.device))
        dirs[adapter_id] = export_peft_adapter(packed, adapter_id, tmp_path / adapter_id, loaded.name)
    task_dict = build_eval_tasks(TASK, data_dir=data_dir)
    ours = evaluate_adapters_report(
        packed, loaded.tokenizer, list(ids), task_dict, limit=limit, batch_size=16, log_samples=True
    )
    del packed, loaded
    torch.cuda.empty_cache()
    for adapter_id in ids:
        lm = HFLM(pretrained=str(model_dir), peft=str(dirs[adapter_id]), dtype="bfloat16", device="cuda", batch_size=1)
        task_dict = build_eval_tasks(TASK, data_dir=data_dir)
        for task in lm_eval_tasks(task_dict):
            task.set_fewshot_seed(seed=FEWSHOT_SEED)
        ref = evaluate(lm=lm, task_dict=task_dict, limit=limit, bootstrap_iters=0, log_samples=True)
        got = sorted(ours.results[adapter_id]["samples"][TASK], key=lambda s: s["doc_id"])
        want = sorted(ref["samples"][TASK], key=lambda s: s["doc_id"])
        assert len(got) == len(want) == limit
        diffs, same_choice = [], 0
        for g, w in zip(got, want):
            ll_g = [r[0][0] for r in g["resps"]]
            ll_w = [r[0][0] for r in w["resps"]]
            diffs += [abs(a - b) / max(1.0, abs(b)) for a, b in zip(ll_g, ll_w)]
            margin = abs(ll_w[0] - ll_w[1])
            same_choice += (ll_g.index(max(ll_g)) == ll_w.index(max(ll_w))) or margin < 0.05
        diffs.sort()
        assert diffs[len(diffs) // 2] < 1e-2, diffs[-5:]  # bf16: both round the same products differently
        assert same_choice == limit, (adapter_id, same_choice)
        del lm
        torch.cuda.empty_cache()


def _peak_of_pack(model_dir: Path, data_dir: Path, configs, seq_len: int) -> int:
    """Peak allocated bytes of one packed training step of ``configs`` (base model included)."""
    from plora_hpo.adapter import AdapterConfig
    from plora_hpo.engine import AdapterJob, OptimizerSettings, PackedLoraModel, PackedTrainer
    from plora_hpo.models import load_base_model
    from plora_hpo.tasks import load_train_examples

    loaded = load_base_model(str(model_dir), device="cuda")
    examples = load_train_examples(TASK, loaded.tokenizer, seq_len=seq_len, data_dir=data_dir)
    packed = PackedLoraModel(loaded.model, TARGETS)
    trainer = PackedTrainer(
        packed, settings=OptimizerSettings(), pad_id=loaded.tokenizer.pad_token_id, device=torch.device("cuda")
    )
    for i, (rank, batch) in enumerate(configs):
        cfg = AdapterConfig(rank=rank, alpha=rank, learning_rate=1e-4, batch_size=batch)
        trainer.add_job(AdapterJob(f"a{i}", cfg, examples, 3))
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    trainer.step()
    trainer.step()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated()
    del trainer, packed, loaded
    torch.cuda.empty_cache()
    return peak


def test_oom_split_on_a_real_out_of_memory(tmp_path, model_dir, data_dir):
    """The allocator is capped between what one adapter and the whole pack need: the pack's first
    step really runs out of memory, the worker splits it, and every trial still completes."""
    seq_len = 512
    one = _peak_of_pack(model_dir, data_dir, [(64, 8)], seq_len)
    eight = _peak_of_pack(model_dir, data_dir, [(64, 8)] * 8, seq_len)
    assert eight > 1.5 * one
    total = torch.cuda.get_device_properties(0).total_memory
    cap = one + 0.35 * (eight - one)
    path = sweep_file(
        tmp_path,
        model_dir,
        "oom",
        trials=8,
        steps=4,
        seq_len=seq_len,
        space={
            "rank": {"choices": [64]},
            "alpha_multiplier": {"choices": [1, 4]},
            "learning_rate": {"choices": [1e-4, 2e-4, 3e-4, 4e-4]},
            "batch_size": {"choices": [8]},
        },
        evaluation={"limit": 8, "batch_size": 4},
    )
    run_dir = tmp_path / "runs"
    torch.cuda.empty_cache()
    torch.cuda.set_per_process_memory_fraction(cap / total)
    try:
        assert main(["sweep", str(path), "--run-dir", str(run_dir), "--data-dir", str(data_dir)]) == 0
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
    trials = study_of(run_dir, "oom").trials
    assert [t.state for t in trials] == [TrialState.COMPLETE] * 8
    sizes = [len(s["members"]) for s in packs_of(run_dir)]
    # the pack filled up to all 8 as trials arrived, ran out of memory, then trained split
    full = sizes.index(8)
    assert min(sizes[full:]) < 8, sizes


def test_short_real_sweep_on_cuda(tmp_path, model_dir, data_dir):
    path = sweep_file(tmp_path, model_dir, "short")
    run_dir = tmp_path / "runs"
    assert main(["sweep", str(path), "--run-dir", str(run_dir), "--data-dir", str(data_dir)]) == 0
    trials = study_of(run_dir, "short").trials
    assert [t.state for t in trials] == [TrialState.COMPLETE] * 4
    assert all(math.isfinite(t.value) and 0.0 <= t.value <= 1.0 for t in trials)
    assert all(math.isfinite(t.user_attrs["final_train_loss"]) for t in trials)
    segments = packs_of(run_dir)
    assert {s["device"] for s in segments} == {"cuda:0"}
    assert max(len(s["members"]) for s in segments) == 4  # the four trained together
    adapters = list((run_dir / "adapters").glob("*/adapter_config.json"))  # links into mlartifacts/
    assert len(adapters) == 4


def test_resume_after_kill_on_cuda(tmp_path, model_dir, data_dir):
    path = sweep_file(tmp_path, model_dir, "crash", steps=40, train={"checkpoint_every": 5})
    run_dir = tmp_path / "runs"
    cmd = [sys.executable, "-m", "plora_hpo.cli", "sweep", str(path), "--run-dir", str(run_dir)]
    cmd += ["--data-dir", str(data_dir)]
    with (tmp_path / "killed.log").open("w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            ckpt = run_dir / "checkpoints" / f"crash-{TASK}"
            deadline = time.monotonic() + 240
            while len(list(ckpt.glob("t*.pt"))) < 4:
                assert proc.poll() is None, (tmp_path / "killed.log").read_text()[-2000:]
                assert time.monotonic() < deadline, "no checkpoints in time"
                time.sleep(0.05)
        finally:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert main(["sweep", str(path), "--run-dir", str(run_dir), "--data-dir", str(data_dir), "--resume"]) == 0
    trials = study_of(run_dir, "crash").trials
    done = [t for t in trials if t.state == TrialState.COMPLETE]
    assert len(done) == 4
    assert not any(t.state == TrialState.RUNNING for t in trials)
    assert all(t.user_attrs["resumed_from_step"] > 0 for t in done)  # from a checkpoint, not step 0
