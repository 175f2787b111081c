"""K LoRA adapters of mixed rank injected into one frozen base model.

Every target ``nn.Linear`` is replaced by a :class:`PackedLoraLinear` that keeps the base layer
and one (A, B) pair per adapter. A :class:`Router` tells all layers which rows of the current
batch belong to which adapter, so one forward pass of the base serves every adapter and each
adapter touches only its own rows (gradients stay isolated).

Flat storage (the trainer's fast path): :meth:`PackedLoraModel.build_storage` moves the fp32
factors of the adapters being trained into one buffer of every layer's factors, one contiguous
row block per adapter (:class:`_FlatStorage`). Each adapter's row block is its *flat parameter*
(:meth:`PackedLoraModel.flat_parameters`; one tensor per chunk of layers, usually one): what its
optimizer group, gradient norm and clipping see, so a step's AdamW, norms and clipping run on a
few flat tensors per adapter instead of layers × 2.
Its per-layer ``lora_A``/``lora_B`` parameters (what export and evaluation see) are views into it.
Once per step the whole buffer is cast to the activations' dtype in one kernel (bf16 on the GPU);
a layer hands the kernel strided column slices of that copy (its A_cat and Bᵀ_cat, no copies),
and the weight-gradient kernels add into the matching slices of the fp32 gradient buffer
themselves (no per-layer gradient tensors, casts or adds). A forward whose route lists exactly the
stored adapters in that order, while the copy is fresh, takes this path; any other route
(evaluation, a different order) concatenates the per-layer parameters on every call. Both
paths compute the same function and put the same gradients on the adapters.

Frozen views (evaluation's fast path): :meth:`PackedLoraModel.frozen_view` concatenates every
layer's factors for one routing order once (:class:`FrozenFactors`) instead of on every call,
and may hand each layer a *fast path*, a callable the layer consults before its own kernels
(:data:`FastPath`). Callers that serve many adapters with fixed weights (evaluation, where a
decode step calls every adapted projection once per generated token) use it instead of
replacing anything on the layers; the layers own the switch and restore it on exit.
"""

from __future__ import annotations

import functools
import math
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn

from plora_hpo.adapter import AdapterConfig
from plora_hpo.engine import tensor_parallel
from plora_hpo.engine.lora_dropout import lora_input
from plora_hpo.engine.tensor_parallel import LinearShard, StorageColumns, TensorParallelPlan
from plora_hpo.kernels import SegmentLayout, adapted_linear, packed_lora_add
from plora_hpo.kernels._grads_into import grads_into

_LAYOUT_CACHE_SIZE = 256
# The kernels address weights with 32-bit offsets (rank row × row stride): a storage buffer holds
# at most 2^31 elements, so layers are grouped into buffers ("chunks") of at most this many columns,
# which leaves room for Σr up to 8192 ranks per pack.
_CHUNK_COLUMNS = 2**31 // 8192


@dataclass
class Route:
    """Rows of a batch grouped by adapter: ``row_counts[i]`` rows of ``adapter_ids[i]``, in order.

    A group may have zero rows. ``token_counts`` (padding-free batches, where every sequence of
    the batch sits in one row) gives each group's tokens directly instead of rows × row length.
    """

    adapter_ids: tuple[str, ...]
    row_counts: tuple[int, ...]
    ranks: tuple[int, ...]
    scalings: tuple[float, ...]
    token_counts: tuple[int, ...] | None = None
    layouts: OrderedDict | None = None  # shared by the model: one layout (and kernel plan) per shape
    dropouts: tuple[float, ...] = ()  # each group's lora_dropout p
    dropout_keys: tuple[int, ...] | None = None  # a training forward's keys (lora_dropout); None: no dropout

    def layout(self, tokens_per_row: int) -> SegmentLayout:
        """Token segments for a forward whose rows hold ``tokens_per_row`` tokens each."""
        if self.token_counts is not None:
            counts = self.token_counts
        else:
            counts = tuple(c * tokens_per_row for c in self.row_counts)
        key = (counts, self.ranks, self.scalings)
        cache = self.layouts if self.layouts is not None else OrderedDict()
        self.layouts = cache
        layout = cache.get(key)
        if layout is None:
            layout = SegmentLayout.from_counts(list(counts), list(self.ranks), list(self.scalings))
            cache[key] = layout
            while len(cache) > _LAYOUT_CACHE_SIZE:
                cache.popitem(last=False)
        else:
            cache.move_to_end(key)
        return layout


class Router:
    """Shared by all packed layers of a model; holds the route of the forward in flight."""

    def __init__(self) -> None:
        self.current: Route | None = None
        # cast fp32 adapter factors to the activations' dtype before the kernel (bf16 on GPU)
        self.cast_adapters: bool = True


@dataclass
class _LayerSlot:
    """One layer's view of the model's flat storage: autograd leaves over the compute copy."""

    ids: tuple[str, ...]
    a: torch.Tensor  # (Σr, d_in) leaf, a strided view of the storage's compute copy
    b: torch.Tensor  # (d_out, Σr) leaf (transposed view): adapter k's B is b[:, r0:r1]
    grads: tuple[torch.Tensor, torch.Tensor]  # the same views of the storage's fp32 gradient
    storage: _FlatStorage


