"""peerd/ and trainer/ have no import cycles: every import that runs (at module level or inside a function; only
`if TYPE_CHECKING:` blocks are exempt) points down a layered graph. A cycle means two modules that cannot be read,
tested or replaced apart, and imports that work only in one order."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PACKAGES = ("peerd", "trainer")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_type_checking(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or (
        isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING"
    )


def _imports(tree: ast.AST, module: str, is_package: bool, known: set[str]) -> set[str]:
    """Modules of ours that `module` imports at run time (the imported module itself, or for `from X import name`
    the submodule X.name when that is a module of ours)."""
    out: set[str] = set()
    base = module.split(".") if is_package else module.split(".")[:-1]

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.split(".")[0] in PACKAGES)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                target = ".".join(base[: len(base) - node.level + 1] + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] in PACKAGES:
                for a in node.names:
                    sub = f"{target}.{a.name}"
                    out.add(sub if sub in known else target)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return {m for m in out if m in known and m != module}


def import_graph() -> dict[str, set[str]]:
    files = [p for pkg in PACKAGES for p in (REPO / pkg).rglob("*.py") if "_pb2" not in p.name]
    known = {_module_name(p) for p in files}
    return {
        _module_name(p): _imports(ast.parse(p.read_text()), _module_name(p), p.name == "__init__.py", known)
        for p in files
    }


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as a path [a, b, ..., a], or None. Package __init__ edges to their own submodules are
    skipped: importing peerd.x runs peerd/__init__ first, so a package re-exporting its parts is not a cycle."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def edges(m: str) -> list[str]:
        return sorted(d for d in graph.get(m, ()) if not d.startswith(m + "."))

    def dfs(m: str) -> list[str] | None:
        state[m] = 1
        stack.append(m)
        for d in edges(m):
            if state.get(d) == 1:
                return [*stack[stack.index(d) :], d]
            if d not in state and (found := dfs(d)):
                return found
        stack.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state and (found := dfs(m)):
            return found
    return None


def test_the_checker_finds_a_cycle() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None
    tree = ast.parse(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import peerd.b\ndef f():\n    import peerd.c\n"
    )
    assert _imports(tree, "peerd.a", False, {"peerd.a", "peerd.b", "peerd.c"}) == {"peerd.c"}


def test_no_import_cycles() -> None:
    graph = import_graph()
    assert len(graph) > 30  # it read the packages
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])
