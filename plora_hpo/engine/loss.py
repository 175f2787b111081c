"""Per-adapter next-token loss that never keeps full-vocabulary logits alive.

Only the hidden states of trained positions go through the LM head, a chunk of rows at a time.
The LM head is frozen, so the loss's only gradient is the one with respect to those hidden
states: it is computed in the forward, chunk by chunk, right after the chunk's logits, and the
logits are dropped before the next chunk. Peak memory is one chunk of logits instead of every
trained token's logits, which autograd would otherwise keep until the backward.

On CUDA one Triton kernel per chunk reads the bf16 logits, computes each row's log-sum-exp in
fp32 and overwrites the logits with ``softmax − onehot`` (the logits' gradient) in place: about
six bytes per logit instead of the ~30 that the eager upcast/logsumexp/exp/cast chain moves
(152k-wide rows make this a visible share of a small model's step).
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

try:  # optional: the CPU path needs no Triton
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None

_CE_BLOCK = 4096

if triton is not None:

    @triton.jit
    def _cross_entropy_kernel(logits_ptr, targets_ptr, lse_ptr, target_logit_ptr, n_cols, stride_row,
                              BLOCK: tl.constexpr, WRITE_GRAD: tl.constexpr):  # fmt: skip
        """Per row: lse = log Σ exp(x), x[target]; optionally x ← softmax(x) − onehot(target)."""
        row = tl.program_id(0).to(tl.int64)
        base = logits_ptr + row * stride_row
        target = tl.load(targets_ptr + row)
        first = tl.arange(0, BLOCK)
        m = tl.max(tl.load(base + first, mask=first < n_cols, other=float("-inf")).to(tl.float32), 0)
        s = tl.zeros((), dtype=tl.float32)
        for start in range(0, n_cols, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            x = tl.load(base + cols, mask=cols < n_cols, other=float("-inf")).to(tl.float32)
            m_new = tl.maximum(m, tl.max(x, 0))
            s = s * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), 0)
            m = m_new
        lse = m + tl.log(s)
        tl.store(lse_ptr + row, lse)
        tl.store(target_logit_ptr + row, tl.load(base + target).to(tl.float32))
        if WRITE_GRAD:
            for start in range(0, n_cols, BLOCK):
                cols = start + tl.arange(0, BLOCK)
                mask = cols < n_cols
                x = tl.load(base + cols, mask=mask, other=0.0).to(tl.float32)
                p = tl.exp(x - lse)
                p = tl.where(cols == target, p - 1.0, p)
                tl.store(base + cols, p.to(logits_ptr.dtype.element_ty), mask=mask)


def _use_triton(logits: torch.Tensor) -> bool:
    return (
        triton is not None
        and logits.is_cuda
        and logits.is_contiguous()
        and os.environ.get("PLORA_FUSED_CE", "1") != "0"
    )


def cross_entropy_rows(logits: torch.Tensor, targets: torch.Tensor, *, write_grad: bool) -> torch.Tensor:
    """Per-row cross-entropy (fp32) of ``(n, vocab)`` logits; with ``write_grad`` the logits are
    overwritten with their gradient ``softmax − onehot`` (in the logits' dtype)."""
    if _use_triton(logits):
        n, vocab = logits.shape
        lse = torch.empty(n, dtype=torch.float32, device=logits.device)
        target_logit = torch.empty_like(lse)
        if n:
            _cross_entropy_kernel[(n,)](
                logits, targets, lse, target_logit, vocab, logits.stride(0),
                BLOCK=_CE_BLOCK, WRITE_GRAD=write_grad, num_warps=16,
            )  # fmt: skip
        return lse - target_logit
    full = logits.float()
    lse = torch.logsumexp(full, dim=-1)
    ce = lse - full.gather(1, targets.unsqueeze(1)).squeeze(1)
    if write_grad:
        probs = full.sub_(lse.unsqueeze(1)).exp_()
        probs.scatter_add_(1, targets.unsqueeze(1), probs.new_full((logits.shape[0], 1), -1.0))
        logits.copy_(probs)
    return ce


class _LabelCrossEntropy(torch.autograd.Function):
    """``sums[g] = Σ_{t in group g} CE(W·h_t + b, y_t)`` with the hidden gradient precomputed."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: torch.autograd.function.FunctionCtx,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        targets: torch.Tensor,
        groups: torch.Tensor,
        num_groups: int,
        chunk: int,
    ) -> torch.Tensor:
        n = hidden.shape[0]
        sums = torch.zeros(num_groups, dtype=torch.float32, device=hidden.device)
        want_grad = ctx.needs_input_grad[0]
        grad = torch.empty_like(hidden) if want_grad else None
        for start in range(0, n, chunk):
            stop = min(n, start + chunk)
            h, t = hidden[start:stop], targets[start:stop]
            logits = F.linear(h, weight, bias)
            ce = cross_entropy_rows(logits, t, write_grad=want_grad)
            sums.index_add_(0, groups[start:stop], ce)
            if want_grad:
                grad[start:stop] = logits.to(weight.dtype) @ weight  # logits now hold their gradient
            del logits
        ctx.save_for_backward(grad, groups)
        return sums

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad_sums: torch.Tensor):  # type: ignore[override]
        grad, groups = ctx.saved_tensors
        d_hidden = None
        if ctx.needs_input_grad[0]:
            d_hidden = grad * grad_sums[groups].unsqueeze(1).to(grad.dtype)
        return d_hidden, None, None, None, None, None, None


def grouped_label_loss(
    hidden: torch.Tensor,
    lm_head: torch.nn.Module,
    targets: torch.Tensor,
    groups: torch.Tensor,
    num_groups: int,
    *,
    chunk_tokens: int = 4096,
) -> torch.Tensor:
    """Summed cross-entropy per group of the rows of ``hidden`` (``(n, hidden)``, trained positions).

    Args:
        hidden: final hidden states of the positions that predict a trained token.
        lm_head: the model's (frozen) output projection, an ``nn.Linear``.
        targets: ``(n,)`` the token each row predicts.
        groups: ``(n,)`` group (adapter slot) of each row.
        num_groups: length of the result.
        chunk_tokens: rows per LM-head chunk (memory: ``chunk × vocab`` fp32 logits at a time).

    Returns:
        ``(num_groups,)`` fp32 sums; divide by each group's token count for the mean loss.
    """
    if chunk_tokens <= 0:
        raise ValueError(f"chunk_tokens must be positive, got {chunk_tokens}")
    if any(p.requires_grad for p in lm_head.parameters()):
        raise ValueError("grouped_label_loss assumes a frozen LM head (no weight gradient)")
    return _LabelCrossEntropy.apply(hidden, lm_head.weight, lm_head.bias, targets, groups, num_groups, chunk_tokens)
