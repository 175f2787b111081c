"""K LoRA adapters of mixed rank injected into one frozen base model.

Every target ``nn.Linear`` is replaced by a :class:`PackedLoraLinear` that keeps the base layer
and one (A, B) pair per adapter. A :class:`Router` tells all layers which rows of the current
batch belong to which adapter, so one forward pass of the base serves every adapter and each
adapter touches only its own rows (gradients stay isolated).

Packed storage (the trainer's fast path): :meth:`PackedLoraModel.pack` moves the fp32 factors of
the adapters being trained into one contiguous ``A`` (Σr × d_in) and one ``Bᵀ`` (Σr × d_out)
buffer per layer, in pack order. Each adapter's ``lora_A``/``lora_B`` parameter stays what the
optimizer, clipping and export see, but becomes a view into that buffer, and its ``.grad`` a view
into the buffer's gradient. A forward whose route lists exactly the packed adapters in that order
then hands the kernel one (A, B) pair per layer — cast once to the activations' dtype (bf16 on the
GPU; fp32 masters stay with the optimizer) — instead of concatenating K adapters' factors and
accumulating K separate gradients per layer call. Any other route (evaluation, a different
order) concatenates per call as before; both paths compute the same function and write the same
gradients.
"""

from __future__ import annotations

import functools
import math
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.utils.checkpoint
from torch import nn

from plora_hpo.adapter import AdapterConfig
from plora_hpo.kernels import SegmentLayout, packed_lora_add

_LAYOUT_CACHE_SIZE = 256


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
class _LayerPack:
    """One layer's packed adapters: fp32 leaves whose rows are the adapters' A and Bᵀ."""

    ids: tuple[str, ...]
    a: torch.Tensor  # (Σr, d_in)
    bt: torch.Tensor  # (Σr, d_out); adapter k's B is bt[r0:r1].t()


