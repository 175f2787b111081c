"""The direct launch path: after the first call through ``kernel[grid]``, the same arguments go
straight to the compiled launcher, unless a data pointer's alignment changes or hooks are set;
inside ``compile_ahead`` a launch only hands its variants to the compiler.

Runs anywhere: a stand-in kernel records how it was called (the interpreter never returns a
compiled kernel, so the real kernels there always take the JIT path).
"""

from __future__ import annotations

import pytest
import torch

from plora_hpo.kernels import _compiled

pytestmark = pytest.mark.skipif(_compiled.knobs is None, reason="Triton < 3.4: every launch takes the JIT path")


class _Compiled:
    def __init__(self, log: list) -> None:
        self.function, self.packed_metadata = "function", "metadata"
        self.run = lambda *args: log.append(("direct", args))


class _Kernel:
    def __init__(self) -> None:
        self.arg_names = ["x_ptr", "y_ptr", "n_cols", "BLOCK", "USE_ATOMIC"]
        self.log: list = []

    def warmup(self, *args, grid, **kwargs):
        self.log.append(("compile", grid, args, kwargs))

    def __getitem__(self, grid):
        def jit(*args, **kwargs):
            self.log.append(("jit", grid, args, kwargs))
            return _Compiled(self.log)

        return jit


class _Driver:
    def __init__(self) -> None:
        self.active = self
        self.get_current_device = lambda: 0
        self.get_current_stream = lambda device: 1234


@pytest.fixture
def kernel(monkeypatch: pytest.MonkeyPatch) -> _Kernel:
    monkeypatch.setattr(_compiled, "driver", _Driver())
    return _Kernel()


def test_second_call_goes_straight_to_the_launcher(kernel: _Kernel) -> None:
    launch = _compiled.Launch(kernel, (3, 2, 1), 2, (40,), {"BLOCK": 16, "USE_ATOMIC": False, "num_warps": 4})
    x, y = torch.zeros(8), torch.zeros(8)
    launch(x, y)
    launch(x, y)
    assert [e[0] for e in kernel.log] == ["jit", "direct"]
    assert kernel.log[0][1:] == ((3, 2, 1), (x, y, 40), {"BLOCK": 16, "USE_ATOMIC": False, "num_warps": 4})
    assert kernel.log[1][1] == (3, 2, 1, 1234, "function", "metadata", None, None, None, x, y, 40, 16, False)


def test_new_alignment_recompiles_and_hooks_disable_the_shortcut(kernel: _Kernel) -> None:
    launch = _compiled.Launch(kernel, (1, 1, 1), 2, (40,), {"BLOCK": 16, "USE_ATOMIC": False})
    x = torch.zeros(9)
    launch(x, x)
    launch(x[1:], x)  # 4-byte offset: Triton specialises on 16-byte alignment
    launch(x[1:], x)
    assert [e[0] for e in kernel.log] == ["jit", "jit", "direct"]
    from triton import knobs

    def hook(metadata) -> None:
        pass

    knobs.runtime.launch_enter_hook.add(hook)
    try:
        launch(x, x)
    finally:
        knobs.runtime.launch_enter_hook.remove(hook)
    assert kernel.log[-1][0] == "jit"


@pytest.mark.skipif(_compiled.AsyncCompileMode is None, reason="this Triton does not compile asynchronously")
def test_inside_compile_ahead_a_launch_compiles_its_variants_and_launches_nothing(kernel: _Kernel) -> None:
    consts = {"BLOCK": 16, "USE_ATOMIC": False, "num_warps": 4}
    launch = _compiled.Launch(kernel, (3, 2, 1), 2, (40,), consts, ({"USE_ATOMIC": True},))
    x, y = torch.zeros(8), torch.zeros(8)
    with _compiled.compile_ahead(2):
        launch(x, y)
    assert kernel.log == [
        ("compile", (3, 2, 1), (x, y, 40), consts),
        ("compile", (3, 2, 1), (x, y, 40), {**consts, "USE_ATOMIC": True}),
    ]
    launch(x, y)  # out of the block: a launch again
    assert kernel.log[-1] == ("jit", (3, 2, 1), (x, y, 40), consts)
