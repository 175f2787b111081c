"""Random packed batches and the fp64 oracle the kernel tests compare against."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from plora_hpo.kernels import SegmentLayout, packed_lora_reference


@dataclass
class Case:
    """One packed batch: segment lengths (0 = empty), ranks, rows before/after the segments."""

    lengths: list[int]
    ranks: list[int]
    d_in: int
    d_out: int
    lead: int = 0
    tail: int = 0

    @property
    def n_rows(self) -> int:
        return self.lead + sum(self.lengths) + self.tail

    def layout(self, gen: torch.Generator) -> SegmentLayout:
        scalings = (torch.rand(len(self.ranks), generator=gen) * 4 + 0.25).tolist()
        return SegmentLayout.from_counts(self.lengths, self.ranks, scalings, token_start=self.lead)


def random_inputs(
    case: Case, gen: torch.Generator, x_dtype: torch.dtype, w_dtype: torch.dtype, device: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """x, a_cat, b_cat (leaves requiring grad), base output and upstream gradient dy."""
    total_rank = sum(case.ranks)

    def rand(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * scale

    x = rand(case.n_rows, case.d_in).to(device, x_dtype).requires_grad_()
    a = rand(total_rank, case.d_in, scale=case.d_in**-0.5).to(device, w_dtype).requires_grad_()
    b = rand(case.d_out, total_rank, scale=0.1).to(device, w_dtype).requires_grad_()
    base = rand(case.n_rows, case.d_out).to(device, x_dtype).requires_grad_()
    dy = rand(case.n_rows, case.d_out).to(device, x_dtype)
    return x, a, b, base, dy


def oracle(
    x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, layout: SegmentLayout, dy: torch.Tensor
) -> tuple[torch.Tensor, ...]:
    """delta, dx, dA, dB in float64 on the CPU, from the reference implementation."""
    x64, a64, b64 = (t.detach().cpu().double().requires_grad_() for t in (x, a, b))
    delta = packed_lora_reference(x64, a64, b64, layout)
    grads = torch.autograd.grad(delta, (x64, a64, b64), dy.cpu().double())
    return (delta.detach(), *grads)


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """‖got − want‖ / ‖want‖ in float64; NaN anywhere (an unwritten element) gives inf."""
    got64 = got.detach().cpu().double()
    if not torch.isfinite(got64).all():
        return float("inf")
    denom = want.norm().item()
    diff = (got64 - want).norm().item()
    return diff / denom if denom > 0 else diff
