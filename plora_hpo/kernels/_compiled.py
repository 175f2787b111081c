"""Launch a Triton kernel straight through its compiled launcher once it has been compiled.

``kernel[grid](*args, **constexprs)`` binds and specialises every argument, builds a cache key
and looks the kernel up on every call: host time that grows with our ~30 parameters, and a
packed step makes five such launches per adapted projection, where small packs are host-bound.
A :class:`Launch` knows all its arguments but the data tensors in advance (grid, plan tensors,
ints, constexprs), so after its first call it only checks the one thing Triton specialises on
that can still change (each data pointer's 16-byte alignment) and calls the compiled launcher.

Under the interpreter, while launch hooks are installed (profilers), or with a Triton whose
compiled kernels lack these launcher attributes, every call goes through ``kernel[grid]``.

Compiling is the other host cost: a pack's first steps compile a few dozen kernel variants, one
after another, each on one core. Inside :func:`compile_ahead` a launch launches nothing: it hands
its variant, and the variants later steps may take instead (:attr:`Launch.alternatives`), to
Triton's asynchronous compile mode, which compiles them on a pool of threads; leaving the block
waits for them all. One untimed pass of a step's work through that block (the caller's) leaves
compiled the kernels that the pack's steps launch through :class:`Launch`.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

import torch

try:
    from triton import knobs
    from triton.runtime import driver
except ImportError:  # Triton < 3.4: always take the JIT path
    knobs = driver = None
try:
    from triton.runtime._async_compile import AsyncCompileMode
except ImportError:  # a Triton without asynchronous compiling: kernels compile at their first launch
    AsyncCompileMode = None

_ahead: ContextVar[bool] = ContextVar("plora_hpo_compile_ahead", default=False)


def can_compile_ahead(device: torch.device) -> bool:
    """Whether :func:`compile_ahead` compiles anything for kernels launched on ``device``."""
    return device.type == "cuda" and AsyncCompileMode is not None and not os.environ.get("TRITON_INTERPRET")


@contextmanager
def compile_ahead(threads: int) -> Iterator[None]:
    """Within the block, this thread's launches compile their kernels on ``threads`` threads and
    launch nothing (their outputs are left as allocated); leaving it waits for every compile. A
    variant that fails to compile is dropped: its first real launch compiles it again and raises
    there, where the caller handles it."""
    pool = ThreadPoolExecutor(max(1, threads), thread_name_prefix="triton-compile")
    with pool, AsyncCompileMode(pool, ignore_errors=True):
        token = _ahead.set(True)
        try:
            yield
        finally:
            _ahead.reset(token)


def _hooks_installed() -> bool:
    enter, leave = knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook
    return bool(getattr(enter, "calls", enter)) or bool(getattr(leave, "calls", leave))  # chains or callables


def _launcher_of(compiled: Any) -> tuple[Any, Any, Any] | None:
    """(launcher, function handle, packed metadata) of a compiled kernel, if it exposes them."""
    if knobs is None or compiled is None:
        return None
    try:
        return compiled.run, compiled.function, compiled.packed_metadata
    except AttributeError:
        return None


@dataclass
class Launch:
    """One kernel launch of a plan: ``kernel[grid](*data, *fixed, **constexprs)``.

    Attributes:
        n_data: how many leading arguments are the per-call data tensors.
        fixed: the arguments after them (plan tensors, sizes, strides), the same on every call.
        constexprs: constexpr values and launch options (``num_warps``, ``num_stages``).
        alternatives: constexpr changes that the same launch may take on another step (a split
            that depends on the batch), compiled too by :func:`compile_ahead`.
    """

    kernel: Any
    grid: tuple[int, int, int]
    n_data: int
    fixed: tuple
    constexprs: dict[str, Any]
    alternatives: tuple[dict[str, Any], ...] = ()
    _tail: tuple = field(init=False, repr=False)
    _compiled: dict = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        names = self.kernel.arg_names[self.n_data + len(self.fixed) :]
        self._tail = tuple(self.constexprs[name] for name in names)  # positional, as Triton passes them

    def __call__(self, *data: torch.Tensor) -> None:
        if _ahead.get():
            for change in ({}, *self.alternatives):
                self.kernel.warmup(*data, *self.fixed, grid=self.grid, **{**self.constexprs, **change})
            return
        ptrs = 0
        for t in data:
            ptrs |= t.data_ptr()
        key = True if ptrs % 16 == 0 else tuple(t.data_ptr() % 16 == 0 for t in data)  # usually all aligned
        entry = self._compiled.get(key)
        if entry is not None and not _hooks_installed():
            run, function, metadata = entry
            stream = driver.active.get_current_stream(driver.active.get_current_device())
            run(*self.grid, stream, function, metadata, None, None, None, *data, *self.fixed, *self._tail)
            return
        entry = _launcher_of(self.kernel[self.grid](*data, *self.fixed, **self.constexprs))
        if entry is not None:
            self._compiled[key] = entry
