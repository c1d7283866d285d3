"""The attention backend registry: what the built-in records say, and how the package imports.

Facts about a backend (it can be captured in a CUDA graph; it materialises the score
matrix) are fields of its record, read by the services, never name lists kept elsewhere.
The registry and the built-in records import one way only: the records are data and the
registry registers them (it used to import the records' module by name, which imported
the registry back).
"""

from __future__ import annotations

import ast
from pathlib import Path

from modalmesh.attention import registry
from modalmesh.attention.capability import BackendSpec

PACKAGE = Path(__file__).resolve().parents[1] / "modalmesh" / "attention"


def test_backend_facts_are_fields_of_their_records():
    graph_safe = {name for name in registry.names() if registry.spec(name).graph_safe}
    score_matrix = {name for name in registry.names() if registry.spec(name).score_matrix}
    assert graph_safe == {"triton_paged"}
    assert score_matrix == {"sdpa_math", "torch_naive"}
    assert BackendSpec("plugin", "x:Y", targets=()).graph_safe is False  # unknown kernels are not trusted


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parents[1]).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    """Modules of modalmesh.attention that `path` imports: import statements and import_module("literal")."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):  # the package uses absolute imports only
            base = node.module or ""
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)  # `from pkg import module`
        elif (isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", None)) == "import_module"
              and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
            found.add(node.args[0].value)
    return {name for name in found if name.startswith("modalmesh.attention")}


def test_no_import_cycle_inside_the_attention_package():
    modules = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    edges = {name: {m for m in _imports(path) if m in modules and m != name} for name, path in modules.items()}
    # The package's own __init__ re-exports its modules; a cycle through it is not one between modules.
    root = "modalmesh.attention"
    edges = {name: targets - {root} for name, targets in edges.items() if name != root}

    def cycle_from(start):
        stack, seen = [(start, [start])], set()
        while stack:
            node, path = stack.pop()
            for nxt in edges.get(node, ()):
                if nxt == start:
                    return path + [start]
                if nxt not in seen:
                    seen.add(nxt)
                    stack.append((nxt, path + [nxt]))
        return None

    cycles = [c for c in map(cycle_from, sorted(edges)) if c]
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)
