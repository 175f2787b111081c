"""Make ``plora_hpo`` importable from a bare checkout (the GPU image runs scripts uninstalled).

Benchmark scripts import this module first; it puts the repository root on ``sys.path``.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
