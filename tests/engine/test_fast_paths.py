"""The engine's speed knobs change how a step is computed, never what it computes.

Each knob (micro-batching with length bucketing, padding-free rows of concatenated sequences,
activation checkpointing, fused elementwise ops, flat adapter storage) is compared in fp32 on the CPU
with the plain path, which test_parity_peft.py ties to PEFT.
"""

from __future__ import annotations

import copy
import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F

from plora_hpo.adapter import AdapterConfig
from plora_hpo.engine import AdapterJob, OptimizerSettings, PackedLoraModel, PackedTrainer, packed_lora
from plora_hpo.engine.batching import IGNORE_INDEX, plan_micro_batches
from plora_hpo.engine.fused import fuse_elementwise, unfuse_elementwise, varlen_attention
from plora_hpo.engine.loss import grouped_label_loss
from plora_hpo.kernels import adapted_linear

from .conftest import random_examples, tiny_model

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
SETTINGS = OptimizerSettings(lr_schedule="cosine", warmup_ratio=0.2, weight_decay=0.01, max_grad_norm=0.5)
CONFIGS = [
    AdapterConfig(rank=8, alpha=16.0, learning_rate=4e-3, batch_size=3, seed=21),
    AdapterConfig(rank=16, alpha=8.0, learning_rate=2e-3, batch_size=2, seed=22),
    AdapterConfig(rank=4, alpha=4.0, learning_rate=5e-3, batch_size=4, seed=23, use_rslora=True),
]
STEPS = [5, 3, 4]


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def train(family: str, isolate: bool | None = None, **knobs):
    base = tiny_model(family)
    datasets = [random_examples(10, seed=300 + i, min_len=4, max_len=24) for i in range(len(CONFIGS))]
    packed = PackedLoraModel(copy.deepcopy(base), TARGETS)
    trainer = PackedTrainer(packed, settings=SETTINGS, pad_id=0, device="cpu", **knobs)
    if isolate is not None:
        trainer.isolate = isolate  # the layout the trainer picks for the GPU, here on the CPU
    for i, (config, steps) in enumerate(zip(CONFIGS, STEPS)):
        trainer.add_job(AdapterJob(f"a{i}", config, datasets[i], steps))
    losses: dict[str, list[float]] = {f"a{i}": [] for i in range(len(CONFIGS))}
    stats = trainer.run(lambda r: losses[r.adapter_id].append(r.loss) or True)
    weights = {a: {k: v.clone() for k, v in packed.state_dict_of(a).items()} for a in losses}
    return losses, weights, stats


def assert_same(reference, other, tol=2e-5):
    ref_losses, ref_weights, _ = reference
    losses, weights, _ = other
    for adapter_id, want in ref_losses.items():
        got = losses[adapter_id]
        assert len(got) == len(want)
        assert torch.allclose(torch.tensor(got), torch.tensor(want), rtol=tol, atol=0), (adapter_id, got, want)
        for key, w in ref_weights[adapter_id].items():
            assert rel_err(weights[adapter_id][key], w) <= tol, (adapter_id, key)


@pytest.fixture(scope="module")
def reference():
    return {family: train(family) for family in ("llama", "qwen2")}


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize(
    "knobs",
    [
        {"micro_batch_tokens": 40},
        {"row_layout": "varlen"},
        {"row_layout": "varlen", "micro_batch_tokens": 50},
        {"activation_checkpointing": True},
        {"activation_checkpointing": True, "row_layout": "varlen", "micro_batch_tokens": 64},
        {"fused_elementwise": True},
        {"flat_storage": False},
        {"loss_chunk_tokens": 7},
    ],
    ids=lambda k: ",".join(f"{a}={b}" for a, b in k.items()),
)
def test_knob_keeps_the_step(reference, family, knobs):
    result = train(family, **knobs)
    assert_same(reference[family], result)
    if "micro_batch_tokens" in knobs:
        assert result[2].micro_batches > result[2].steps  # the step really was split
    if knobs.get("row_layout") == "varlen":
        assert result[2].padded_tokens == result[2].tokens  # no padding computed


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("knobs", [{}, {"micro_batch_tokens": 40}], ids=["whole", "micro_batch_tokens=40"])
def test_pack_wide_padding_keeps_the_step(reference, family, knobs):
    """The GPU's micro-batches ((rows, T), padded to the longest of the whole pack, bucketed
    across adapters) compute the step the CPU's per-adapter ones do."""
    result = train(family, isolate=False, **knobs)
    assert_same(reference[family], result)
    if not knobs:
        assert result[2].padded_tokens > reference[family][2].padded_tokens  # more padding: pack-wide
    else:
        assert result[2].micro_batches > result[2].steps  # the step really was split


