"""The CUDA caching allocators' settings that the ``plora-hpo`` program runs with.

A pack's tensors change size whenever a member joins or leaves. Segments that grow in place
(torch's ``expandable_segments``) spare the caching allocator its retries after such a swap: free
every cached block, synchronise, allocate again. Checkpoints and trials parked out of a pack copy
adapters into page-locked host memory, gigabytes at large ranks, and the first time the host
allocator page-locks that much the training loop waits: ``pinned_use_cuda_host_register`` with
``pinned_num_register_threads`` maps the pages with several threads before registering them,
instead of one ``cudaHostAlloc`` that holds the driver's lock throughout (8 threads: the value
torch's documentation recommends).

torch reads the settings from the environment once, at the latest at its first allocation on a
GPU, so they are set before torch loads; processes started afterwards inherit them. A setting the
user made, under either of torch's names, is kept whole.

This module imports nothing but ``os``: importing it never loads torch.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping

VARIABLES = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")
"""torch's names for the allocator's settings (the CUDA-only one and the device-generic one)."""
DEFAULT = "expandable_segments:True,pinned_use_cuda_host_register:True,pinned_num_register_threads:8"


def allocator_settings(environ: MutableMapping[str, str] = os.environ) -> dict[str, str]:
    """The allocator variables that ``environ`` sets."""
    return {name: environ[name] for name in VARIABLES if name in environ}


def use_default_allocator(environ: MutableMapping[str, str] = os.environ) -> None:
    """Set :data:`DEFAULT` in ``environ`` unless it already configures the allocator."""
    if not allocator_settings(environ):
        environ[VARIABLES[0]] = DEFAULT
