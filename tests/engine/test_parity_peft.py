"""The correctness contract: an adapter trained in a pack equals the same config trained alone with PEFT."""

from __future__ import annotations

import copy

import pytest
import torch
from peft import PeftModel

from plora_hpo.adapter import AdapterConfig
from plora_hpo.engine import AdapterJob, DataStream, OptimizerSettings, PackedLoraModel, PackedTrainer
from plora_hpo.engine.batching import IGNORE_INDEX
from plora_hpo.engine.export import export_peft_adapter
from plora_hpo.engine.trainer import lr_multiplier

from .conftest import random_examples, tiny_model

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
SETTINGS = OptimizerSettings(lr_schedule="linear", warmup_ratio=0.2, weight_decay=0.01, max_grad_norm=0.5)
CONFIGS = [
    AdapterConfig(rank=8, alpha=2.0, learning_rate=4e-3, batch_size=2, seed=11),
    AdapterConfig(rank=16, alpha=64.0, learning_rate=1e-3, batch_size=3, seed=12),
    AdapterConfig(rank=4, alpha=4.0, learning_rate=2e-3, batch_size=1, seed=13, use_rslora=True),
    AdapterConfig(rank=32, alpha=8.0, learning_rate=5e-3, batch_size=4, seed=14),
]
STEPS = [6, 4, 6, 5]  # adapters leave the pack at different steps


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def right_padded(examples) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask, labels) of one adapter's batch, right-padded as PEFT users do."""
    length = max(len(ex.input_ids) for ex in examples)
    input_ids = torch.zeros((len(examples), length), dtype=torch.long)
    labels = torch.full((len(examples), length), IGNORE_INDEX, dtype=torch.long)
    mask = torch.zeros((len(examples), length), dtype=torch.long)
    for i, ex in enumerate(examples):
        n = len(ex.input_ids)
        input_ids[i, :n] = torch.tensor(ex.input_ids)
        labels[i, :n] = torch.tensor(ex.labels)
        mask[i, :n] = 1
    return input_ids, mask, labels


def train_packed(base, datasets, tmp_path):
    packed = PackedLoraModel(base, TARGETS)
    trainer = PackedTrainer(packed, settings=SETTINGS, pad_id=0, device="cpu")
    for i, (config, steps) in enumerate(zip(CONFIGS, STEPS)):
        trainer.add_job(AdapterJob(f"a{i}", config, datasets[i], steps))
        export_peft_adapter(packed, f"a{i}", tmp_path / f"init-a{i}", "tiny")
    losses: dict[str, list[float]] = {f"a{i}": [] for i in range(len(CONFIGS))}
    trainer.run(lambda r: losses[r.adapter_id].append(r.loss) or True)
    final = {a: {k: v.clone() for k, v in packed.state_dict_of(a).items()} for a in losses}
    return losses, final


def train_alone_with_peft(base, init_dir, config, examples, steps, prepare=None):
    """PEFT's model of the exported adapter, trained alone with torch AdamW; ``prepare(model)``, if
    given, may change the model and returns a function called with each step's index first."""
    model = PeftModel.from_pretrained(base, init_dir, is_trainable=True)
    before_step = prepare(model) if prepare is not None else None
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=config.learning_rate, weight_decay=SETTINGS.weight_decay, foreach=True)
    stream = DataStream(examples, config.seed)
    losses = []
    for step in range(steps):
        if before_step is not None:
            before_step(step)
        input_ids, mask, labels = right_padded(stream.take(config.batch_size))
        out = model(input_ids=input_ids, attention_mask=mask, labels=labels)
        out.loss.backward()
        for group in optimizer.param_groups:
            group["lr"] = config.learning_rate * lr_multiplier(SETTINGS.lr_schedule, step, steps, SETTINGS.warmup_ratio)
        torch.nn.utils.clip_grad_norm_(params, SETTINGS.max_grad_norm)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(out.loss))
    weights = {
        k.replace("base_model.model.", "", 1).replace(".default", ""): v.detach()
        for k, v in model.named_parameters()
        if "lora_" in k
    }
    return losses, weights


def test_pack_matches_peft_alone(family, tmp_path):
    base = tiny_model(family)
    datasets = [random_examples(9, seed=100 + i) for i in range(len(CONFIGS))]
    packed_losses, packed_weights = train_packed(copy.deepcopy(base), datasets, tmp_path)

    for i, (config, steps) in enumerate(zip(CONFIGS, STEPS)):
        alone_losses, alone_weights = train_alone_with_peft(
            copy.deepcopy(base), tmp_path / f"init-a{i}", config, datasets[i], steps
        )
        got = torch.tensor(packed_losses[f"a{i}"], dtype=torch.float64)
        want = torch.tensor(alone_losses, dtype=torch.float64)
        assert len(got) == steps
        assert torch.allclose(got, want, rtol=1e-4, atol=0), (family, i, got, want)
        assert alone_weights.keys() == packed_weights[f"a{i}"].keys()
        for key, want_w in alone_weights.items():
            err = rel_err(packed_weights[f"a{i}"][key], want_w)
            assert err <= 1e-4, (family, i, key, err)
        # training moved the weights (B starts at zero), so the comparison is not vacuous
        assert any(v.abs().max() > 0 for k, v in alone_weights.items() if "lora_B" in k)


def test_adapters_do_not_leak_gradients():
    """Training adapter a0 on garbage labels must not change adapter a1's trajectory."""
    base = tiny_model("llama")
    clean = random_examples(8, seed=1)
    noisy = random_examples(8, seed=2, min_len=18, max_len=20)

    def run(first_examples):
        packed = PackedLoraModel(copy.deepcopy(base), TARGETS)
        trainer = PackedTrainer(packed, settings=SETTINGS, pad_id=0, device="cpu")
        trainer.add_job(AdapterJob("a0", CONFIGS[0], first_examples, 4))
        trainer.add_job(AdapterJob("a1", CONFIGS[1], clean, 4))
        trainer.run()
        return packed.state_dict_of("a1")

    with_clean, with_noisy = run(clean), run(noisy)
    for key in with_clean:
        assert rel_err(with_noisy[key], with_clean[key]) <= 1e-5, key


@pytest.mark.parametrize("schedule", ["constant", "linear", "cosine"])
def test_lr_schedule_shapes(schedule):
    factors = [lr_multiplier(schedule, s, 10, 0.2) for s in range(10)]
    assert factors[0] == 0.0 and factors[2] == 1.0  # warmup of 2 steps then peak
    assert all(0.0 <= f <= 1.0 for f in factors)
    if schedule != "constant":
        assert factors[-1] < factors[2]