@pytest.mark.parametrize("isolate", [True, False])
def test_bucketing_cuts_padding(isolate):
    rows = random_examples(24, seed=5, min_len=4, max_len=64)
    groups = [("a", rows[:12]), ("b", rows[12:])]
    whole = plan_micro_batches(groups, 0, "cpu", isolate=isolate)
    bucketed = plan_micro_batches(groups, 0, "cpu", max_tokens=256, isolate=isolate)
    assert len(whole) == 1 and len(bucketed) > 1
    assert sum(m.real_tokens for m in bucketed) == whole[0].real_tokens
    assert sum(m.padded_tokens for m in bucketed) < whole[0].padded_tokens
    for mb in bucketed:  # every micro-batch lists both adapters, in pack order, rows grouped
        assert [a for a, _ in mb.groups] == ["a", "b"]
        assert mb.padded_tokens <= 256 or sum(n for _, n in mb.groups) == 1  # or one over-long sequence
    assert sum(m.label_counts[0] for m in bucketed) == whole[0].label_counts[0]


def test_varlen_micro_batch_targets_stay_inside_sequences():
    rows = random_examples(5, seed=8, min_len=4, max_len=9)
    (mb,) = plan_micro_batches([("a", rows[:2]), ("b", rows[2:])], 0, "cpu", row_layout="varlen")
    assert mb.input_ids.shape == (1, sum(len(r.input_ids) for r in rows))
    want_targets = []
    for r in rows:
        want_targets += [t for t in r.labels[1:] if t != IGNORE_INDEX]
    assert mb.targets.tolist() == want_targets
    assert mb.cu_seqlens.tolist()[-1] == mb.input_ids.shape[1]
    assert mb.token_counts == [sum(len(r.input_ids) for r in rows[:2]), sum(len(r.input_ids) for r in rows[2:])]


def test_grouped_label_loss_matches_cross_entropy():
    torch.manual_seed(0)
    head = torch.nn.Linear(16, 50, bias=False).requires_grad_(False)
    hidden = torch.randn(23, 16, requires_grad=True)
    targets = torch.randint(0, 50, (23,))
    groups = torch.tensor([0] * 9 + [2] * 14)
    sums = grouped_label_loss(hidden, head, targets, groups, 3, chunk_tokens=5)
    (sums * torch.tensor([0.5, 1.0, 2.0])).sum().backward()
    h2 = hidden.detach().clone().requires_grad_(True)
    ce = F.cross_entropy(head(h2), targets, reduction="none")
    want = torch.stack([ce[:9].sum(), ce.new_zeros(()), ce[9:].sum()])
    (want * torch.tensor([0.5, 1.0, 2.0])).sum().backward()
    assert torch.allclose(sums, want, rtol=1e-5)
    assert torch.allclose(hidden.grad, h2.grad, rtol=1e-5, atol=1e-7)


def test_varlen_attention_reference_is_per_sequence():
    torch.manual_seed(1)
    q, k, v = torch.randn(11, 4, 8), torch.randn(11, 2, 8), torch.randn(11, 2, 8)
    cu = torch.tensor([0, 5, 11], dtype=torch.int32)
    out = varlen_attention(q, k, v, cu, 6, 8**-0.5)
    first = F.scaled_dot_product_attention(
        q[:5].transpose(0, 1), k[:5].transpose(0, 1), v[:5].transpose(0, 1), is_causal=True, enable_gqa=True
    ).transpose(0, 1)
    assert torch.allclose(out[:5], first, atol=1e-6)


def test_fused_elementwise_is_reversible():
    model = tiny_model("qwen2")
    ids = torch.randint(1, 90, (2, 7))
    want = model(ids).logits
    assert fuse_elementwise(model) > 0
    got = model(ids).logits
    unfuse_elementwise(model)
    assert not any("forward" in m.__dict__ for m in model.modules())
    assert torch.allclose(got, want, atol=1e-5)


