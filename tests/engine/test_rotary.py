"""The fused rotary embedding (``plora_hpo.engine.rotary``) on Triton's CPU interpreter (fp32):
against Hugging Face's own function in fp64, and swapped into real attention modules; on a GPU,
how many variants of it Triton compiles."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


def _run(code: str) -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], env=env, capture_output=True, text=True, timeout=600, cwd=ROOT
    )
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stderr[-3000:]


def test_kernel_matches_hugging_face_in_fp64():
    """Values and gradients of q and k; strided (transposed) inputs as attention has them, cos
    broadcast over the batch, a head size whose half is no power of two, more heads than one
    block of the kernel."""
    _run(
        """
        import torch
        from transformers.models.qwen2.modeling_qwen2 import apply_rotary_pos_emb as hf
        from plora_hpo.engine.rotary import rotary
        g = torch.Generator().manual_seed(0)
        for batch, n_q, n_k, seq, dim, cos_batch in ((2, 5, 2, 7, 16, 2), (3, 20, 4, 5, 12, 1), (1, 3, 3, 9, 8, 1)):
            q = torch.randn(batch, seq, n_q, dim, generator=g).transpose(1, 2).requires_grad_()
            k = torch.randn(batch, seq, n_k, dim, generator=g).transpose(1, 2).requires_grad_()
            cos, sin = (torch.randn(cos_batch, seq, dim, generator=g) for _ in range(2))
            dq, dk = torch.randn(batch, n_q, seq, dim, generator=g), torch.randn(batch, n_k, seq, dim, generator=g)
            got = rotary(q, k, cos, sin)
            got_grads = torch.autograd.grad(got, (q, k), (dq, dk))
            ref = [t.detach().double().requires_grad_() for t in (q, k)]
            want = hf(*ref, cos.double(), sin.double())
            want_grads = torch.autograd.grad(want, ref, (dq.double(), dk.double()))
            for a, b in (*zip(got, want), *zip(got_grads, want_grads)):
                err = float((a.double() - b).norm() / b.norm())
                assert err < 1e-6, (batch, n_q, dim, err)
            assert got[0].stride() == q.stride()  # laid out like the projection's output
        print("ok")
        """
    )


def test_swapped_into_attention_modules_and_reversible():
    """Tiny Llama and Qwen2 models: with the kernel (the device check forced on for the
    interpreter) the logits and input gradients equal the eager model's; the modeling module's
    function runs the original outside a patched module, and after unfusing."""
    _run(
        """
        import copy, sys, torch
        from tests.engine.conftest import tiny_model
        from plora_hpo.engine import rotary
        from plora_hpo.engine.fused import fuse_elementwise, unfuse_elementwise
        rotary.on_device = lambda q: True
        calls = []
        kernel = rotary.rotary
        rotary.rotary = lambda *a: calls.append(1) or kernel(*a)
        for family in ("llama", "qwen2"):
            base = tiny_model(family)
            ids = torch.randint(1, 90, (2, 9))
            def logits_and_grad(model):
                embeds = model.get_input_embeddings()(ids).detach().requires_grad_()
                out = model(inputs_embeds=embeds).logits
                (grad,) = torch.autograd.grad(out.square().sum(), embeds)
                return out, grad
            want = logits_and_grad(base)
            model = copy.deepcopy(base)
            fuse_elementwise(model)
            got = logits_and_grad(model)  # the first call also probes the modeling module's function
            before = len(calls)
            logits_and_grad(model)
            assert len(calls) - before == 2, calls  # one per layer
            for a, b in zip(got, want):
                assert torch.allclose(a, b, atol=1e-5, rtol=1e-5), (a - b).abs().max()
            modeling = sys.modules[type(model.model.layers[0].self_attn).__module__]
            before = len(calls)
            q = torch.randn(1, 3, 4, 12).transpose(1, 2)
            modeling.apply_rotary_pos_emb(q, q, torch.ones(1, 3, 12), torch.zeros(1, 3, 12))
            unfuse_elementwise(model)
            logits_and_grad(model)
            assert len(calls) == before, "the kernel ran outside a fused attention module"
        print("ok")
        """
    )


def test_kernel_is_not_used_where_it_differs_from_the_model():
    """A model whose ``apply_rotary_pos_emb`` is not the half-rotation (here: interleaved pairs)
    keeps its own function: the probe sees the kernel compute something else."""
    _run(
        """
        import sys, textwrap, types, torch
        from plora_hpo.engine import rotary
        rotary.on_device = lambda q: True
        modeling = types.ModuleType("interleaved_modeling")
        sys.modules[modeling.__name__] = modeling
        exec(textwrap.dedent('''
        import torch
        from torch import nn
        def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
            def rot(x):
                pairs = x.unflatten(-1, (-1, 2))
                return torch.stack((-pairs[..., 1], pairs[..., 0]), -1).flatten(-2)
            cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
            return q * cos + rot(q) * sin, k * cos + rot(k) * sin
        class Attention(nn.Module):
            def forward(self, q, k, cos, sin):
                return apply_rotary_pos_emb(q, k, cos, sin)
        '''), modeling.__dict__)
        attention = modeling.Attention()
        q, k = torch.randn(1, 2, 3, 8), torch.randn(1, 2, 3, 8)
        cos, sin = torch.randn(1, 3, 8), torch.randn(1, 3, 8)
        want = attention(q, k, cos, sin)
        assert rotary.fuse_rotary(attention)
        got = attention(q, k, cos, sin)
        assert all(torch.equal(a, b) for a, b in zip(got, want))
        assert rotary._probed == {modeling.apply_rotary_pos_emb._plora_original: False}
        print("ok")
        """
    )


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_one_compiled_variant_each_way_whatever_the_sequence_length(tmp_path, monkeypatch):
    """The length follows the batch: a length Triton specialised (divisible by 16 or not) made a
    pack's later steps compile the kernel again, mid-sweep. Counted by the timeline's compile
    watcher, which also shows that it records each compile with the kernel's name."""
    from triton import knobs

    from plora_hpo import timeline
    from plora_hpo.engine.rotary import _rotary_kernel, rotary

    path = tmp_path / "timeline.jsonl"
    monkeypatch.setenv(timeline.ENV, str(path))
    for hook in ("jit_cache_hook", "jit_post_compile_hook"):
        monkeypatch.setattr(knobs.runtime, hook, getattr(knobs.runtime, hook))  # restored afterwards
    timeline.watch_triton_compiles()
    _rotary_kernel.device_caches.clear()  # nothing compiled yet in this process
    for seq in (48, 50, 64, 33, 1):
        q = torch.randn(2, seq, 4, 64, device="cuda", dtype=torch.bfloat16).transpose(1, 2).requires_grad_()
        k = torch.randn(2, seq, 2, 64, device="cuda", dtype=torch.bfloat16).transpose(1, 2).requires_grad_()
        cos, sin = (torch.randn(1, seq, 64, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        out = rotary(q, k, cos, sin)
        torch.autograd.grad(out, (q, k), [torch.ones_like(t) for t in out])
    torch.cuda.synchronize()
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    compiles = [(r["kernel"], r["thread"]) for r in rows if r["phase"] == "triton-compile"]
    assert [kernel for kernel, _ in compiles] == ["_rotary_kernel"] * 2  # forward and backward, once each
    assert compiles[0][1] == threading.current_thread().name  # the backward runs on autograd's device thread
    assert all(r["start"] <= r["end"] for r in rows)
