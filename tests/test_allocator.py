"""The CUDA allocator setting: the default unless the user set one, made by the CLI before torch loads."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from plora_hpo.allocator import DEFAULT, VARIABLES, allocator_settings, use_default_allocator
from tests.conftest import REPO

USERS = [("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:64"), ("PYTORCH_ALLOC_CONF", "backend:native")]


def test_the_default_fills_an_unconfigured_environment():
    environ = {"PATH": "/bin"}
    use_default_allocator(environ)
    assert environ == {"PATH": "/bin", "PYTORCH_CUDA_ALLOC_CONF": DEFAULT}
    assert allocator_settings(environ) == {"PYTORCH_CUDA_ALLOC_CONF": DEFAULT}


@pytest.mark.parametrize(("name", "value"), USERS)
def test_a_users_setting_under_either_name_is_kept_alone(name, value):
    environ = {name: value}
    use_default_allocator(environ)
    assert environ == {name: value}


def _after_cli_import(**env: str) -> dict:
    """The allocator variables after ``import plora_hpo.cli`` in a fresh interpreter, and whether torch had loaded."""
    base = {k: v for k, v in os.environ.items() if k not in VARIABLES}
    script = (
        "import json, os, sys; import plora_hpo.cli; "
        f"print(json.dumps({{'vars': {{k: os.environ.get(k) for k in {VARIABLES!r}}}, "
        "'torch_loaded': 'torch' in sys.modules}))"
    )
    out = subprocess.run(
        [sys.executable, "-c", script],
        env={**base, "PYTHONPATH": str(REPO), **env},
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(out.stdout)


def test_the_program_sets_the_default_before_torch_loads():
    seen = _after_cli_import()
    assert seen["vars"] == {"PYTORCH_CUDA_ALLOC_CONF": DEFAULT, "PYTORCH_ALLOC_CONF": None}
    assert not seen["torch_loaded"]  # torch reads the variable once: it must not have loaded yet


@pytest.mark.parametrize(("name", "value"), USERS)
def test_the_program_keeps_the_users_setting(name, value):
    seen = _after_cli_import(**{name: value})
    assert seen["vars"] == {k: (value if k == name else None) for k in VARIABLES}
