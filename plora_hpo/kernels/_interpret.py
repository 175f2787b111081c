"""Keep Triton's CPU interpreter usable under NumPy ≥ 2.4 (triton-lang/triton#9171).

Triton 3.6's interpreter turns scalars into 1-element arrays and converts them with
``int(array)``, which NumPy 2.4 rejects, so every loop with a runtime bound fails. We re-set
``tensor.__index__`` after the interpreter patches ``tl.tensor``; a no-op on fixed versions.
"""

from __future__ import annotations

import os


def patch_interpreter() -> None:
    if os.environ.get("TRITON_INTERPRET") != "1":
        return
    from triton.runtime import interpreter

    original = getattr(interpreter, "_patch_lang_tensor", None)
    if original is None or getattr(original, "_plora_patched", False):
        return

    def patched(tensor, scope) -> None:
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patched._plora_patched = True  # type: ignore[attr-defined]
    interpreter._patch_lang_tensor = patched