def test_storage_is_rebuilt_after_parameters_are_repointed():
    """Evaluation may page adapters (``p.data = ...``): the trainer notices and rebuilds the flat storage."""
    base = tiny_model("llama")
    packed = PackedLoraModel(base, TARGETS)
    trainer = PackedTrainer(packed, settings=SETTINGS, pad_id=0, device="cpu")
    trainer.add_job(AdapterJob("a0", CONFIGS[0], random_examples(6, seed=1), 4))
    trainer.add_job(AdapterJob("a1", CONFIGS[1], random_examples(6, seed=2), 4))
    trainer.step()
    assert packed.storage_intact(["a0", "a1"])
    for p in packed.parameters_of("a1"):
        p.data = p.data.clone()
    assert not packed.storage_intact(["a0", "a1"])
    before = {k: v.clone() for k, v in packed.state_dict_of("a1").items()}
    trainer.step()
    assert packed.storage_intact(["a0", "a1"])
    after = packed.state_dict_of("a1")
    assert any(rel_err(after[k], before[k]) > 0 for k in before if "lora_B" in k)  # it trained
    trainer.remove_job("a0")
    trainer.step()
    assert packed.stored_ids == ("a1",)


def test_gpu_triton_kernels_under_interpreter():
    """The fused SwiGLU and cross-entropy kernels (GPU paths) against eager, on Triton's CPU
    interpreter (fp32: the interpreter does not emulate bf16)."""
    code = textwrap.dedent(
        """
        import torch, torch.nn.functional as F
        from plora_hpo.kernels._interpret import patch_interpreter
        patch_interpreter()  # Triton 3.6 interpreter vs NumPy >= 2.4: loops with runtime bounds
        from plora_hpo.engine import loss
        from plora_hpo.engine.fused import _SiluMul
        torch.manual_seed(0)
        g = torch.randn(3, 5, 67, requires_grad=True); u = torch.randn(3, 5, 67, requires_grad=True)
        out = _SiluMul.apply(g, u); d = torch.randn_like(out); out.backward(d)
        g2 = g.detach().clone().requires_grad_(); u2 = u.detach().clone().requires_grad_()
        ref = F.silu(g2) * u2; ref.backward(d)
        for a, b in ((out, ref), (g.grad, g2.grad), (u.grad, u2.grad)):
            assert torch.allclose(a, b, atol=1e-5), (a - b).abs().max()
        loss._use_triton = lambda logits: True  # the kernel, on the interpreter
        loss._CE_BLOCK = 64
        logits = torch.randn(9, 301) * 4; targets = torch.randint(0, 301, (9,))
        want = F.cross_entropy(logits, targets, reduction="none")
        want_grad = torch.softmax(logits, -1) - F.one_hot(targets, 301)
        work = logits.clone()
        got = loss.cross_entropy_rows(work, targets, write_grad=True)
        assert torch.allclose(got, want, atol=1e-5), (got, want)
        assert torch.allclose(work, want_grad, atol=1e-6)
        print("ok")
        """
    )
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stderr[-2000:]


def test_flat_storage_through_triton_kernels_under_interpreter():
    """Flat (transposed-B) storage through the Triton kernels equals the reference path (fp32)."""
    code = textwrap.dedent(
        """
        import copy, os, torch
        from tests.engine.conftest import random_examples, tiny_model
        from plora_hpo.adapter import AdapterConfig
        from plora_hpo.engine import AdapterJob, OptimizerSettings, PackedLoraModel, PackedTrainer
        targets = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
        base = tiny_model("qwen2")
        def run(kernels):
            os.environ["PLORA_KERNELS"] = kernels
            packed = PackedLoraModel(copy.deepcopy(base), targets)
            trainer = PackedTrainer(packed, settings=OptimizerSettings(max_grad_norm=1.0), pad_id=0, device="cpu")
            for i, (r, b) in enumerate([(8, 2), (16, 1), (32, 3)]):
                config = AdapterConfig(rank=r, alpha=r, learning_rate=3e-3, batch_size=b, seed=i)
                trainer.add_job(AdapterJob(f"a{i}", config, random_examples(8, seed=i), 3))
            losses = []
            trainer.run(lambda r: losses.append(r.loss) or True)
            return losses, {a: packed.state_dict_of(a) for a in ("a0", "a1", "a2")}
        (ref_l, ref_w), (tri_l, tri_w) = run("reference"), run("triton")
        assert torch.allclose(torch.tensor(tri_l), torch.tensor(ref_l), rtol=1e-5), (tri_l, ref_l)
        for a in ref_w:
            for k, w in ref_w[a].items():
                assert float((tri_w[a][k] - w).norm() / w.norm().clamp_min(1e-30)) < 1e-4, (a, k)
        print("ok")
        """
    )
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600, cwd=root)
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stderr[-2000:]


