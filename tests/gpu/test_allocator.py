"""On a GPU, the allocator setting the program makes is the one torch's caching allocator runs with
(``main`` replaced by a probe that allocates device and page-locked host memory, as a command
would after ``entry`` set it)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from plora_hpo.allocator import VARIABLES
from tests.conftest import child_pythonpath

SCRIPT = (
    "import plora_hpo.cli as cli\n"
    "def probe(argv):\n"
    "    import torch\n"
    "    x = torch.ones(64 << 20, device='cuda')\n"
    "    host = torch.empty(64 << 20, pin_memory=True)\n"  # page-locking works under them too
    "    host.copy_(x, non_blocking=True); torch.cuda.synchronize(); assert bool(host.eq(1).all())\n"
    "    print(sorted({s['is_expandable'] for s in torch.cuda.memory._snapshot()['segments']}))\n"
    "    return 0\n"
    "cli.main = probe\n"
    "cli.entry([])\n"
)


@pytest.mark.parametrize(
    ("env", "expected"), [({}, "[True]"), ({"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:False"}, "[False]")]
)
def test_cuda_segments_expand_unless_the_user_says_otherwise(env, expected):
    base = {k: v for k, v in os.environ.items() if k not in VARIABLES}
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT],
        env={**base, "PYTHONPATH": child_pythonpath(), **env},
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == expected
