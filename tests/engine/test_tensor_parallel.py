"""A pack trained on d processes with the base split by tensor parallelism equals the pack on one.

Real processes (``torch.multiprocessing``, forked from a forkserver) and a real gloo group on the CPU, fp32.
"""

from __future__ import annotations

import multiprocessing
import os
import socket
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file
from transformers import Qwen2Config

from plora_hpo.adapter import AdapterConfig
from plora_hpo.engine import AdapterJob, OptimizerSettings, PackedLoraModel, PackedTrainer
from plora_hpo.engine.export import export_peft_adapter
from plora_hpo.engine.tensor_parallel import check_degree, plan_of, shard_model

from .conftest import random_examples
from .conftest import tiny_model as engine_tiny_model

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# max_grad_norm well below these adapters' gradient norms: every step clips (checked below)
SETTINGS = OptimizerSettings(lr_schedule="linear", warmup_ratio=0.25, weight_decay=0.01, max_grad_norm=0.05)
CONFIGS = {
    "a0": AdapterConfig(rank=8, alpha=16.0, learning_rate=5e-3, batch_size=2, seed=21),
    "a1": AdapterConfig(rank=4, alpha=4.0, learning_rate=2e-3, batch_size=3, seed=22),
    "a2": AdapterConfig(rank=16, alpha=8.0, learning_rate=1e-2, batch_size=1, seed=23, use_rslora=True),
}
STEPS = {"a0": 4, "a1": 3, "a2": 4}  # a1 leaves the pack early
EXAMPLES = {a: random_examples(6, seed=70 + i, max_len=14) for i, a in enumerate(CONFIGS)}
# Llama with grouped-query attention (2 query heads per key-value head) and biases on every
# projection (a row-parallel bias must be added once)
LLAMA_GQA_BIAS = {"family": "llama", "num_key_value_heads": 2, "attention_bias": True, "mlp_bias": True}
# case: (degree, model overrides, trainer options); degree 4 also micro-batches (gradient
# accumulation) and recomputes layers in the backward
CASES = {
    "qwen2-d2": (2, {}, {}),
    "qwen2-d4": (4, {}, {"micro_batch_tokens": 40, "activation_checkpointing": True}),
    "llama-gqa-bias-d2": (2, LLAMA_GQA_BIAS, {}),
}


def tiny_model(family: str = "qwen2", **overrides) -> torch.nn.Module:
    """The engine tests' tiny model, with heads and sizes every degree up to 4 divides."""
    dims = dict(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_key_value_heads=4, max_position_embeddings=64
    )
    return engine_tiny_model(family, **{**dims, **overrides})


def train(packed: PackedLoraModel, settings: OptimizerSettings = SETTINGS, **options):
    """Per-step losses of every adapter and their whole factors after training."""
    trainer = PackedTrainer(packed, settings=settings, pad_id=0, device="cpu", **options)
    for adapter_id, config in CONFIGS.items():
        trainer.add_job(AdapterJob(adapter_id, config, EXAMPLES[adapter_id], STEPS[adapter_id]))
    losses: dict[str, list[float]] = {a: [] for a in CONFIGS}
    trainer.run(lambda r: losses[r.adapter_id].append(r.loss) or True)
    weights = {a: {k: v.clone() for k, v in packed.state_dict_of(a).items()} for a in CONFIGS}
    return losses, weights


