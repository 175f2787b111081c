"""Tensor parallelism for one pack: the frozen base and its LoRA adapters split across a process group.

A pack of degree d runs on d processes (one ``torch.distributed`` group). Every process holds the
same embedding, norms and LM head and computes the same logits and losses; each decoder
projection is split Megatron-style:

* ``q_proj``, ``k_proj``, ``v_proj``, ``gate_proj``, ``up_proj`` are *column-parallel*: rank i
  keeps rows ``[i·n/d, (i+1)·n/d)`` of the weight and bias (whole attention heads, whole
  key-value heads, a slice of the MLP's intermediate features);
* ``o_proj`` and ``down_proj`` are *row-parallel*: rank i keeps the matching columns, produces a
  partial sum, and one all-reduce per block completes it (the bias stays on rank 0 only, so it
  is added once).

Each attention and MLP block's input passes the *copy* op (identity forward, all-reduce of the
gradient backward) and its output the *reduce* op (all-reduce forward, identity backward), so the
residual stream and its gradient are the same on every rank. Transformers' attention reshapes
with ``-1`` heads, so the local head counts need no bookkeeping; the grouping of query heads per
key-value head is unchanged because both counts are divided by d.

The adapters follow their base layer (S-LoRA): on a column-parallel layer A is replicated and B
split by output rows; on a row-parallel layer A is split by input columns and B replicated, and
``s·B·A_i·x_i`` is a partial sum that the block's all-reduce completes. A replicated factor's
gradient is a partial sum on each rank (:func:`all_reduce_columns` completes it); a split
factor's gradient is exact. An adapter's gradient norm counts split factors' squares summed over
ranks and replicated ones once (:func:`flat_grad_norms`).

Boundary: this module splits a model and its adapters' layout across a group the caller created
(``torch.distributed.init_process_group``/``new_group``) and provides the collectives the
packed model and trainer call; it starts no processes and knows nothing of data, optimizers or
scheduling. Every rank must make the same calls in the same order (same jobs, same steps).
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.hooks import RemovableHandle

COLUMN_PARALLEL = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
ROW_PARALLEL = ("o_proj", "down_proj")
_ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
_MLP = ("gate_proj", "up_proj", "down_proj")

_PLANS: weakref.WeakKeyDictionary[nn.Module, TensorParallelPlan] = weakref.WeakKeyDictionary()


@dataclass(frozen=True)
class LinearShard:
    """Which part of one projection (and of its adapters' factors) this rank holds.

    ``in_features``/``out_features`` are the full layer's; the rank's ``nn.Linear`` holds
    ``out_features/degree`` rows (column-parallel) or ``in_features/degree`` columns (row-parallel).
    """

    style: Literal["column", "row"]
    index: int
    degree: int
    in_features: int
    out_features: int

    def a_of(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's part of a full A (r × in_features): all of it, or its input columns."""
        return full if self.style == "column" else full.chunk(self.degree, dim=1)[self.index]

    def b_of(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's part of a full B (out_features × r): its output rows, or all of it."""
        return full.chunk(self.degree, dim=0)[self.index] if self.style == "column" else full

    @property
    def split_dim(self) -> tuple[str, int]:
        """The split factor and the dimension it is split along: ("B", 0) or ("A", 1)."""
        return ("B", 0) if self.style == "column" else ("A", 1)


@dataclass
class TensorParallelPlan:
    """A model split by :func:`shard_model`: its group, this rank's place and every split layer.

    ``shards`` maps module paths (``model.named_modules()`` names) to their :class:`LinearShard`.
    """

    group: dist.ProcessGroup | None
    degree: int
    index: int
    shards: dict[str, LinearShard]
    hooks: list[RemovableHandle] = field(default_factory=list)

    def all_reduce(self, tensor: torch.Tensor) -> None:
        """Sum ``tensor`` (contiguous) over the group, in place."""
        dist.all_reduce(tensor, group=self.group)


def plan_of(model: nn.Module) -> TensorParallelPlan | None:
    """The plan :func:`shard_model` applied to ``model`` (``None``: the model is whole)."""
    return _PLANS.get(model)


def check_degree(config: object, degree: int) -> None:
    """Raise ``ValueError`` unless ``degree`` divides the heads, key-value heads and MLP width.

    ``config`` is a transformers config of a Llama-style model (``num_attention_heads``,
    ``num_key_value_heads``, ``intermediate_size``).
    """
    heads = int(config.num_attention_heads)
    kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
    intermediate = int(config.intermediate_size)
    if degree >= 1 and not (heads % degree or kv_heads % degree or intermediate % degree):
        return
    common = math.gcd(heads, kv_heads, intermediate)
    valid = ", ".join(str(2**i) for i in range(common.bit_length()) if common % 2**i == 0)
    raise ValueError(
        f"tensor-parallel degree {degree} does not divide the model's {heads} attention heads, "
        f"{kv_heads} key-value heads and intermediate size {intermediate}; use a degree among {valid}"
    )


def shard_model(model: nn.Module, group: dist.ProcessGroup | None = None) -> TensorParallelPlan:
    """Split ``model``'s decoder projections across ``group`` (default: the world), in place.

    Call on every rank of the group, on the same whole model, before
    :class:`~plora_hpo.engine.packed_lora.PackedLoraModel` wraps it (which then finds the plan
    with :func:`plan_of` and splits the adapters to match). Each projection keeps only this
    rank's rows or columns; the attention and MLP blocks get the copy/reduce hooks.

    Raises:
        ValueError: the degree does not divide the heads, key-value heads or intermediate size,
            the model was already split or wrapped, or it is not a Llama-style decoder.
    """
    if plan_of(model) is not None:
        raise ValueError(f"{type(model).__name__} is already split for tensor parallelism")
    degree, index = dist.get_world_size(group), dist.get_rank(group)
    check_degree(model.config, degree)
    attention = [m for m in model.modules() if all(hasattr(m, n) for n in _ATTENTION)]
    mlps = [m for m in model.modules() if all(hasattr(m, n) for n in _MLP)]
    layers = getattr(model.config, "num_hidden_layers", None)
    if not attention or len(attention) != len(mlps) or (layers is not None and len(attention) != layers):
        raise ValueError(
            f"cannot split {type(model).__name__}: tensor parallelism needs a Llama-style decoder "
            f"({', '.join(_ATTENTION)} and {', '.join(_MLP)} in every layer)"
        )
    shards: dict[str, LinearShard] = {}
    for name, module in list(model.named_modules()):
        leaf = name.rsplit(".", 1)[-1]
        if leaf not in COLUMN_PARALLEL and leaf not in ROW_PARALLEL:
            continue
        if type(module) is not nn.Linear:
            raise ValueError(f"cannot split {name}: a plain nn.Linear is needed (split before wrapping adapters)")
        style: Literal["column", "row"] = "column" if leaf in COLUMN_PARALLEL else "row"
        shards[name] = _split_linear(module, style, index, degree)
    plan = TensorParallelPlan(group, degree, index, shards)
    for block in attention + mlps:
        plan.hooks.append(block.register_forward_pre_hook(_copy_hook(plan), with_kwargs=True))
        plan.hooks.append(block.register_forward_hook(_reduce_hook(plan)))
    _PLANS[model] = plan
    return plan


def _split_linear(module: nn.Linear, style: Literal["column", "row"], index: int, degree: int) -> LinearShard:
    shard = LinearShard(style, index, degree, module.in_features, module.out_features)
    weight, bias = module.weight, module.bias
    with torch.no_grad():
        if style == "column":
            local_weight = weight.chunk(degree, dim=0)[index].clone()
            local_bias = None if bias is None else bias.chunk(degree, dim=0)[index].clone()
            module.out_features //= degree
        else:
            local_weight = weight.chunk(degree, dim=1)[index].contiguous().clone()
            local_bias = None if bias is None or index != 0 else bias.clone()  # added once, by rank 0
            module.in_features //= degree
    module.weight = nn.Parameter(local_weight, requires_grad=weight.requires_grad)
    if local_bias is None:
        module.register_parameter("bias", None)
    else:
        module.bias = nn.Parameter(local_bias, requires_grad=bias.requires_grad)
    return shard


# --- the two collectives of a block (autograd-aware) -------------------------------------------


class _CopyToGroup(torch.autograd.Function):
    """Identity forward; backward sums the gradient over the group (the block's input is shared)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, plan: TensorParallelPlan) -> torch.Tensor:  # type: ignore[override]
        ctx.plan = plan
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        grad = grad.clone(memory_format=torch.contiguous_format)
        ctx.plan.all_reduce(grad)
        return grad, None


class _ReduceFromGroup(torch.autograd.Function):
    """Forward sums the ranks' partial outputs; backward passes the (replicated) gradient through.

    ``torch.distributed.nn.functional.all_reduce`` would all-reduce the gradient as well, which
    multiplies a replicated gradient by the degree; Megatron's reduce op is this one.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, plan: TensorParallelPlan) -> torch.Tensor:  # type: ignore[override]
        out = x.clone(memory_format=torch.contiguous_format)
        plan.all_reduce(out)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        return grad, None


def copy_to_group(x: torch.Tensor, plan: TensorParallelPlan) -> torch.Tensor:
    return _CopyToGroup.apply(x, plan)


def reduce_from_group(x: torch.Tensor, plan: TensorParallelPlan) -> torch.Tensor:
    return _ReduceFromGroup.apply(x, plan)


def _copy_hook(plan: TensorParallelPlan):
    def hook(module: nn.Module, args: tuple, kwargs: dict):
        if args:
            return (copy_to_group(args[0], plan), *args[1:]), kwargs
        kwargs = dict(kwargs)
        kwargs["hidden_states"] = copy_to_group(kwargs["hidden_states"], plan)
        return args, kwargs

    return hook


def _reduce_hook(plan: TensorParallelPlan):
    def hook(module: nn.Module, args: tuple, output):
        if isinstance(output, tuple):  # attention: (output, weights)
            return (reduce_from_group(output[0], plan), *output[1:])
        return reduce_from_group(output, plan)

    return hook


# --- the adapters' flat storage under a split ---------------------------------------------------


@dataclass(frozen=True)
class StorageColumns:
    """Per storage chunk: the columns of replicated factors whose gradients are partial sums
    (``partial``, an index) and the columns of split factors (``split``, a float 0/1 mask)."""

    partial: list[torch.Tensor]
    split: list[torch.Tensor]


def storage_columns(
    layers: Iterable[tuple[LinearShard | None, int, int, int, int]],
    chunk_widths: Sequence[int],
    device: torch.device,
) -> StorageColumns:
    """Classify the columns of a flat storage row.

    ``layers`` gives, per adapted layer, ``(shard, chunk, first column, d_in, d_out)`` of its
    local A (``d_in`` columns) followed by its local Bᵀ (``d_out`` columns). An unsplit layer's
    factors see replicated inputs and outputs: their gradients are already whole on every rank.
    """
    partial: list[list[int]] = [[] for _ in chunk_widths]
    split = [torch.zeros(w, dtype=torch.float32) for w in chunk_widths]
    for shard, chunk, col_a, d_in, d_out in layers:
        if shard is None:
            continue
        a_cols, b_cols = range(col_a, col_a + d_in), range(col_a + d_in, col_a + d_in + d_out)
        replicated, divided = (a_cols, b_cols) if shard.style == "column" else (b_cols, a_cols)
        partial[chunk].extend(replicated)
        split[chunk][divided.start : divided.stop] = 1.0
    return StorageColumns(
        [torch.tensor(cols, dtype=torch.long, device=device) for cols in partial],
        [mask.to(device) for mask in split],
    )


def all_reduce_columns(plan: TensorParallelPlan, grads: Sequence[torch.Tensor], columns: StorageColumns) -> None:
    """Complete the replicated factors' gradients: sum their columns of ``grads`` over the group
    (one all-reduce for every chunk), in place."""
    parts = [(g, cols) for g, cols in zip(grads, columns.partial) if cols.numel() and g.shape[0]]
    if not parts:
        return
    gathered = [g.index_select(1, cols) for g, cols in parts]
    flat = torch.cat([t.reshape(-1) for t in gathered])
    plan.all_reduce(flat)
    offset = 0
    for (g, cols), t in zip(parts, gathered):
        g.index_copy_(1, cols, flat[offset : offset + t.numel()].view_as(t))
        offset += t.numel()


def flat_grad_norms(
    plan: TensorParallelPlan,
    grads: Sequence[torch.Tensor],
    columns: StorageColumns,
    row_adapter: torch.Tensor,
    adapters: int,
) -> torch.Tensor:
    """Each adapter's global gradient norm over the storage gradient ``grads`` (after
    :func:`all_reduce_columns`): split factors' squares summed over the group, replicated ones
    counted once. ``row_adapter`` maps storage rows to adapters; returns ``(adapters,)`` fp32."""
    split_sq = torch.zeros(adapters, dtype=torch.float32, device=row_adapter.device)
    whole_sq = torch.zeros_like(split_sq)
    for g, mask in zip(grads, columns.split):
        squares = g.float().square()
        split_sq.index_add_(0, row_adapter, torch.mv(squares, mask))
        whole_sq.index_add_(0, row_adapter, torch.mv(squares, 1.0 - mask))
    plan.all_reduce(split_sq)
    return (split_sq + whole_sq).sqrt()


def gather_factors(
    plan: TensorParallelPlan,
    factors: Sequence[tuple[str, LinearShard | None, torch.Tensor, torch.Tensor]],
) -> dict[str, torch.Tensor]:
    """Full ``{"<path>.lora_A.weight": A, "<path>.lora_B.weight": B}`` of one adapter from every
    rank's parts ``(path, shard, local A, local B)``: one all-gather for all split factors.
    A collective: every rank of the group calls it with the same layers."""
    out: dict[str, torch.Tensor] = {}
    local: list[torch.Tensor] = []
    for name, shard, a, b in factors:
        out[f"{name}.lora_A.weight"], out[f"{name}.lora_B.weight"] = a.detach(), b.detach()
        if shard is not None:
            local.append((b if shard.style == "column" else a).detach())
    if not local:
        return out
    flat = torch.cat([t.reshape(-1) for t in local])
    parts = [torch.empty_like(flat) for _ in range(plan.degree)]
    dist.all_gather(parts, flat.contiguous(), group=plan.group)
    offset = 0
    for name, shard, a, b in factors:
        if shard is None:
            continue
        factor, dim = shard.split_dim
        like = b if factor == "B" else a
        n = like.numel()
        full = torch.cat([p[offset : offset + n].view(like.shape) for p in parts], dim=dim)
        out[f"{name}.lora_{factor}.weight"] = full
        offset += n
    return out