def test_flat_storage_uses_flat_parameters_and_one_compute_copy():
    """Flat storage: one flat optimizer parameter per adapter, per-layer parameters are views of
    it, gradients reach the fp32 storage gradient through the compute copy, and a forward outside a
    step (copy stale after the update) sees the updated weights."""
    base = tiny_model("qwen2")
    packed = PackedLoraModel(copy.deepcopy(base), TARGETS)
    trainer = PackedTrainer(packed, settings=SETTINGS, pad_id=0, device="cpu")
    for i in range(2):
        trainer.add_job(AdapterJob(f"a{i}", CONFIGS[i], random_examples(6, seed=i), 4))
    assert [len(g["params"]) for g in trainer.optimizer.param_groups] == [len(packed.chunk_widths)] * 2
    flat = trainer.optimizer.param_groups[1]["params"][0]
    assert flat.shape == (CONFIGS[1].rank, packed.chunk_widths[0])
    hits = []
    original = packed_lora.adapted_linear

    def spy(x, weight, bias, a_cat, b_cat, layout, grads_into=None):
        storage = packed.flat_storage
        hits.append(grads_into is not None and a_cat.untyped_storage().data_ptr() == storage.compute[0].data_ptr())
        return original(x, weight, bias, a_cat, b_cat, layout, grads_into=grads_into)

    packed_lora.adapted_linear = spy
    try:
        trainer.step()
    finally:
        packed_lora.adapted_linear = original
    assert hits and all(hits)  # every layer call took the flat storage: compute copy in, its gradient out
    storage = packed.flat_storage
    assert flat is packed.flat_parameters("a1")[0]
    assert flat.data_ptr() == storage.master[0][storage.row_offsets[1]].data_ptr()
    for p in packed.parameters_of("a1"):
        assert p.untyped_storage().data_ptr() == storage.master[0].untyped_storage().data_ptr()
    assert not storage.fresh and float(storage.grad[0].abs().sum()) == 0.0  # updated, grads zeroed in place
    ids = torch.randint(1, 90, (2, 9))
    with packed.route([("a0", 1), ("a1", 1)]):
        stale_path = packed.model(ids).logits
    packed.release_storage()
    with packed.route([("a0", 1), ("a1", 1)]):
        want = packed.model(ids).logits
    assert torch.equal(stale_path, want)
    trainer.step()  # rebuilds the storage, same flat parameter objects (their AdamW state carries on)
    assert flat is trainer.optimizer.param_groups[1]["params"][0] and trainer.optimizer.state[flat]["step"] == 2


def test_bf16_compute_copy_is_one_cast_of_the_master():
    base = tiny_model("llama")
    packed = PackedLoraModel(copy.deepcopy(base), TARGETS)
    for i in range(2):
        packed.add_adapter(f"a{i}", CONFIGS[i])
    packed.build_storage(["a0", "a1"])
    packed.refresh_compute(torch.bfloat16)
    storage = packed.flat_storage
    assert storage.compute[0].dtype == torch.bfloat16
    assert torch.equal(storage.compute[0], storage.master[0].to(torch.bfloat16))
    layer = next(iter(packed.layers.values()))
    assert layer._slot.a.is_leaf and layer._slot.a.data_ptr() == storage.compute[0].data_ptr()
    layer.base.to(torch.bfloat16)
    x = torch.randn(5, layer.in_features).to(torch.bfloat16)
    with packed.route([("a0", 2), ("a1", 3)]):
        layer(x).float().square().sum().backward()
        layout = packed.router.current.layout(1)
    # the gradients went into the fp32 storage gradient, not to the bf16 leaves
    assert layer._slot.a.grad is None and layer._slot.b.grad is None
    a, b = (t.detach().clone().requires_grad_() for t in (layer._slot.a, layer._slot.b))
    adapted_linear(x, layer.base.weight, None, a, b, layout).float().square().sum().backward()
    for got, want in zip(layer._slot.grads, (a.grad, b.grad)):
        assert got.dtype == torch.float32 and torch.equal(got, want.float())
    assert float(b.grad.abs().sum()) > 0  # B starts at zero, so dA is zero but dB is not
    packed.router.cast_adapters = False
    packed.refresh_compute(torch.bfloat16)
    assert packed.flat_storage.compute is storage.master


def test_layers_are_chunked_so_kernel_offsets_stay_32_bit(monkeypatch):
    """Several storage buffers (chunks of layers) behave exactly like one."""
    from plora_hpo.engine import packed_lora

    reference = train("llama")
    monkeypatch.setattr(packed_lora, "_CHUNK_COLUMNS", 200)  # a few layers per chunk
    base = tiny_model("llama")
    assert len(PackedLoraModel(copy.deepcopy(base), TARGETS).chunk_widths) > 2
    assert_same(reference, train("llama"), tol=1e-6)