@dataclass
class _FlatStorage:
    """The trained adapters' factors of every layer in one fp32 buffer, one row block per adapter.

    The layers are grouped into a few chunks (32-bit kernel offsets, see ``_CHUNK_COLUMNS``);
    each chunk is one buffer ``master[c]`` (Σr × W_c). Row ``i`` belongs to one adapter; its
    columns hold, layer after layer of the chunk, that rank row of A (``d_in`` values) and of
    Bᵀ (``d_out`` values). Adapter k's rows of a chunk are one contiguous block: its flat
    parameter for that chunk (what the optimizer, clipping and norms see). A layer's
    ``A_cat``/``Bᵀ_cat`` are strided column slices, handed to the kernels without copies.
    ``compute`` is ``master`` cast to the activations' dtype once per step (``master`` itself
    when no cast is needed); the layers' backward adds gradients into ``grad`` (fp32, same layout).
    """

    ids: tuple[str, ...]
    row_offsets: tuple[int, ...]
    master: list[torch.Tensor]
    grad: list[torch.Tensor]
    row_adapter: torch.Tensor  # (Σr,) int64 on the device: each row's adapter (its index in ids)
    compute: list[torch.Tensor] | None = None
    fresh: bool = False  # compute holds master's current values (set by refresh, cleared by stale)


@dataclass(frozen=True)
class FrozenFactors:
    """One layer's factors for one routing order, concatenated once (:meth:`PackedLoraModel.frozen_view`).

    ``a_cat`` (Σr × d_in) and ``b_cat`` (d_out × Σr) equal, bit for bit, what the per-call path
    builds for activations in the base layer's dtype; they are detached snapshots.
    ``master_dtype`` is the adapters' own dtype (which activation dtypes the pair serves).
    """

    adapter_ids: tuple[str, ...]
    a_cat: torch.Tensor
    b_cat: torch.Tensor
    master_dtype: torch.dtype


FastPath = Callable[[torch.Tensor, SegmentLayout], "torch.Tensor | None"]
"""A layer's alternative application of its :class:`FrozenFactors`: ``(x, layout) -> y``.

The layer calls it only without autograd, for activations in the factors' dtype and a route
the factors serve, with the forward's token layout; it returns the layer's full output
(base plus adapters) or ``None`` to let the layer take its own path.
"""

FastPathFactory = Callable[["PackedLoraLinear", FrozenFactors], "FastPath | None"]
"""Builds one layer's :data:`FastPath` from the layer and its frozen factors (``None``: none)."""


@dataclass(frozen=True)
class _Frozen:
    """What a layer holds inside :meth:`PackedLoraModel.frozen_view`."""

    factors: FrozenFactors
    fast_path: FastPath | None


