"""K LoRA adapters of mixed rank injected into one frozen base model.

Every target ``nn.Linear`` is replaced by a :class:`PackedLoraLinear` that keeps the base layer
and one (A, B) pair per adapter. A :class:`Router` tells all layers which rows of the current
batch belong to which adapter, so one forward pass of the base serves every adapter and each
adapter touches only its own rows (gradients stay isolated).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import nn

from plora_hpo.adapter import AdapterConfig
from plora_hpo.kernels import SegmentLayout, packed_lora_add


@dataclass
class Route:
    """Rows of a batch grouped by adapter: ``row_counts[i]`` rows of ``adapter_ids[i]``, in order."""

    adapter_ids: tuple[str, ...]
    row_counts: tuple[int, ...]
    ranks: tuple[int, ...]
    scalings: tuple[float, ...]
    _layouts: dict[int, SegmentLayout] = field(default_factory=dict, repr=False)

    def layout(self, tokens_per_row: int) -> SegmentLayout:
        """Token segments for a forward whose rows hold ``tokens_per_row`` tokens each."""
        if tokens_per_row not in self._layouts:
            self._layouts[tokens_per_row] = SegmentLayout.from_counts(
                [c * tokens_per_row for c in self.row_counts], list(self.ranks), list(self.scalings)
            )
        return self._layouts[tokens_per_row]


class Router:
    """Shared by all packed layers of a model; holds the route of the forward in flight."""

    def __init__(self) -> None:
        self.current: Route | None = None


class PackedLoraLinear(nn.Module):
    """A frozen ``nn.Linear`` plus per-adapter LoRA factors applied to each adapter's rows."""

    def __init__(self, base: nn.Linear, router: Router) -> None:
        super().__init__()
        self.base = base
        self.router = router
        self.lora_A = nn.ParameterDict()
        self.lora_B = nn.ParameterDict()

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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        route = self.router.current
        if route is None or not route.adapter_ids:
            return y
        ids = route.adapter_ids
        a_cat = torch.cat([self.lora_A[i] for i in ids])
        b_cat = torch.cat([self.lora_B[i] for i in ids], dim=1)
        tokens_per_row = x.shape[-2] if x.dim() == 3 else 1
        out = packed_lora_add(
            y.reshape(-1, self.out_features),
            x.reshape(-1, self.in_features),
            a_cat,
            b_cat,
            route.layout(tokens_per_row),
        )
        return out.view_as(y)


class PackedLoraModel:
    """A causal LM with packed LoRA layers on ``target_modules``; the engine's model handle."""

    def __init__(self, model: nn.Module, target_modules: Sequence[str]) -> None:
        self.model = model
        self.target_modules = tuple(target_modules)
        self.router = Router()
        self.configs: dict[str, AdapterConfig] = {}
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
        for layer in self.layers.values():
            layer.remove_adapter(adapter_id)
        del self.configs[adapter_id]

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
    def route(self, row_adapters: Sequence[tuple[str, int]]) -> Iterator[None]:
        """Within the block, rows are ``(adapter_id, n_rows)`` groups in order.

        Every row of the batch must belong to one listed group; the groups' row counts sum to
        the batch size.
        """
        ids = tuple(a for a, _ in row_adapters)
        configs = [self.configs[a] for a in ids]
        self.router.current = Route(
            adapter_ids=ids,
            row_counts=tuple(n for _, n in row_adapters),
            ranks=tuple(c.rank for c in configs),
            scalings=tuple(c.scaling for c in configs),
        )
        try:
            yield
        finally:
            self.router.current = None
