"""Run the Triton kernels on Triton's CPU interpreter when no GPU is present.

The variable must be set before any ``@triton.jit`` function is defined, i.e. before the
kernel modules are imported; test modules import them only after this conftest has run.
"""

from __future__ import annotations

import os

import torch

ON_GPU = torch.cuda.is_available()
if not ON_GPU:
    os.environ.setdefault("TRITON_INTERPRET", "1")
