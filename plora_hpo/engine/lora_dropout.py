"""Dropout on the LoRA branch's input: each adapter's own p, masks reproducible from a key.

Boundary: what an adapter's LoRA branch sees of its rows of a layer's input, not where that
input is used (:class:`~plora_hpo.engine.packed_lora.PackedLoraLinear`) nor which forwards train
(the trainer's route carries keys only then). As PEFT's ``lora_dropout``:
``y = base(x) + s·B·A·dropout(x)``; the base layer sees x undropped, kept elements are scaled by
``1/(1-p)`` and an adapter with p = 0 sees x itself.

A mask is a function of the adapter's forward key and the layer's index alone, never of a shared
random stream: the trainer keys an adapter's forward by its seed, step and micro-batch
(:func:`forward_key`), so an adapter's masks do not depend on its packmates, a resumed trial draws
the masks it would have drawn, and activation checkpointing's recomputation of a layer sees the
masks of the forward it repeats.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from plora_hpo.kernels import SegmentLayout

__all__ = ["dropout_mask", "forward_key", "lora_input"]

_U64 = 2**64 - 1


def _mix(*values: int) -> int:
    """A well-spread 63-bit seed from small integers (numpy's ``SeedSequence`` hash)."""
    state = np.random.SeedSequence([v & _U64 for v in values]).generate_state(1, np.uint64)
    return int(state[0]) >> 1


def forward_key(seed: int, step: int, micro_batch: int) -> int:
    """The key of one adapter's training forward: its seed, its 0-based step, and which of its
    micro-batches of that step this is."""
    return _mix(seed, step, micro_batch)


def dropout_mask(shape: Sequence[int], p: float, key: int, layer_index: int, device: torch.device) -> torch.Tensor:
    """fp32 multipliers: 0 with probability ``p``, else ``1/(1-p)``, drawn from (``key``, ``layer_index``).

    The same numbers ``torch.nn.functional.dropout`` multiplies by (a Bernoulli draw divided by 1-p).
    """
    generator = torch.Generator(device=device).manual_seed(_mix(key, layer_index))
    mask = torch.empty(tuple(shape), dtype=torch.float32, device=device).bernoulli_(1 - p, generator=generator)
    return mask.div_(1 - p)


def lora_input(
    x: torch.Tensor,
    layout: SegmentLayout,
    dropouts: Sequence[float],
    keys: Sequence[int],
    layer_index: int,
) -> torch.Tensor:
    """``x`` (tokens × d_in) with each adapter's rows dropped out by its own p, in x's dtype.

    Rows of adapters with p = 0, and rows of no adapter, are x's own values.
    """
    n, starts, ends = x.shape[0], layout.token_offsets[0], layout.token_offsets[-1]
    parts = list(x.split([starts, *layout.segment_lengths(), n - ends]))
    for k, (p, key) in enumerate(zip(dropouts, keys)):
        rows = parts[k + 1]
        if p > 0 and rows.shape[0]:
            parts[k + 1] = (rows * dropout_mask(rows.shape, p, key, layer_index, x.device)).to(x.dtype)
    return torch.cat(parts)