class PackedLoraLinear(nn.Module):
    """A frozen ``nn.Linear`` plus per-adapter LoRA factors applied to each adapter's rows.

    ``index`` (the layer's position in the model) keys its dropout masks: see :mod:`.lora_dropout`.
    """

    def __init__(self, base: nn.Linear, router: Router, shard: LinearShard | None = None, index: int = 0) -> None:
        super().__init__()
        self.base = base
        self.index = index
        self.router = router
        self.shard = shard  # this rank's part of the layer under tensor parallelism (None: whole)
        self.lora_A = nn.ParameterDict()
        self.lora_B = nn.ParameterDict()
        self._slot: _LayerSlot | None = None
        self.chunk = 0  # which storage buffer holds this layer's factors
        self.col_a = 0  # this layer's first column in a storage row (A: d_in columns, then Bᵀ: d_out)
        self._frozen: _Frozen | None = None  # set only by PackedLoraModel.frozen_view

    @property
    def in_features(self) -> int:
        return self.base.in_features

    @property
    def out_features(self) -> int:
        return self.base.out_features

    def add_adapter(self, adapter_id: str, rank: int, generator: torch.Generator) -> None:
        """A initialised like PEFT (Kaiming-uniform, a=√5), B zeros: the adapter starts as a no-op.

        A is drawn on the generator's device. A split layer draws the whole layer's A (the same
        numbers as unsplit) and keeps its part."""
        weight = self.base.weight
        width = self.in_features if self.shard is None else self.shard.in_features
        a = torch.empty(rank, width, dtype=torch.float32, device=generator.device)
        nn.init.kaiming_uniform_(a, a=math.sqrt(5), generator=generator)
        if self.shard is not None:
            a = self.shard.a_of(a).contiguous()
        self.lora_A[adapter_id] = nn.Parameter(a.to(weight.device))
        self.lora_B[adapter_id] = nn.Parameter(
            torch.zeros(self.out_features, rank, dtype=torch.float32, device=weight.device)
        )

    def remove_adapter(self, adapter_id: str) -> None:
        del self.lora_A[adapter_id]
        del self.lora_B[adapter_id]

    # --- flat storage (set up by PackedLoraModel.build_storage) -----------------------------
    @property
    def col_b(self) -> int:
        return self.col_a + self.in_features

    @property
    def width(self) -> int:
        return self.in_features + self.out_features

    def _weights(self, route: Route, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(A_cat: Σr × d_in, B_cat: d_out × Σr) for the route's adapters, in the compute dtype,
        concatenated from the per-layer parameters (the path outside the trainer's flat storage)."""
        cast = self.router.cast_adapters and dtype.is_floating_point
        a_parts = [self.lora_A[i] for i in route.adapter_ids]
        b_parts = [self.lora_B[i] for i in route.adapter_ids]
        if cast and a_parts[0].dtype != dtype:
            a_parts = [p.to(dtype) for p in a_parts]
            b_parts = [p.to(dtype) for p in b_parts]
        return torch.cat(a_parts), torch.cat(b_parts, dim=1)

    # --- frozen views (set up by PackedLoraModel.frozen_view) -------------------------------
    @property
    def frozen_factors(self) -> FrozenFactors | None:
        """The factors of the enclosing :meth:`PackedLoraModel.frozen_view` (``None`` outside one)."""
        return None if self._frozen is None else self._frozen.factors

    @property
    def fast_path(self) -> FastPath | None:
        """The fast path of the enclosing :meth:`PackedLoraModel.frozen_view`, if it gave one."""
        return None if self._frozen is None else self._frozen.fast_path

    def _compute_dtype(self, master: torch.dtype, dtype: torch.dtype) -> torch.dtype:
        """The dtype :meth:`_weights` returns for ``master`` factors and activations of ``dtype``."""
        cast = self.router.cast_adapters and dtype.is_floating_point and master != dtype
        return dtype if cast else master

    def _freeze(self, adapter_ids: tuple[str, ...]) -> FrozenFactors:
        """What :meth:`_weights` returns for a route over ``adapter_ids`` and activations in the
        base's dtype, built once. Casting the concatenation is the same elementwise cast as
        casting each adapter's factors, in two launches instead of 2K."""
        a_cat = torch.cat([self.lora_A[i].detach() for i in adapter_ids])
        b_cat = torch.cat([self.lora_B[i].detach() for i in adapter_ids], dim=1)
        dtype = self._compute_dtype(a_cat.dtype, self.base.weight.dtype)
        return FrozenFactors(adapter_ids, a_cat.to(dtype), b_cat.to(dtype), a_cat.dtype)

    def _serves(self, factors: FrozenFactors, route: Route, dtype: torch.dtype) -> bool:
        """Whether ``factors`` are exactly what :meth:`_weights` would build for this forward."""
        return route.adapter_ids == factors.adapter_ids and (
            self._compute_dtype(factors.master_dtype, dtype) == factors.a_cat.dtype
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        route = self.router.current
        if route is None or not route.adapter_ids:
            return self.base(x)
        tokens_per_row = x.shape[-2] if x.dim() == 3 else 1
        layout = route.layout(tokens_per_row)
        frozen = self._frozen
        serves = frozen is not None and self._serves(frozen.factors, route, x.dtype)
        if (
            serves
            and frozen.fast_path is not None
            and x.dtype == frozen.factors.a_cat.dtype
            and not torch.is_grad_enabled()
        ):
            y = frozen.fast_path(x, layout)
            if y is not None:
                return y
        slot = self._slot
        if slot is not None and slot.storage.fresh and route.adapter_ids == slot.ids:
            a_cat, b_cat, grads = slot.a, slot.b, slot.grads  # flat storage: compute copy in, fp32 gradient out
        elif serves:
            a_cat, b_cat, grads = frozen.factors.a_cat, frozen.factors.b_cat, None
        else:
            (a_cat, b_cat), grads = self._weights(route, x.dtype), None
        if route.dropout_keys is not None:
            return self._forward_dropped(x, route, layout, a_cat, b_cat, grads)
        # one node for base and adapters: its backward writes dx = dy·W and the adapters' part
        # into one buffer, where base + delta as two nodes would leave autograd a full-size add
        return adapted_linear(x, self.base.weight, self.base.bias, a_cat, b_cat, layout, grads_into=grads)

    def _forward_dropped(
        self,
        x: torch.Tensor,
        route: Route,
        layout: SegmentLayout,
        a_cat: torch.Tensor,
        b_cat: torch.Tensor,
        grads: tuple[torch.Tensor, torch.Tensor] | None,
    ) -> torch.Tensor:
        """``base(x) + delta(dropout(x))``: the base layer and the adapters see different inputs,
        so they are two nodes here (the base matmul, then the delta added into its output)."""
        x2 = x.reshape(-1, x.shape[-1])
        x_lora = lora_input(x2, layout, route.dropouts, route.dropout_keys, self.index)
        if grads is not None:
            a_cat, b_cat = grads_into(a_cat, b_cat, grads)
        y = packed_lora_add(F.linear(x2, self.base.weight, self.base.bias), x_lora, a_cat, b_cat, layout)
        return y.view(*x.shape[:-1], y.shape[-1])


def _chunk_layout(widths: Sequence[int]) -> tuple[list[tuple[int, int]], list[int]]:
    """Each layer's (chunk, first column) in a flat storage row and each chunk's width ``W_c``:
    layers in order, a new chunk whenever the next layer would pass ``_CHUNK_COLUMNS``."""
    places, chunk_widths = [], [0]
    for width in widths:
        if chunk_widths[-1] and chunk_widths[-1] + width > _CHUNK_COLUMNS:
            chunk_widths.append(0)
        places.append((len(chunk_widths) - 1, chunk_widths[-1]))
        chunk_widths[-1] += width
    return places, chunk_widths


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The transformer blocks of a Llama-style causal LM (``model.model.layers``)."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else getattr(model, "model", model)
    layers = getattr(decoder, "layers", None)
    if layers is None:
        raise ValueError(f"cannot find the decoder layers of {type(model).__name__}")
    return list(layers)


def _checkpointed_forward(layer: nn.Module, router: Router, *args, **kwargs):
    """Run a decoder layer under non-reentrant activation checkpointing.

    The recomputation happens during backward, outside the ``route`` block, so the route of the
    forward is captured here and reinstated while the layer runs again.
    """
    forward = type(layer).forward.__get__(layer)
    if not torch.is_grad_enabled():
        return forward(*args, **kwargs)
    route = router.current

    def run(*a, **k):
        previous = router.current
        router.current = route
        try:
            return forward(*a, **k)
        finally:
            router.current = previous

    return torch.utils.checkpoint.checkpoint(run, *args, use_reentrant=False, preserve_rng_state=False, **kwargs)


class PackedLoraModel:
    """A causal LM with packed LoRA layers on ``target_modules``; the engine's model handle.

    A model split by :func:`~plora_hpo.engine.tensor_parallel.shard_model` gets its adapters
    split to match (``parallel``): every rank of the group builds this object the same way,
    adapters are initialised as unsplit and each rank keeps its part, and :meth:`state_dict_of`
    gathers the whole factors (a collective then).
    """

    def __init__(self, model: nn.Module, target_modules: Sequence[str]) -> None:
        self.model = model
        self.target_modules = tuple(target_modules)
        self.parallel: TensorParallelPlan | None = tensor_parallel.plan_of(model)
        self.router = Router()
        self.configs: dict[str, AdapterConfig] = {}
        self._layouts: OrderedDict = OrderedDict()
        self._storage: _FlatStorage | None = None
        self._flat: dict[str, nn.Parameter] = {}
        self._checkpointing = False
        for p in model.parameters():
            p.requires_grad_(False)
        self.layers: dict[str, PackedLoraLinear] = {}
        for name, module in list(model.named_modules()):
            if name.rsplit(".", 1)[-1] in self.target_modules and isinstance(module, nn.Linear):
                parent_name, _, child = name.rpartition(".")
                shard = None if self.parallel is None else self.parallel.shards.get(name)
                packed = PackedLoraLinear(module, self.router, shard, index=len(self.layers))
                setattr(model.get_submodule(parent_name), child, packed)
                self.layers[name] = packed
        if not self.layers:
            raise ValueError(f"no nn.Linear named {list(self.target_modules)} in {type(model).__name__}")
        places, self.chunk_widths = _chunk_layout([layer.width for layer in self.layers.values()])
        for layer, (chunk, col_a) in zip(self.layers.values(), places):
            layer.chunk, layer.col_a = chunk, col_a
        # the unsplit model's layout (what a degree-1 pack's flat parameters look like)
        whole = [(x.in_features, x.out_features) if x.shard is None else (x.shard.in_features, x.shard.out_features)
                 for x in self.layers.values()]  # fmt: skip
        whole_places, self.whole_chunk_widths = _chunk_layout([i + o for i, o in whole])
        self._whole_layout = [(c, col, i, o) for (c, col), (i, o) in zip(whole_places, whole)]
        self._parallel_columns: StorageColumns | None = None
        if self.parallel is not None:
            self._parallel_columns = tensor_parallel.storage_columns(
                [(x.shard, x.chunk, x.col_a, x.in_features, x.out_features) for x in self.layers.values()],
                self.chunk_widths,
                next(iter(self.layers.values())).base.weight.device,
            )

    @property
    def adapter_ids(self) -> list[str]:
        return list(self.configs)

    def add_adapter(self, adapter_id: str, config: AdapterConfig) -> None:
        """Create the adapter's factors in every target layer, seeded by ``config.seed``.

        The random numbers are drawn on the model's device: drawing a rank-128 adapter's A for a
        1.5B-parameter shape takes about 0.3 s on one CPU thread, and a pack on a GPU would wait
        that long for every adapter it admits. The same seed gives other numbers on a CPU than on
        a GPU (and may on GPUs of another model)."""
        if adapter_id in self.configs or "." in adapter_id:
            raise ValueError(f"adapter id {adapter_id!r} is taken or contains '.'")
        device = next(iter(self.layers.values())).base.weight.device
        generator = torch.Generator(device=device).manual_seed(config.seed)
        for layer in self.layers.values():
            layer.add_adapter(adapter_id, config.rank, generator)
        self.configs[adapter_id] = config

    def remove_adapter(self, adapter_id: str) -> None:
        if adapter_id in self.stored_ids:
            self.release_storage()
        for layer in self.layers.values():
            layer.remove_adapter(adapter_id)
        self._flat.pop(adapter_id, None)
        del self.configs[adapter_id]

    # --- flat storage ---------------------------------------------------------------------
    @property
    def flat_storage(self) -> _FlatStorage | None:
        """The flat storage of the adapters being trained (its buffers and row layout), if any."""
        return self._storage

    @property
    def stored_ids(self) -> tuple[str, ...]:
        """Adapters in the flat storage, in its row order (empty: none)."""
        return () if self._storage is None else self._storage.ids

    def _views(self, buffers: Sequence[torch.Tensor], layer: PackedLoraLinear) -> tuple[torch.Tensor, torch.Tensor]:
        """(A, B) of one layer inside rows of the storage layout: A (r × d_in), B (d_out × r)."""
        buffer = buffers[layer.chunk]
        return buffer[:, layer.col_a : layer.col_b], buffer[:, layer.col_b : layer.col_a + layer.width].t()

    def _point(self, adapter_id: str, buffer: Sequence[torch.Tensor]) -> None:
        """Make the adapter's per-layer parameters views of ``buffer`` (its rows, storage layout)."""
        for layer in self.layers.values():
            a, b = self._views(buffer, layer)
            layer.lora_A[adapter_id].data = a
            layer.lora_B[adapter_id].data = b

    def _aliases(self, adapter_id: str, buffers: Sequence[torch.Tensor]) -> bool:
        """Whether every per-layer parameter of the adapter is the expected view of ``buffers``."""
        for layer in self.layers.values():
            buffer = buffers[layer.chunk]
            base, size = buffer.data_ptr(), buffer.element_size()
            a, b = layer.lora_A[adapter_id], layer.lora_B[adapter_id]
            if (
                a.data_ptr() != base + layer.col_a * size
                or b.data_ptr() != base + layer.col_b * size
                or a.stride() != (buffer.stride(0), 1)
                or b.stride() != (1, buffer.stride(0))
            ):
                return False
        return True

    def whole_rows(self, local: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Tensors shaped like an adapter's flat parameters under tensor parallelism (its AdamW
        moments, say) in the unsplit model's layout, what a degree-1 pack holds: each rank's split
        factors are gathered (a collective that every rank of the group calls)."""
        assert self.parallel is not None, "a whole model's rows are already whole"
        parts = [(name, x.shard, *self._views(local, x)) for name, x in self.layers.items()]
        factors = tensor_parallel.gather_factors(self.parallel, parts)
        rank, like = local[0].shape[0], local[0]
        whole = [torch.empty(rank, w, dtype=like.dtype, device=like.device) for w in self.whole_chunk_widths]
        for name, (chunk, col_a, d_in, d_out) in zip(self.layers, self._whole_layout):
            whole[chunk][:, col_a : col_a + d_in] = factors[f"{name}.lora_A.weight"]
            whole[chunk][:, col_a + d_in : col_a + d_in + d_out] = factors[f"{name}.lora_B.weight"].t()
        return whole

    def local_rows(self, whole: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """The inverse of :meth:`whole_rows`: this rank's part, in its flat parameters' layout."""
        assert self.parallel is not None, "a whole model's rows need no split"
        if len(whole) != len(self.whole_chunk_widths):
            raise ValueError(f"{len(whole)} row tensors given for a layout of {len(self.whole_chunk_widths)} chunks")
        rank, like = whole[0].shape[0], whole[0]
        local = [torch.empty(rank, w, dtype=like.dtype, device=like.device) for w in self.chunk_widths]
        for layer, (chunk, col_a, d_in, d_out) in zip(self.layers.values(), self._whole_layout):
            a, b = self._views(local, layer)
            full_a, full_b = (
                whole[chunk][:, col_a : col_a + d_in],
                whole[chunk][:, col_a + d_in : col_a + d_in + d_out].t(),
            )
            a.copy_(full_a if layer.shard is None else layer.shard.a_of(full_a))
            b.copy_(full_b if layer.shard is None else layer.shard.b_of(full_b))
        return local

    def flat_parameters(self, adapter_id: str) -> list[nn.Parameter]:
        """The adapter's factors as a few contiguous ``(rank, W_c)`` fp32 parameters, one per
        chunk of layers (storage layout; one for most models).

        Its per-layer ``lora_A``/``lora_B`` parameters become views of them, so a handful of
        optimizer parameters (and one gradient norm) cover the whole adapter. The objects stay
        the same across building and releasing the storage (optimizer state keyed by them stays valid); if
        something re-pointed the per-layer parameters (adapter paging), their values are
        gathered again.
        """
        flats = self._flat.get(adapter_id)
        rank = self.configs[adapter_id].rank
        if flats is not None and flats[0].shape[0] == rank and self._aliases(adapter_id, flats):
            return flats
        first = self.layers[next(iter(self.layers))].lora_A[adapter_id]
        buffers = [torch.empty(rank, w, dtype=first.dtype, device=first.device) for w in self.chunk_widths]
        with torch.no_grad():
            for layer in self.layers.values():
                a, b = self._views(buffers, layer)
                a.copy_(layer.lora_A[adapter_id])
                b.copy_(layer.lora_B[adapter_id])
        self._point(adapter_id, buffers)
        if flats is None:
            flats = [nn.Parameter(buffer, requires_grad=False) for buffer in buffers]
            self._flat[adapter_id] = flats
        else:
            for flat, buffer in zip(flats, buffers):
                flat.data = buffer
        return flats

    def separate(self, adapter_id: str) -> None:
        """Give each per-layer parameter of the adapter its own contiguous storage (values kept)
        and forget its flat parameters: for optimizers that hold per-layer parameters (fused
        AdamW wants a parameter's gradient and state in its own, dense layout)."""
        if adapter_id in self.stored_ids:
            self.release_storage()
        with torch.no_grad():
            for layer in self.layers.values():
                for p in (layer.lora_A[adapter_id], layer.lora_B[adapter_id]):
                    if not p.is_contiguous():
                        p.data = p.data.contiguous()
                        p.grad = None
        self._flat.pop(adapter_id, None)

    def build_storage(self, adapter_ids: Sequence[str]) -> None:
        """Put these adapters (in this order) into the storage buffers; see :class:`_FlatStorage`.

        Their flat parameters (:meth:`flat_parameters`) keep their identity and values (optimizer
        state stays valid) and become row blocks of the storage; their gradients become row blocks
        of its gradient buffers, which the caller zeroes in place (:meth:`zero_storage_grads`)
        rather than setting to None. Per-layer parameters stay views (their ``.grad`` is unused).
        """
        ids = tuple(adapter_ids)
        unknown = [a for a in ids if a not in self.configs]
        if unknown or len(set(ids)) != len(ids):
            raise ValueError(f"cannot store {list(ids)}: unknown or repeated adapters {unknown}")
        self.release_storage()
        if not ids:
            return
        flats = [self.flat_parameters(a) for a in ids]
        offsets = [0]
        for chunks in flats:
            offsets.append(offsets[-1] + chunks[0].shape[0])
        if offsets[-1] * max(self.chunk_widths) >= 2**31:
            raise ValueError(
                f"a pack of total rank {offsets[-1]} is too large for flat storage (32-bit kernel "
                f"offsets); pack fewer adapters or train with flat_storage=False"
            )
        like = flats[0][0]
        master = [torch.empty(offsets[-1], w, dtype=like.dtype, device=like.device) for w in self.chunk_widths]
        grad = [torch.zeros_like(m) for m in master]
        with torch.no_grad():
            for adapter_id, chunks, r0, r1 in zip(ids, flats, offsets, offsets[1:]):
                rows = [m[r0:r1] for m in master]
                for flat, m, g in zip(chunks, master, grad):
                    m[r0:r1].copy_(flat)
                    flat.data = m[r0:r1]
                    flat.grad = g[r0:r1]
                self._point(adapter_id, rows)
        slots = torch.repeat_interleave(torch.arange(len(ids)), torch.tensor([c[0].shape[0] for c in flats]))
        self._storage = _FlatStorage(ids, tuple(offsets), master, grad, slots.to(like.device))

    def release_storage(self) -> None:
        """Give every stored adapter its own storage again (values kept, gradients dropped).

        Each adapter's rows are copied out of the storage before it is freed, so for a moment
        the device holds both. When it has no room for that (a pack that just ran out of memory),
        the rest are copied to host memory instead and come back once the storage is gone.
        """
        storage, self._storage = self._storage, None
        if storage is None:
            return
        for layer in self.layers.values():
            layer._slot = None
        on_host: list[str] = []
        old: list[torch.Tensor] = []
        with torch.no_grad():
            for adapter_id, r0, r1 in zip(storage.ids, storage.row_offsets, storage.row_offsets[1:]):
                flats = self._flat.get(adapter_id)
                if flats is None or adapter_id not in self.configs:
                    continue
                old = [m[r0:r1] for m in storage.master]
                for flat, rows in zip(flats, old):
                    flat.grad = None
                    if flat.data_ptr() != rows.data_ptr():
                        continue
                    try:
                        flat.data = flat.data.clone()
                    except torch.OutOfMemoryError:
                        flat.data = flat.data.to("cpu", copy=True)
                        if adapter_id not in on_host:
                            on_host.append(adapter_id)
                # parameters re-pointed from outside keep their own values (gathered on next use)
                self._point_missing(adapter_id, old, [f.data for f in flats])
            device = storage.master[0].device
            del storage, old  # nothing views the storage any more: its memory is free
            for adapter_id in on_host:
                flats = self._flat[adapter_id]
                host = [f.data for f in flats]
                for flat in flats:
                    flat.data = flat.data.to(device)
                self._point_missing(adapter_id, host, [f.data for f in flats])

    def _point_missing(self, adapter_id: str, old: Sequence[torch.Tensor], new: Sequence[torch.Tensor]) -> None:
        """Re-point only the per-layer parameters that still alias ``old`` to the same views of ``new``."""
        for layer in self.layers.values():
            (a_old, b_old), (a_new, b_new) = self._views(old, layer), self._views(new, layer)
            if layer.lora_A[adapter_id].data_ptr() == a_old.data_ptr():
                layer.lora_A[adapter_id].data = a_new
            if layer.lora_B[adapter_id].data_ptr() == b_old.data_ptr():
                layer.lora_B[adapter_id].data = b_new

    def storage_intact(self, adapter_ids: Sequence[str]) -> bool:
        """Whether ``adapter_ids`` are in the flat storage in this order and still alias its buffers.

        Cheap (every step): checks each stored adapter's flat parameters and the first and last
        stored adapters' per-layer parameters (adapter paging re-points whole adapters).
        """
        storage = self._storage
        if storage is None or tuple(adapter_ids) != storage.ids:
            return False
        for adapter_id, r0 in zip(storage.ids, storage.row_offsets):
            flats = self._flat.get(adapter_id)
            if flats is None or any(f.data_ptr() != m[r0].data_ptr() for f, m in zip(flats, storage.master)):
                return False
        for adapter_id, r0 in {
            storage.ids[0]: storage.row_offsets[0],
            storage.ids[-1]: storage.row_offsets[-2],
        }.items():
            for layer in self.layers.values():
                m = storage.master[layer.chunk]
                row, size = m[r0].data_ptr(), m.element_size()
                if (
                    layer.lora_A[adapter_id].data_ptr() != row + layer.col_a * size
                    or layer.lora_B[adapter_id].data_ptr() != row + layer.col_b * size
                ):
                    return False
        return True

    def refresh_compute(self, dtype: torch.dtype | None = None) -> None:
        """Cast the storage's fp32 master into its compute copy (one kernel) and mark it fresh.

        ``dtype`` defaults to the base model's (bf16 on the GPU); with the router's
        ``cast_adapters`` off, or when the dtypes match, the compute copy is the master itself.
        The layers use the storage only while it is fresh (the trainer refreshes at the start of each
        step and calls :meth:`mark_stale` after the update); otherwise they concatenate the
        per-layer parameters, which always see the current values.
        """
        storage = self._storage
        if storage is None:
            return
        if dtype is None:
            dtype = next(iter(self.layers.values())).base.weight.dtype
        if not (self.router.cast_adapters and dtype.is_floating_point):
            dtype = storage.master[0].dtype
        if storage.compute is None or storage.compute[0].dtype != dtype:
            self._build_compute(storage, dtype)
        elif storage.compute is not storage.master:
            with torch.no_grad():
                torch._foreach_copy_(storage.compute, storage.master)
        storage.fresh = True

    def _build_compute(self, storage: _FlatStorage, dtype: torch.dtype) -> None:
        storage.compute = storage.master if dtype == storage.master[0].dtype else [m.to(dtype) for m in storage.master]
        for layer in self.layers.values():
            a_view, b_view = self._views(storage.compute, layer)
            # leaves only so that autograd runs the layer's backward; their gradients go to storage.grad
            a_leaf, b_leaf = a_view.detach().requires_grad_(), b_view.detach().requires_grad_()
            layer._slot = _LayerSlot(storage.ids, a_leaf, b_leaf, self._views(storage.grad, layer), storage)

    def mark_stale(self) -> None:
        """The master changed (optimizer step): layers stop using the compute copy until refreshed."""
        if self._storage is not None:
            self._storage.fresh = False

    def zero_storage_grads(self) -> None:
        if self._storage is not None:
            torch._foreach_zero_(self._storage.grad)

    # --- tensor parallelism (no-ops on a whole model) ----------------------------------------
    def reduce_storage_grads(self) -> None:
        """Sum the replicated factors' gradients over the group (each rank holds a partial sum);
        call once per step, after the last backward. A collective; a no-op on a whole model."""
        if self.parallel is not None and self._storage is not None:
            assert self._parallel_columns is not None
            tensor_parallel.all_reduce_columns(self.parallel, self._storage.grad, self._parallel_columns)

    def storage_grad_norms(self) -> torch.Tensor:
        """Each stored adapter's gradient norm over the whole (unsplit) model, in storage order,
        after :meth:`reduce_storage_grads`. A collective under tensor parallelism."""
        storage = self._storage
        assert storage is not None and self.parallel is not None and self._parallel_columns is not None
        return tensor_parallel.flat_grad_norms(
            self.parallel, storage.grad, self._parallel_columns, storage.row_adapter, len(storage.ids)
        )

    # --- activation checkpointing -----------------------------------------------------------
    @property
    def activation_checkpointing(self) -> bool:
        return self._checkpointing

    def set_activation_checkpointing(self, enabled: bool) -> None:
        """Recompute each decoder layer in backward (keeps only layer inputs alive)."""
        if enabled == self._checkpointing:
            return
        for layer in decoder_layers(self.model):
            if enabled:
                layer.forward = functools.partial(_checkpointed_forward, layer, self.router)
            else:
                del layer.forward
        self._checkpointing = enabled

    # --- adapters ---------------------------------------------------------------------------
    def parameters_of(self, adapter_id: str) -> list[nn.Parameter]:
        """A and B of one adapter in a fixed layer order (one optimizer param group)."""
        params: list[nn.Parameter] = []
        for layer in self.layers.values():
            params += [layer.lora_A[adapter_id], layer.lora_B[adapter_id]]
        return params

    def state_dict_of(self, adapter_id: str) -> dict[str, torch.Tensor]:
        """``{"<module path>.lora_A.weight": A, ...}`` for one adapter (detached views).

        Under tensor parallelism the factors are whole (gathered from every rank, the same on all):
        a collective that every rank of the group calls."""
        if self.parallel is not None:
            parts = [(n, x.shard, x.lora_A[adapter_id], x.lora_B[adapter_id]) for n, x in self.layers.items()]
            return tensor_parallel.gather_factors(self.parallel, parts)
        out: dict[str, torch.Tensor] = {}
        for name, layer in self.layers.items():
            out[f"{name}.lora_A.weight"] = layer.lora_A[adapter_id].detach()
            out[f"{name}.lora_B.weight"] = layer.lora_B[adapter_id].detach()
        return out

    def load_state_dict_of(self, adapter_id: str, tensors: dict[str, torch.Tensor]) -> None:
        """Copy weights saved by :meth:`state_dict_of` (whole factors) back into an existing adapter."""
        with torch.no_grad():
            for name, layer in self.layers.items():
                a, b = tensors[f"{name}.lora_A.weight"], tensors[f"{name}.lora_B.weight"]
                if layer.shard is not None:
                    a, b = layer.shard.a_of(a), layer.shard.b_of(b)
                layer.lora_A[adapter_id].copy_(a)
                layer.lora_B[adapter_id].copy_(b)
        self.mark_stale()

    @contextmanager
    def frozen_view(self, adapter_ids: Sequence[str], *, fast_path: FastPathFactory | None = None) -> Iterator[None]:
        """Within the block, routes over exactly ``adapter_ids`` (in this order) read factors built once.

        Every layer concatenates those adapters' factors on entry (:class:`FrozenFactors`, the
        pair its per-call path would build, so results are bit-identical) and uses them for any
        forward whose route lists exactly these adapters, groups without rows included; other
        routes take the usual path. ``fast_path``, when given, is called once per layer on
        entry; the :data:`FastPath` it returns is tried first on such forwards.

        The factors are snapshots: do not change, page or remove these adapters inside the
        block. On exit every layer is back to what it used before (views may nest).
        """
        ids = tuple(adapter_ids)
        unknown = [a for a in ids if a not in self.configs]
        if not ids or unknown:
            raise ValueError(f"cannot freeze {list(ids)}: no adapters, or unknown adapters {unknown}")
        previous: list[tuple[PackedLoraLinear, _Frozen | None]] = []
        try:
            with torch.no_grad():
                for layer in self.layers.values():
                    previous.append((layer, layer._frozen))
                    factors = layer._freeze(ids)
                    layer._frozen = _Frozen(factors, None if fast_path is None else fast_path(layer, factors))
            yield
        finally:
            for layer, before in previous:
                layer._frozen = before

    @contextmanager
    def route(
        self,
        row_adapters: Sequence[tuple[str, int]],
        *,
        token_counts: Sequence[int] | None = None,
        dropout_keys: Sequence[int] | None = None,
    ) -> Iterator[None]:
        """Within the block, rows are ``(adapter_id, n_rows)`` groups in order.

        Every row of the batch must belong to one listed group; the groups' row counts sum to
        the batch size (a group may have no rows). ``token_counts`` gives each group's tokens
        when sequences are concatenated into one row (padding-free batches). ``dropout_keys``
        (one per group, :func:`~plora_hpo.engine.lora_dropout.forward_key`) marks a training
        forward: each adapter's LoRA input is dropped out by its ``lora_dropout``. Without keys,
        or when every p is 0, nothing is dropped and the layers take their fused path.
        """
        ids = tuple(a for a, _ in row_adapters)
        configs = [self.configs[a] for a in ids]
        if token_counts is not None and len(token_counts) != len(ids):
            raise ValueError(f"{len(token_counts)} token counts for {len(ids)} groups")
        if dropout_keys is not None and len(dropout_keys) != len(ids):
            raise ValueError(f"{len(dropout_keys)} dropout keys for {len(ids)} groups")
        dropouts = tuple(c.lora_dropout for c in configs)
        self.router.current = Route(
            adapter_ids=ids,
            row_counts=tuple(n for _, n in row_adapters),
            ranks=tuple(c.rank for c in configs),
            scalings=tuple(c.scaling for c in configs),
            token_counts=None if token_counts is None else tuple(token_counts),
            layouts=self._layouts,
            dropouts=dropouts,
            dropout_keys=tuple(dropout_keys) if dropout_keys is not None and any(dropouts) else None,
        )
        try:
            yield
        finally:
            self.router.current = None