class PackedLoraLinear(nn.Module):
    """A frozen ``nn.Linear`` plus per-adapter LoRA factors applied to each adapter's rows."""

    def __init__(self, base: nn.Linear, router: Router) -> None:
        super().__init__()
        self.base = base
        self.router = router
        self.lora_A = nn.ParameterDict()
        self.lora_B = nn.ParameterDict()
        self._pack: _LayerPack | None = None

    @property
    def in_features(self) -> int:
        return self.base.in_features

    @property
    def out_features(self) -> int:
        return self.base.out_features

    def add_adapter(self, adapter_id: str, rank: int, generator: torch.Generator) -> None:
        """A initialised like PEFT (Kaiming-uniform, a=√5), B zeros: the adapter starts as a no-op."""
        weight = self.base.weight
        a = torch.empty(rank, self.in_features, dtype=torch.float32)
        nn.init.kaiming_uniform_(a, a=math.sqrt(5), generator=generator)
        self.lora_A[adapter_id] = nn.Parameter(a.to(weight.device))
        self.lora_B[adapter_id] = nn.Parameter(
            torch.zeros(self.out_features, rank, dtype=torch.float32, device=weight.device)
        )

    def remove_adapter(self, adapter_id: str) -> None:
        del self.lora_A[adapter_id]
        del self.lora_B[adapter_id]

    # --- packed storage -------------------------------------------------------------------
    def pack(self, adapter_ids: tuple[str, ...]) -> None:
        """Move these adapters' factors into contiguous buffers (their parameters become views)."""
        self.unpack()
        if not adapter_ids:
            return
        first = self.lora_A[adapter_ids[0]]
        ranks = [self.lora_A[i].shape[0] for i in adapter_ids]
        total = sum(ranks)
        a = torch.empty(total, self.in_features, dtype=first.dtype, device=first.device)
        bt = torch.empty(total, self.out_features, dtype=first.dtype, device=first.device)
        a_grad, bt_grad = torch.zeros_like(a), torch.zeros_like(bt)
        start = 0
        with torch.no_grad():
            for adapter_id, rank in zip(adapter_ids, ranks):
                pa, pb = self.lora_A[adapter_id], self.lora_B[adapter_id]
                rows = slice(start, start + rank)
                a[rows].copy_(pa.data)
                bt[rows].copy_(pb.data.t())
                pa.data = a[rows]
                pb.data = bt[rows].t()
                pa.grad = a_grad[rows]
                pb.grad = bt_grad[rows].t()
                start += rank
        a.requires_grad_(True)
        bt.requires_grad_(True)
        a.grad, bt.grad = a_grad, bt_grad
        self._pack = _LayerPack(tuple(adapter_ids), a, bt)

    def unpack(self) -> None:
        """Give every packed adapter its own storage again (values kept, gradients dropped)."""
        pack, self._pack = self._pack, None
        if pack is None:
            return
        with torch.no_grad():
            for adapter_id in pack.ids:
                if adapter_id in self.lora_A:
                    for p in (self.lora_A[adapter_id], self.lora_B[adapter_id]):
                        p.data = p.data.clone()
                        p.grad = None

    def pack_intact(self) -> bool:
        """Whether the packed adapters' parameters still alias the packed buffers (nobody
        re-pointed ``.data``, e.g. adapter paging during evaluation)."""
        pack = self._pack
        if pack is None:
            return False
        first, last = pack.ids[0], pack.ids[-1]
        rank_last = self.lora_A[last].shape[0] if last in self.lora_A else -1
        return (
            first in self.lora_A
            and self.lora_A[first].data_ptr() == pack.a.data_ptr()
            and self.lora_B[first].data_ptr() == pack.bt.data_ptr()
            and rank_last > 0
            and self.lora_A[last].data_ptr()
            == pack.a.data_ptr() + (pack.a.shape[0] - rank_last) * pack.a.stride(0) * pack.a.element_size()
        )

    def packed_grads(self) -> list[torch.Tensor]:
        return [] if self._pack is None else [self._pack.a.grad, self._pack.bt.grad]

    # --- forward ----------------------------------------------------------------------------
    def _weights(self, route: Route, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(A_cat: Σr × d_in, B_cat: d_out × Σr) for the route's adapters, in the compute dtype."""
        cast = self.router.cast_adapters and dtype.is_floating_point
        pack = self._pack
        if pack is not None and route.adapter_ids == pack.ids:
            if cast and pack.a.dtype != dtype:
                # once per layer call, differentiable: the gradient flows back to the fp32 leaves
                return pack.a.to(dtype), pack.bt.t().to(dtype, memory_format=torch.contiguous_format)
            return pack.a, pack.bt.t()
        a_parts = [self.lora_A[i] for i in route.adapter_ids]
        b_parts = [self.lora_B[i] for i in route.adapter_ids]
        if cast and a_parts[0].dtype != dtype:
            a_parts = [p.to(dtype) for p in a_parts]
            b_parts = [p.to(dtype) for p in b_parts]
        return torch.cat(a_parts), torch.cat(b_parts, dim=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        route = self.router.current
        if route is None or not route.adapter_ids:
            return y
        a_cat, b_cat = self._weights(route, x.dtype)
        tokens_per_row = x.shape[-2] if x.dim() == 3 else 1
        out = packed_lora_add(
            y.reshape(-1, self.out_features),
            x.reshape(-1, self.in_features),
            a_cat,
            b_cat,
            route.layout(tokens_per_row),
        )
        return out.view_as(y)


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
    """A causal LM with packed LoRA layers on ``target_modules``; the engine's model handle."""

    def __init__(self, model: nn.Module, target_modules: Sequence[str]) -> None:
        self.model = model
        self.target_modules = tuple(target_modules)
        self.router = Router()
        self.configs: dict[str, AdapterConfig] = {}
        self._layouts: OrderedDict = OrderedDict()
        self._packed_ids: tuple[str, ...] = ()
        self._checkpointing = False
        for p in model.parameters():
            p.requires_grad_(False)
        self.layers: dict[str, PackedLoraLinear] = {}
        for name, module in list(model.named_modules()):
            if name.rsplit(".", 1)[-1] in self.target_modules and isinstance(module, nn.Linear):
                parent_name, _, child = name.rpartition(".")
                packed = PackedLoraLinear(module, self.router)
                setattr(model.get_submodule(parent_name), child, packed)
                self.layers[name] = packed
        if not self.layers:
            raise ValueError(f"no nn.Linear named {list(self.target_modules)} in {type(model).__name__}")

    @property
    def adapter_ids(self) -> list[str]:
        return list(self.configs)

    def add_adapter(self, adapter_id: str, config: AdapterConfig) -> None:
        """Create the adapter's factors in every target layer, seeded by ``config.seed``."""
        if adapter_id in self.configs or "." in adapter_id:
            raise ValueError(f"adapter id {adapter_id!r} is taken or contains '.'")
        generator = torch.Generator().manual_seed(config.seed)
        for layer in self.layers.values():
            layer.add_adapter(adapter_id, config.rank, generator)
        self.configs[adapter_id] = config

    def remove_adapter(self, adapter_id: str) -> None:
        if adapter_id in self._packed_ids:
            self.unpack()
        for layer in self.layers.values():
            layer.remove_adapter(adapter_id)
        del self.configs[adapter_id]

    # --- packed storage -------------------------------------------------------------------
    @property
    def packed_ids(self) -> tuple[str, ...]:
        """Adapters in packed storage, in pack order (empty: none)."""
        return self._packed_ids

    def pack(self, adapter_ids: Sequence[str]) -> None:
        """Put these adapters (in this order) into contiguous per-layer buffers; see module doc.

        Their parameters keep their values and identity (optimizer state stays valid); their
        gradients become views of the packed gradient buffers, which the caller zeroes in place
        (:meth:`zero_packed_grads`) rather than setting to None.
        """
        ids = tuple(adapter_ids)
        unknown = [a for a in ids if a not in self.configs]
        if unknown or len(set(ids)) != len(ids):
            raise ValueError(f"cannot pack {list(ids)}: unknown or repeated adapters {unknown}")
        for layer in self.layers.values():
            layer.pack(ids)
        self._packed_ids = ids

    def unpack(self) -> None:
        for layer in self.layers.values():
            layer.unpack()
        self._packed_ids = ()

    def pack_intact(self, adapter_ids: Sequence[str]) -> bool:
        """Whether ``adapter_ids`` are packed in this order and still alias the buffers."""
        return tuple(adapter_ids) == self._packed_ids and all(layer.pack_intact() for layer in self.layers.values())

    def packed_grads(self) -> list[torch.Tensor]:
        return [g for layer in self.layers.values() for g in layer.packed_grads()]

    def zero_packed_grads(self) -> None:
        grads = self.packed_grads()
        if grads:
            torch._foreach_zero_(grads)

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
        """``{"<module path>.lora_A.weight": A, ...}`` for one adapter (detached views)."""
        out: dict[str, torch.Tensor] = {}
        for name, layer in self.layers.items():
            out[f"{name}.lora_A.weight"] = layer.lora_A[adapter_id].detach()
            out[f"{name}.lora_B.weight"] = layer.lora_B[adapter_id].detach()
        return out

    def load_state_dict_of(self, adapter_id: str, tensors: dict[str, torch.Tensor]) -> None:
        """Copy weights saved by :meth:`state_dict_of` back into an existing adapter."""
        with torch.no_grad():
            for key, value in self.state_dict_of(adapter_id).items():
                value.copy_(tensors[key])

    @contextmanager
    def route(
        self, row_adapters: Sequence[tuple[str, int]], *, token_counts: Sequence[int] | None = None
    ) -> Iterator[None]:
        """Within the block, rows are ``(adapter_id, n_rows)`` groups in order.

        Every row of the batch must belong to one listed group; the groups' row counts sum to
        the batch size (a group may have no rows). ``token_counts`` gives each group's tokens
        when sequences are concatenated into one row (padding-free batches).
        """
        ids = tuple(a for a, _ in row_adapters)
        configs = [self.configs[a] for a in ids]
        if token_counts is not None and len(token_counts) != len(ids):
            raise ValueError(f"{len(token_counts)} token counts for {len(ids)} groups")
        self.router.current = Route(
            adapter_ids=ids,
            row_counts=tuple(n for _, n in row_adapters),
            ranks=tuple(c.rank for c in configs),
            scalings=tuple(c.scaling for c in configs),
            token_counts=None if token_counts is None else tuple(token_counts),
            layouts=self._layouts,
        )
        try:
            yield
        finally:
            self.router.current = None
