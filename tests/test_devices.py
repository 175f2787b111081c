"""The ``--device`` text: an explicit list is read without torch, as torch names the devices."""

from __future__ import annotations

import pytest
import torch

from plora_hpo.devices import in_processes, named_devices, resolve_devices
from plora_hpo.errors import ConfigError


@pytest.mark.parametrize("spec", ["cpu", "cpu,cpu", "cuda:0", " cuda:1 , cpu", "cuda:10"])
def test_an_explicit_list_names_its_devices_as_torch_does(spec):
    assert named_devices(spec) == [str(torch.device(part.strip())) for part in spec.split(",")]


@pytest.mark.parametrize("spec", [None, "cuda", "gpu", "cuda:x", "cuda:01", "", "cpu,mps", "cuda:-1"])
def test_what_is_not_an_explicit_list_is_left_to_torch(spec):
    assert named_devices(spec) is None


@pytest.mark.parametrize("spec", ["gpu", "cuda:01", "cpu,mps"])
def test_torch_says_what_is_wrong_with_the_rest(spec):
    with pytest.raises(ConfigError, match=f"--device {spec}"):
        resolve_devices(spec)


def test_several_devices_or_split_packs_train_in_processes_unless_told():
    assert not in_processes(None, 1, 1)
    assert in_processes(None, 2, 1) and in_processes(None, 2, 2)
    assert not in_processes(False, 2, 1) and in_processes(True, 1, 1)