def _worker(rank: int, case: str, port: int, out: str) -> None:
    degree, model, options = CASES[case]
    torch.set_num_threads(1)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=degree)
    try:
        result: dict = {}
        try:
            shard_model(tiny_model(num_attention_heads=6, num_key_value_heads=3, intermediate_size=96))
        except ValueError as err:
            result["bad_degree"] = str(err)
        base = tiny_model(**model)
        plan = shard_model(base)
        packed = PackedLoraModel(base, TARGETS)
        assert packed.parallel is plan and plan_of(base) is plan
        assert base.model.layers[0].self_attn.q_proj.base.weight.shape == (64 // degree, 64)
        down_proj = base.model.layers[0].mlp.down_proj.base
        assert down_proj.weight.shape == (64, 128 // degree)
        assert (down_proj.bias is not None) == (rank == 0 and model.get("mlp_bias", False))  # added once
        result["losses"], result["weights"] = train(packed, **options)
        # loading whole factors gives every rank back its own part
        before = [p.detach().clone() for p in packed.parameters_of("a0")]
        packed.load_state_dict_of("a0", result["weights"]["a0"])
        result["reload_exact"] = all(torch.equal(b, p) for b, p in zip(before, packed.parameters_of("a0")))
        export_peft_adapter(packed, "a2", Path(out) / "export-a2", "tiny")
        torch.save(result, Path(out) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _assert_close(got: torch.Tensor, want: torch.Tensor, what: str, atol: float = 1e-6) -> None:
    torch.testing.assert_close(got, want, rtol=1e-5, atol=atol, msg=lambda m: f"{what}: {m}")


def _assert_weights_close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """Split matmuls sum in another order (fp32 rounding), and AdamW divides by √v: a gradient entry
    near zero turns that rounding into a few 1e-6 of its weight (the whole pack micro-batched on one
    process differs from itself unsplit as much). The tensor as a whole agrees to 1e-5 relative."""
    assert float((got - want).norm() / want.norm()) <= 1e-5, what
    _assert_close(got, want, what, atol=1e-5)


_DEGREE_ONE: dict[str, tuple] = {}


def degree_one(model: dict) -> tuple:
    """The same pack trained in this process on the whole model (cached per model)."""
    key = repr(sorted(model.items()))
    if key not in _DEGREE_ONE:
        _DEGREE_ONE[key] = train(PackedLoraModel(tiny_model(**model), TARGETS))
    return _DEGREE_ONE[key]


def test_clipping_is_active():
    """Without clipping the weights end elsewhere, so the comparisons below cover global-norm clipping."""
    _, unclipped = train(
        PackedLoraModel(tiny_model(), TARGETS), OptimizerSettings(**{**SETTINGS.__dict__, "max_grad_norm": None})
    )
    for adapter_id, weights in unclipped.items():
        key = "model.layers.1.mlp.down_proj.lora_B.weight"
        clipped = degree_one({})[1][adapter_id][key]
        assert (weights[key] - clipped).norm() > 1e-2 * clipped.norm(), adapter_id


@pytest.mark.parametrize("case", list(CASES))
def test_split_pack_equals_whole_pack(case, tmp_path):
    degree, model, _ = CASES[case]
    want_losses, want_weights = degree_one(model)
    # children fork from a server that imported this module once, rather than each importing torch
    multiprocessing.get_context("forkserver").set_forkserver_preload([__name__])
    torch.multiprocessing.start_processes(
        _worker, args=(case, _free_port(), str(tmp_path)), nprocs=degree, start_method="forkserver"
    )
    results = [torch.load(tmp_path / f"rank{r}.pt") for r in range(degree)]
    for rank, result in enumerate(results):
        assert "does not divide" in result["bad_degree"] and f"degree {degree}" in result["bad_degree"]
        assert result["reload_exact"]
        for adapter_id, want in want_losses.items():
            got = result["losses"][adapter_id]
            assert len(got) == STEPS[adapter_id]
            _assert_close(torch.tensor(got), torch.tensor(want), f"rank {rank} {adapter_id} losses")
        for adapter_id, want in want_weights.items():
            got = result["weights"][adapter_id]
            assert got.keys() == want.keys()
            for key in want:
                assert got[key].shape == want[key].shape, key
                _assert_weights_close(got[key], want[key], f"rank {rank} {key}")
    # every rank holds the same replicated state: losses and gathered weights agree bit for bit
    for result in results[1:]:
        assert result["losses"] == results[0]["losses"]
    exported = load_file(tmp_path / "export-a2" / "adapter_model.safetensors")
    for key, want in want_weights["a2"].items():
        _assert_weights_close(exported[f"base_model.model.{key}"], want, f"exported {key}")
    assert any(v.abs().max() > 0 for k, v in want_weights["a0"].items() if "lora_B" in k)


def test_a_degree_that_does_not_divide_the_heads_is_refused():
    config = Qwen2Config(hidden_size=48, num_attention_heads=4, num_key_value_heads=2, intermediate_size=80)
    check_degree(config, 2)
    with pytest.raises(ValueError, match=r"^tensor-parallel degree 4 does not divide .* use a degree among 1, 2$"):
        check_degree(config, 4)
    with pytest.raises(ValueError, match="degree 3"):
        check_degree(config, 3)
