"""The cost model's tensor-parallel terms against the split model itself, where they can be exact.

A real transformers model (Llama, Qwen2; fp32, CPU) is split by
:func:`~plora_hpo.engine.tensor_parallel.shard_model` in a gloo group of 2 and of 4 processes
(as ``tests/engine/test_tensor_parallel.py`` starts them), a pack of adapters trains one step on
it, and each rank's frozen weight bytes, adapter factor / gradient / AdamW bytes and the bytes
its step all-reduced are compared with :class:`~plora_hpo.planner.cost_model.CostModel`'s
per-GPU terms for the same shape and configs. Activations and seconds are not compared: they
are estimates that only measurements on the GPU calibrate.
"""

from __future__ import annotations

import json
import multiprocessing
import os
from dataclasses import asdict
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from plora_hpo.engine import AdapterJob, PackedLoraModel, PackedTrainer
from plora_hpo.engine import tensor_parallel as tp
from plora_hpo.models import shape_from_config
from plora_hpo.planner.cost_model import ROW_PARALLEL, CostModel, GpuSpec, Workload
from plora_hpo.shapes import ModelShape
from tests.engine.conftest import random_examples
from tests.engine.test_tensor_parallel import CONFIGS, SETTINGS, TARGETS, _free_port, tiny_model

SEQ_LEN = 12  # every example this long: the packed rows carry no padding
EXAMPLES = {a: random_examples(6, seed=90 + i, min_len=SEQ_LEN, max_len=SEQ_LEN) for i, a in enumerate(CONFIGS)}
# variant: (family, model overrides, trainer options)
VARIANTS = {
    "llama": ("llama", {}, {}),
    "llama-tied-checkpointed": ("llama", {"tie_word_embeddings": True}, {"activation_checkpointing": True}),
    "qwen2-micro-batched": ("qwen2", {}, {"micro_batch_tokens": 2 * SEQ_LEN}),  # q/k/v carry biases
}


def _bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _measure(variant: str) -> dict:
    family, overrides, options = VARIANTS[variant]
    model = tiny_model(family, **overrides)
    shape = shape_from_config(model.config)
    plan = tp.shard_model(model)
    params = dict(model.named_parameters())  # tied embeddings once
    weights = _bytes(p for n, p in params.items() if not n.endswith(".bias"))
    biases = _bytes(p for n, p in params.items() if n.endswith(".bias"))
    packed = PackedLoraModel(model, TARGETS)
    trainer = PackedTrainer(packed, settings=SETTINGS, pad_id=0, device="cpu", prefetch=False, **options)
    for adapter_id, config in CONFIGS.items():
        trainer.add_job(AdapterJob(adapter_id, config, EXAMPLES[adapter_id], 2))
    reduced: list[list[int]] = []  # shape of every tensor the step all-reduces (all fp32 here)
    whole = plan.all_reduce
    plan.all_reduce = lambda t: reduced.append(list(t.shape)) or whole(t)
    trainer.step()
    plan.all_reduce = whole
    storage = packed.flat_storage
    assert storage is not None and storage.ids == tuple(CONFIGS)
    state = [t for s in trainer.optimizer.state.values() for t in s.values() if t.dim() > 0]  # exp_avg(_sq)
    return {
        "shape": asdict(shape),
        "weights": weights,
        "biases": biases,
        "factors": {a: sum(f.numel() for f in packed.flat_parameters(a)) for a in CONFIGS},
        "adapter_bytes": _bytes(storage.master) + _bytes(storage.grad) + _bytes(state),
        "reduced": reduced,
        "forwards": trainer.stats.micro_batches,
    }


def _worker(rank: int, degree: int, port: int, out: str) -> None:
    torch.set_num_threads(1)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=degree)
    try:
        result = {variant: _measure(variant) for variant in VARIANTS}
        (Path(out) / f"rank{rank}.json").write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


def test_the_planner_splits_projections_as_the_engine_does():
    assert set(ROW_PARALLEL) == set(tp.ROW_PARALLEL)
    assert set(tp.COLUMN_PARALLEL) | set(tp.ROW_PARALLEL) == set(TARGETS)


@pytest.mark.parametrize("degree", [2, 4])
def test_per_gpu_weights_adapters_and_all_reduces_match_the_split_model(degree, tmp_path):
    multiprocessing.get_context("forkserver").set_forkserver_preload([__name__])
    torch.multiprocessing.start_processes(
        _worker, args=(degree, _free_port(), str(tmp_path)), nprocs=degree, start_method="forkserver"
    )
    configs = [CONFIGS[a] for a in CONFIGS]
    for rank in range(degree):
        measured = json.loads((tmp_path / f"rank{rank}.json").read_text())
        for variant, m in measured.items():
            where = f"{variant}, rank {rank} of {degree}"
            shape = ModelShape(**m["shape"])
            _, _, options = VARIANTS[variant]
            checkpointing = options.get("activation_checkpointing", False)
            workload = Workload(shape, SEQ_LEN, TARGETS, dtype_bytes=4, checkpointing=checkpointing)
            cm = CostModel(workload, GpuSpec.host(1.0))

            # frozen base: embeddings, norms and LM head whole, each projection's 1/degree
            assert m["weights"] == cm.weight_bytes(degree), where
            # the shape (and so the cost model) counts no biases: Qwen2's q/k/v ones, split with their rows
            kv = shape.kv_heads * shape.head_dim
            assert m["biases"] == (4 * shape.layers * (shape.hidden + 2 * kv) // degree if "qwen2" in variant else 0)

            # adapters: each one's factors on this rank, then factors + gradients + AdamW moments of the pack
            for adapter_id, config in CONFIGS.items():
                assert m["factors"][adapter_id] == cm.adapter_params(config, degree), f"{where}: {adapter_id}"
            assert m["adapter_bytes"] == sum(cm.adapter_memory_terms(c, degree).adapters for c in configs), where
            assert m["adapter_bytes"] == cm.memory_terms(configs, degree).adapters, where

            # all-reduced bytes: every block's hidden states for all of the pack's tokens, and the
            # replicated factors' gradients; the one call the model leaves out sums K gradient norms
            reduced = [s for s in m["reduced"] if s != [len(CONFIGS)]]
            assert len(reduced) == len(m["reduced"]) - 1
            hidden = [s for s in reduced if len(s) > 1]
            assert all(s[-1] == shape.hidden for s in hidden)
            # per forward: 2 per layer, as many in the backward but the first block's (its input, the
            # frozen embeddings, needs no gradient), and the attention block's again when the backward
            # recomputes a layer (it stops at the last saved tensor, before the MLP block's all-reduce)
            per_forward = (5 if checkpointing else 4) * shape.layers - 1
            assert len(hidden) == per_forward * m["forwards"], where
            real = 4 * sum(torch.Size(s).numel() for s in reduced)
            assert real == sum(cm.comm_bytes(c, degree) for c in configs), where
