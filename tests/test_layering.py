"""The package's import graph: no cycles between modules, and the GPU-image layers stay light.

Every ``import`` counts, including those inside functions (a lazy import is still a dependency)
and under ``if TYPE_CHECKING:`` (a module that names another's types depends on it).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
ROOTS = {"plora_hpo": REPO / "plora_hpo"}


def modules() -> dict[str, Path]:
    found = {}
    for prefix, root in ROOTS.items():
        for path in root.rglob("*.py"):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join([prefix, *parts])] = path
    return found


def imports_of(name: str, path: Path, known: set[str]) -> set[str]:
    """Modules of the package that ``name`` imports (resolved to the longest known prefix)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    targets: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.Import):
            targets.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            targets.add(base)
            targets.update(f"{base}.{alias.name}" for alias in node.names)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text()))
    resolved = set()
    for target in targets:
        while target and target not in known:
            target = target.rpartition(".")[0]
        if target and target != name:
            resolved.add(target)
    return resolved


def graph() -> dict[str, set[str]]:
    found = modules()
    known = set(found)
    edges = {name: imports_of(name, path, known) for name, path in found.items()}
    # a package's __init__ re-exporting its own modules is not a dependency of those modules on it
    for name in edges:
        edges[name] = {t for t in edges[name] if not name.startswith(f"{t}.")}
    return edges


def test_no_import_cycles_between_modules():
    edges = graph()
    state: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def dfs(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == 1:
                cycles.append([*stack[stack.index(nxt) :], nxt])
            elif nxt not in state:
                dfs(nxt)
        stack.pop()
        state[node] = 2

    for node in sorted(edges):
        if node not in state:
            dfs(node)
    assert not cycles, "import cycles: " + "; ".join(" → ".join(c) for c in cycles[:5])


@pytest.mark.parametrize("layer", ["plora_hpo.kernels", "plora_hpo.engine"])
def test_engine_and_kernels_import_no_integration_library(layer):
    """The GPU image has torch, transformers and triton only: these layers must not need more."""
    banned = ("optuna", "mlflow", "lm_eval", "gurobipy", "highspy", "pydantic")
    for name, path in modules().items():
        if name != layer and not name.startswith(f"{layer}."):
            continue
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            mods = []
            if isinstance(node, ast.Import):
                mods = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level:
                mods = [node.module or ""]
            for mod in mods:
                assert mod.split(".")[0] not in banned, f"{name} imports {mod}"
                assert not mod.startswith("plora_hpo.evaluation"), f"{name} imports {mod}"
