"""lora_dropout in a pack: PEFT's function with the engine's masks, per adapter, only while training."""

from __future__ import annotations

import copy
import json

import torch
from peft import PeftModel

from plora_hpo.adapter import AdapterConfig
from plora_hpo.engine import AdapterJob, PackedLoraModel, PackedTrainer
from plora_hpo.engine.export import export_peft_adapter
from plora_hpo.engine.lora_dropout import dropout_mask, forward_key

from .conftest import random_examples, tiny_model
from .test_parity_peft import SETTINGS, TARGETS, rel_err, train_alone_with_peft

# batch 1: an adapter's rows of a layer input are its one sequence, as in PEFT's (1, T, d) batch
DROPPED = [
    AdapterConfig(rank=8, alpha=16.0, learning_rate=4e-3, batch_size=1, seed=21, lora_dropout=0.1),
    AdapterConfig(rank=4, alpha=8.0, learning_rate=3e-3, batch_size=1, seed=22, lora_dropout=0.5),
]
PLAIN = AdapterConfig(rank=16, alpha=16.0, learning_rate=2e-3, batch_size=2, seed=23)
STEPS = 4


def _train(base, configs, datasets, tmp_path=None, *, checkpointing=False):
    packed = PackedLoraModel(base, TARGETS)
    trainer = PackedTrainer(packed, settings=SETTINGS, pad_id=0, device="cpu", activation_checkpointing=checkpointing)
    for i, config in enumerate(configs):
        trainer.add_job(AdapterJob(f"a{i}", config, datasets[i], STEPS))
        if tmp_path is not None:
            export_peft_adapter(packed, f"a{i}", tmp_path / f"init-a{i}", "tiny")
    losses: dict[str, list[float]] = {f"a{i}": [] for i in range(len(configs))}
    trainer.run(lambda r: losses[r.adapter_id].append(r.loss) or True)
    return packed, losses


class _Replay(torch.nn.Module):
    """Stands in for a PEFT layer's ``nn.Dropout``: multiplies by the mask the engine draws there."""

    def __init__(self, config: AdapterConfig, layer_index: int, clock: dict) -> None:
        super().__init__()
        self.config, self.layer_index, self.clock = config, layer_index, clock

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        key = forward_key(self.config.seed, self.clock["step"], 0)
        mask = dropout_mask(x.shape[1:], self.config.lora_dropout, key, self.layer_index, x.device)
        return x * mask.unsqueeze(0)


def _peft_alone(base, init_dir, config, examples, layer_index):
    """PEFT trained alone, its dropout layers drawing the engine's masks for each step."""
    clock = {"step": 0}

    def replay_masks(model):
        for name, module in model.named_modules():
            if hasattr(module, "lora_dropout") and "default" in module.lora_dropout:
                assert module.lora_dropout["default"].p == config.lora_dropout  # the exported config's p
                index = layer_index[name.removeprefix("base_model.model.")]
                module.lora_dropout["default"] = _Replay(config, index, clock)
        return lambda step: clock.update(step=step)

    return train_alone_with_peft(base, init_dir, config, examples, STEPS, prepare=replay_masks)


def test_packed_dropout_matches_peft_with_the_same_masks(tmp_path):
    base = tiny_model("llama")
    datasets = [random_examples(6, seed=300 + i) for i in range(3)]
    packed, losses = _train(copy.deepcopy(base), [*DROPPED, PLAIN], datasets, tmp_path)
    layer_index = {name: layer.index for name, layer in packed.layers.items()}

    for i, config in enumerate(DROPPED):
        want_losses, want_weights = _peft_alone(
            copy.deepcopy(base), tmp_path / f"init-a{i}", config, datasets[i], layer_index
        )
        got = torch.tensor(losses[f"a{i}"], dtype=torch.float64)
        assert torch.allclose(got, torch.tensor(want_losses, dtype=torch.float64), rtol=1e-4, atol=0), (i, got)
        final = packed.state_dict_of(f"a{i}")
        for key, want in want_weights.items():
            assert rel_err(final[key], want) <= 1e-4, (i, key)

    # not vacuous: without dropout the same adapter follows another trajectory
    undropped = [AdapterConfig(**{**c.as_params(), "lora_dropout": 0.0}) for c in DROPPED]
    _, plain_losses = _train(copy.deepcopy(base), [*undropped, PLAIN], datasets)
    assert plain_losses["a1"][1:] != losses["a1"][1:]
    # a p = 0 adapter is bit-identical whether its packmates drop out or not
    assert plain_losses["a2"] == losses["a2"]


def test_checkpointing_recomputes_the_forward_with_its_own_masks():
    base = tiny_model("llama")
    datasets = [random_examples(6, seed=500 + i) for i in range(2)]
    _, stored = _train(copy.deepcopy(base), DROPPED, datasets)
    _, recomputed = _train(copy.deepcopy(base), DROPPED, datasets, checkpointing=True)
    assert recomputed == stored


def test_evaluation_drops_nothing_and_export_records_p(tmp_path):
    base = tiny_model("llama")
    datasets = [random_examples(6, seed=400 + i) for i in range(2)]
    packed, _ = _train(copy.deepcopy(base), DROPPED, datasets)
    exported = export_peft_adapter(packed, "a1", tmp_path / "a1", "tiny")
    assert json.loads((exported / "adapter_config.json").read_text())["lora_dropout"] == 0.5

    ids = torch.tensor([[5, 17, 3, 44, 9, 61, 2, 30]])
    with torch.no_grad():
        with packed.route([("a1", 1)]):
            evaluated = packed.model(input_ids=ids).logits
        with packed.route([("a1", 1)], dropout_keys=[forward_key(22, 0, 0)]):
            trained = packed.model(input_ids=ids).logits
    peft = PeftModel.from_pretrained(copy.deepcopy(base), exported).eval()  # PEFT drops nothing in eval mode
    with torch.no_grad():
        assert torch.allclose(evaluated, peft(input_ids=ids).logits, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(trained, evaluated, atol=1e-4)


def test_masks_drop_p_and_keep_the_expectation():
    mask = dropout_mask((512, 512), 0.3, forward_key(1, 2, 0), 5, torch.device("cpu"))
    assert abs(float((mask == 0).float().mean()) - 0.3) < 0.005
    assert abs(float(mask.mean()) - 1.0) < 0.01
    assert set(mask.unique().tolist()) == {0.0, torch.tensor(1 / 0.7, dtype=torch.float32).item()}
    again = dropout_mask((512, 512), 0.3, forward_key(1, 2, 0), 5, torch.device("cpu"))
    other_layer = dropout_mask((512, 512), 0.3, forward_key(1, 2, 0), 6, torch.device("cpu"))
    other_step = dropout_mask((512, 512), 0.3, forward_key(1, 3, 0), 5, torch.device("cpu"))
    assert torch.equal(mask, again) and not torch.equal(mask, other_layer) and not torch.equal(mask, other_step)