def test_per_layer_trainer_after_a_flat_storage_one_gets_dense_parameters():
    """Adapters kept in the model between trainers (benchmark rows): a per-layer-parameter trainer
    after a flat-storage one must not train strided views of the old flat parameters."""
    packed = PackedLoraModel(tiny_model("llama"), TARGETS)
    first = PackedTrainer(packed, settings=SETTINGS, pad_id=0, device="cpu")
    first.add_job(AdapterJob("a0", CONFIGS[0], random_examples(6, seed=1), 4))
    first.step()
    first.remove_job("a0")
    assert not all(p.is_contiguous() for p in packed.parameters_of("a0"))  # views of the flat one
    before = {k: v.clone() for k, v in packed.state_dict_of("a0").items()}
    second = PackedTrainer(packed, settings=SETTINGS, pad_id=0, device="cpu", flat_storage=False)
    second.add_job(AdapterJob("a0", CONFIGS[0], random_examples(6, seed=1), 4))
    assert all(p.is_contiguous() for p in packed.parameters_of("a0"))
    assert all(torch.equal(packed.state_dict_of("a0")[k], v) for k, v in before.items())
    second.step()


def test_prefetched_batches_follow_membership_changes():
    """The next step's batches are built during this step; a pack whose membership changes
    (an adapter finishes, one is pruned, one joins) trains exactly as one without prefetching."""
    base = tiny_model("qwen2")
    joiner = AdapterConfig(rank=8, alpha=8.0, learning_rate=3e-3, batch_size=2, seed=24)

    def train(prefetch: bool) -> tuple[list, dict, dict, int]:
        packed = PackedLoraModel(copy.deepcopy(base), TARGETS)
        trainer = PackedTrainer(packed, settings=SETTINGS, pad_id=0, device="cpu", prefetch=prefetch)
        for i, config in enumerate(CONFIGS):
            trainer.add_job(AdapterJob(f"a{i}", config, random_examples(7, seed=30 + i), STEPS[i]))
        history, prefetched, step = [], 0, 0
        while trainer.jobs:
            step += 1
            if step == 3:
                trainer.add_job(AdapterJob("joiner", joiner, random_examples(5, seed=39), 3))
            reports = trainer.step()
            history.append([(r.adapter_id, r.loss) for r in reports])
            prefetched += trainer._prefetched is not None
            for r in reports:
                if trainer.is_done(r.adapter_id) or (r.adapter_id == "a0" and r.step == 2):  # a0 is pruned
                    trainer.remove_job(r.adapter_id)
        positions = {a: trainer.stream_position(a) for a in trainer.active}
        weights = {a: packed.state_dict_of(a) for a in ("a0", "a1", "a2", "joiner")}
        return history, positions, weights, prefetched

    history, positions, weights, prefetched = train(prefetch=True)
    want_history, want_positions, want_weights, _ = train(prefetch=False)
    assert prefetched >= 3  # the run did train on prefetched batches
    assert history == want_history
    assert positions == want_positions
    for a, tensors in want_weights.items():
        for key, tensor in tensors.items():
            assert torch.equal(weights[a][key], tensor), (a, key)


def test_releasing_the_storage_without_room_for_a_copy_goes_through_host_memory(monkeypatch):
    """After an out-of-memory step the device may have no room to copy adapters out of the flat
    storage before it is freed: those copies go to host memory and come back, values intact."""
    packed = PackedLoraModel(tiny_model("llama"), TARGETS)
    for i in range(3):
        packed.add_adapter(f"a{i}", CONFIGS[i])
    with torch.no_grad():  # B starts at zero: give it values a lost copy would show
        for layer in packed.layers.values():
            for i in range(3):
                layer.lora_B[f"a{i}"].normal_(std=0.02)
    packed.build_storage(["a0", "a1", "a2"])
    want = {a: {k: v.clone() for k, v in packed.state_dict_of(a).items()} for a in ("a0", "a1", "a2")}
    clone, calls = torch.Tensor.clone, []

    def clone_until_full(self, *args, **kwargs):
        calls.append(1)
        if len(calls) > 1:  # the device fills up after the first copy
            raise torch.OutOfMemoryError("no room")
        return clone(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "clone", clone_until_full)
    packed.release_storage()
    monkeypatch.setattr(torch.Tensor, "clone", clone)
    assert len(calls) > 1 and packed.flat_storage is None
    for adapter_id, tensors in want.items():
        got = packed.state_dict_of(adapter_id)
        assert all(torch.equal(got[k], v) for k, v in tensors.items()), adapter_id
    packed.build_storage(["a1", "a2"])  # and the adapters pack again
    assert all(torch.equal(packed.state_dict_of("a2")[k], v) for k, v in want["a2"].items())
