"""Make ``plora_hpo`` importable from a bare checkout (the GPU image runs scripts uninstalled).

The repository's top-level ``kernels/`` folder installs as ``plora_hpo.kernels``; without an
install, this registers it under that name. Benchmark scripts import this module first.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def bootstrap_imports() -> None:
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    try:
        import plora_hpo.kernels  # noqa: F401
    except ImportError:
        spec = importlib.util.spec_from_file_location(
            "plora_hpo.kernels", ROOT / "kernels" / "__init__.py", submodule_search_locations=[str(ROOT / "kernels")]
        )
        module = importlib.util.module_from_spec(spec)
        sys.modules["plora_hpo.kernels"] = module
        spec.loader.exec_module(module)


bootstrap_imports()
