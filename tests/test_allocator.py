"""The CUDA allocator setting: the default unless the user set one, made by the program before torch loads."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from plora_hpo.allocator import DEFAULT, VARIABLES, allocator_settings, use_default_allocator
from tests.conftest import child_pythonpath

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


def _as_main_sees_it(**env: str) -> dict:
    """In a fresh interpreter: the allocator variables after ``import plora_hpo.cli``, and those
    that :func:`plora_hpo.cli.main` sees when the program (``entry``) calls it, with whether torch
    had loaded by then (``main`` is replaced by a probe; the command itself does not matter)."""
    base = {k: v for k, v in os.environ.items() if k not in VARIABLES}
    script = (
        "import json, os, sys; import plora_hpo.cli as cli; "
        f"seen = lambda: {{k: os.environ.get(k) for k in {VARIABLES!r}}}; imported = seen(); "
        "cli.main = lambda argv: print(json.dumps({'imported': imported, 'main': seen(), "
        "'torch_loaded': 'torch' in sys.modules})) or 0; cli.entry([])"
    )
    out = subprocess.run(
        [sys.executable, "-c", script],
        env={**base, "PYTHONPATH": child_pythonpath(), **env},
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(out.stdout)


def test_the_program_sets_the_default_before_torch_loads_and_an_import_does_not():
    seen = _as_main_sees_it()
    assert seen["imported"] == dict.fromkeys(VARIABLES)  # a process of one's own that imports the CLI: untouched
    assert seen["main"] == {"PYTORCH_CUDA_ALLOC_CONF": DEFAULT, "PYTORCH_ALLOC_CONF": None}
    assert not seen["torch_loaded"]  # torch reads the variable once: it must not have loaded yet


@pytest.mark.parametrize(("name", "value"), USERS)
def test_the_program_keeps_the_users_setting(name, value):
    seen = _as_main_sees_it(**{name: value})
    assert seen["main"] == {k: (value if k == name else None) for k in VARIABLES}
