"""What a device lets a sweep plan with: its own memory plus what no other process holds."""

from __future__ import annotations

import torch

from plora_hpo.resources import usable_memory_bytes

GIB = 2**30


def test_the_host_offers_its_whole_budget():
    assert usable_memory_bytes(torch.device("cpu"), 24 * GIB) == 24 * GIB


def test_a_neighbours_memory_on_a_shared_gpu_is_not_planned_with(monkeypatch):
    # another process holds 60 GiB of a 140 GiB card; this one has 10 GiB reserved
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (70 * GIB, 140 * GIB))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 10 * GIB)
    assert usable_memory_bytes(torch.device("cuda", 0), 140 * GIB) == 80 * GIB


def test_never_more_than_the_card(monkeypatch):
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (140 * GIB, 140 * GIB))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 2 * GIB)
    assert usable_memory_bytes(torch.device("cuda", 0), 140 * GIB) == 140 * GIB
