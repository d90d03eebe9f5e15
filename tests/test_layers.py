"""The import graph: launch/ on top, megatron_grpo/ in the middle, model_bridge/ at the bottom.

Every import counts, including ones inside functions (a lazy import still ties the modules
together). A module may import from its own package or from a package below it; a cycle between
modules of one package is refused as well. On failure the test lists each offending import.
"""
from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LAYERS = ("launch", "megatron_grpo", "model_bridge")  # top to bottom


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    out = {}
    for layer in LAYERS:
        for path in sorted((REPO / layer).rglob("*.py")):
            out[_module_name(path)] = path
    return out


def _resolve(name: str, known: dict[str, Path]) -> str | None:
    """The longest known module that `name` names or lies inside (`a.b.func` -> `a.b`)."""
    while name:
        if name in known:
            return name
        name = name.rpartition(".")[0]
    return None


def _imports(module: str, path: Path, known: dict[str, Path]) -> list[tuple[str, int]]:
    """(imported module, line) for every import in `path` that names one of our modules."""
    is_pkg = path.name == "__init__.py"
    here = module if is_pkg else module.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = here.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            # `from pkg import sub` imports the submodule when there is one, else a name of pkg.
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        else:
            continue
        for target in targets:
            resolved = _resolve(target, known)
            if resolved is not None and resolved != module and (resolved, node.lineno) not in found:
                found.append((resolved, node.lineno))
    return found


def _graph() -> tuple[dict[str, Path], dict[str, list[tuple[str, int]]]]:
    known = _modules()
    return known, {m: _imports(m, p, known) for m, p in known.items()}


def _where(known, module, line) -> str:
    return f"{known[module].relative_to(REPO)}:{line}"


def test_imports_point_down_only():
    known, graph = _graph()
    rank = {layer: i for i, layer in enumerate(LAYERS)}
    upward = [f"{_where(known, m, line)}: {m} imports {t}"
              for m, edges in graph.items() for t, line in edges
              if rank[t.split(".")[0]] < rank[m.split(".")[0]]]
    assert not upward, "upward imports (launch -> megatron_grpo -> model_bridge only):\n" + "\n".join(upward)


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []
    counter = [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_cycle_inside_a_package():
    known, graph = _graph()
    same_layer = {m: {t for t, _ in edges if t.split(".")[0] == m.split(".")[0]}
                  for m, edges in graph.items()}
    problems = []
    for comp in _cycles(same_layer):
        members = set(comp)
        edges = [f"  {_where(known, m, line)}: {m} imports {t}"
                 for m in comp for t, line in graph[m] if t in members]
        problems.append("cycle " + " <-> ".join(comp) + ":\n" + "\n".join(edges))
    assert not problems, "import cycles:\n" + "\n".join(problems)
