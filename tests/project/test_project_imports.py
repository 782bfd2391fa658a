"""The import graph of the five packages, read from the source (nothing is imported):

- no import cycle, between packages or inside one (function-level imports count: a cycle
  dodged by importing inside a function is still a cycle; `if TYPE_CHECKING:` imports don't);
- no private name (`_x`) crosses a package boundary, as `from m import _x` or `module._x`.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("gateway", "prompt_lint", "radix_cache", "engine", "paged_kernels")


class Import(NamedTuple):
    """One imported module (and the name taken from it, for `from m import name`)."""

    module: str
    name: str | None
    line: int


def module_files() -> dict[str, Path]:
    """Dotted module name -> source file, for every module of the five packages."""
    out: dict[str, Path] = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


def _type_checking_block(node: ast.AST) -> bool:
    test = node.test if isinstance(node, ast.If) else None
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _walk(node: ast.AST) -> Iterator[ast.AST]:
    """Every node below `node`, skipping the bodies of `if TYPE_CHECKING:`."""
    for child in ast.iter_child_nodes(node):
        if _type_checking_block(child):
            assert isinstance(child, ast.If)
            for other in child.orelse:
                yield other
                yield from _walk(other)
            continue
        yield child
        yield from _walk(child)


def imports_of(module: str, path: Path, known: set[str]) -> list[Import]:
    """What `module` imports (resolved to modules of `known` where a name is a submodule)."""
    is_package = path.name == "__init__.py"
    out: list[Import] = []
    for node in _walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            out += [Import(alias.name, None, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = module.split(".")[: len(module.split(".")) - node.level + is_package]
                base = ".".join([*anchor, *([base] if base else [])])
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                out.append(Import(sub, None, node.lineno) if sub in known
                           else Import(base, alias.name, node.lineno))
    return out


def import_graph() -> dict[str, set[str]]:
    """module -> modules of the five packages it imports."""
    files = module_files()
    known = set(files)
    return {m: {i.module for i in imports_of(m, p, known) if i.module in known and i.module != m}
            for m, p in files.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    top = stack.pop()
                    on_stack.discard(top)
                    component.append(top)
                    if top == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_cycle_finder_finds_a_known_cycle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert cycles(graph) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycles_between_or_within_packages() -> None:
    graph = import_graph()
    assert len(graph) > 80  # the walk found the packages
    assert "prompt_lint.segment" in graph["prompt_lint.toolset"]
    assert cycles(graph) == []


def _package(module: str) -> str:
    return module.split(".")[0]


def private_crossings() -> list[str]:
    """`pkg.mod:line imports other.mod._name` for every private name taken across packages."""
    files = module_files()
    known = set(files)
    found: list[str] = []
    for module, path in files.items():
        imported = imports_of(module, path, known)
        for imp in imported:
            if _package(imp.module) == _package(module) or _package(imp.module) not in PACKAGES:
                continue
            names = [imp.name] if imp.name else []
            names += imp.module.split(".")[1:]
            if any(n.startswith("_") and not n.startswith("__") for n in names):
                found.append(f"{module}:{imp.line} imports {imp.module} {imp.name or ''}")
        found += _private_attributes(module, path, known)
    return found


def _private_attributes(module: str, path: Path, known: set[str]) -> list[str]:
    """`alias._x` where `alias` is a module of another package imported by this one."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    aliases: dict[str, str] = {}
    for node in _walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                aliases[alias.asname or alias.name.split(".")[0]] = (
                    alias.name if alias.asname else alias.name.split(".")[0])
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                if sub in known:
                    aliases[alias.asname or alias.name] = sub
    found = []
    for node in _walk(tree):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                and node.value.id in aliases and node.attr.startswith("_")
                and not node.attr.startswith("__")):
            target = aliases[node.value.id]
            if _package(target) in PACKAGES and _package(target) != _package(module):
                found.append(f"{module}:{node.lineno} uses {target}.{node.attr}")
    return found


def test_private_name_finder_sees_both_forms(tmp_path: Path) -> None:
    source = "import engine.model as m\nfrom paged_kernels.checks import _plan\nx = m._cache\n"
    path = tmp_path / "probe.py"
    path.write_text(source)
    known = {"engine.model", "paged_kernels.checks"}
    imported = imports_of("gateway.probe", path, known)
    assert Import("paged_kernels.checks", "_plan", 2) in imported
    assert _private_attributes("gateway.probe", path, known) == [
        "gateway.probe:3 uses engine.model._cache"]


def test_no_private_name_crosses_a_package_boundary() -> None:
    assert private_crossings() == []
