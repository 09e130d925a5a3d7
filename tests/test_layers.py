"""The package's module-level imports follow the layer order written in docs/architecture.md.

Every module of the installed package is parsed (not imported) with `ast`. An import counts when it
runs at module import: imports inside functions and under `if TYPE_CHECKING:` do not
(docs/architecture.md, "What counts as an import"). The layer table is read from that document,
so the order is written down once.
"""

from __future__ import annotations

import ast
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
ARCHITECTURE = ROOT / "docs" / "architecture.md"
COMPILE_SIDE = "compile side"


def package_dirs() -> dict[str, pathlib.Path]:
    """pyproject's package-dir: installed package name -> source folder."""
    text = (ROOT / "pyproject.toml").read_text()
    line = re.search(r"^package-dir\s*=\s*\{(.*)\}", text, re.M)
    assert line, "pyproject.toml has no [tool.setuptools] package-dir line"
    return {name: ROOT / folder for name, folder in re.findall(r'"([\w.]+)"\s*=\s*"([\w./]+)"', line.group(1))}


def package_modules() -> dict[str, pathlib.Path]:
    """Dotted module name -> file, for every .py file that installs."""
    dirs = package_dirs()
    modules = {}
    for package, folder in dirs.items():
        nested = {d for d in dirs.values() if d != folder and folder in d.parents}
        for path in sorted(folder.rglob("*.py")):
            if any(d in path.parents for d in nested):
                continue  # installed under its own package-dir entry
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join([package, *parts])] = path
    return modules


def read_layers() -> list[tuple[str, list[str]]]:
    """The layer table of docs/architecture.md, lowest first: (label, module patterns)."""
    text = ARCHITECTURE.read_text().split("## Layers", 1)[1].split("\n## ", 1)[0]
    layers = []
    for row in re.findall(r"^\|(.+)\|\s*$", text, re.M):
        cells = [c.strip() for c in row.split("|")]
        if cells[0].isdigit() or cells[0] == COMPILE_SIDE:
            layers.append((cells[0], re.findall(r"`([\w.*]+)`", cells[1])))
    return layers


def layer_of(module: str, layers: list[tuple[str, list[str]]]) -> int | None:
    """Index in `layers` of the most specific pattern covering `module`."""
    best, best_len = None, -1
    for i, (_, patterns) in enumerate(layers):
        for p in patterns:
            base = p[:-2] if p.endswith(".*") else p
            covers = module == base or (p.endswith(".*") and module.startswith(base + "."))
            if covers and len(base) > best_len:
                best, best_len = i, len(base)
    return best


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def module_level_statements(body: list[ast.stmt]):
    """Statements that run at import: not function bodies, not `if TYPE_CHECKING:` bodies."""
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        if isinstance(node, ast.If):
            if not _is_type_checking(node.test):
                yield from module_level_statements(node.body)
            yield from module_level_statements(node.orelse)
        elif isinstance(node, ast.Try):
            for block in (node.body, node.orelse, node.finalbody, *(h.body for h in node.handlers)):
                yield from module_level_statements(block)
        elif isinstance(node, (ast.With, ast.ClassDef)):
            yield from module_level_statements(node.body)
        else:
            yield node


def imports_of(module: str, source: str, is_package: bool, modules, lazy: bool = False) -> set[str]:
    """The package modules (names in `modules`) that `module`, of this source, imports at module level
    (with `lazy`, also inside functions and under TYPE_CHECKING)."""
    out = set()
    tree = ast.parse(source, module)
    for node in (ast.walk(tree) if lazy else module_level_statements(tree.body)):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name in modules)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".") if is_package else module.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module
            for alias in node.names:
                if f"{target}.{alias.name}" in modules:
                    out.add(f"{target}.{alias.name}")
                elif target in modules:
                    out.add(target)
    out.discard(module)
    return out


def import_graph(lazy: bool = False) -> dict[str, set[str]]:
    modules = package_modules()
    return {name: imports_of(name, path.read_text(), path.name == "__init__.py", modules, lazy)
            for name, path in modules.items()}


def without_allowed_lazy_reaches(graph: dict[str, set[str]], layers) -> dict[str, set[str]]:
    """The lazy graph less the two reaches docs/architecture.md allows: the runtime loading the compile
    side on first use, and any module naming the package root `kvbuffer` (its public names)."""
    compile_side = {m for m in graph if (i := layer_of(m, layers)) is not None and layers[i][0] == COMPILE_SIDE}
    return {m: {t for t in targets if t != "kvbuffer" and (t not in compile_side or m in compile_side)}
            for m, targets in graph.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan, iterative)."""
    index, low, on_stack, stack, found = {}, {}, set(), [], []
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
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def layer_violations(graph: dict[str, set[str]], layers: list[tuple[str, list[str]]]) -> list[str]:
    out = []
    for module in sorted(graph):
        mine = layer_of(module, layers)
        for target in sorted(graph[module]):
            theirs = layer_of(target, layers)
            if mine is None or theirs is None or mine == theirs:
                continue  # unplaced modules are reported by their own test
            if layers[theirs][0] == COMPILE_SIDE:
                out.append(f"{module} (layer {layers[mine][0]}) imports the compile side: {target}")
            elif theirs > mine:
                out.append(f"{module} (layer {layers[mine][0]}) imports a higher layer: {target} (layer {layers[theirs][0]})")
    return out


@pytest.fixture(scope="module")
def graph():
    return import_graph()


@pytest.fixture(scope="module")
def layers():
    found = read_layers()
    assert found, f"no layer table under '## Layers' in {ARCHITECTURE}"
    return found


def test_every_module_has_a_layer(graph, layers):
    unplaced = [m for m in sorted(graph) if layer_of(m, layers) is None]
    assert not unplaced, f"modules no row of {ARCHITECTURE.name}'s layer table covers: {unplaced}"


def test_no_import_cycles(graph):
    found = cycles(graph)
    assert not found, "module-level import cycles:\n" + "\n".join(" <-> ".join(c) for c in found)


def test_no_cycles_through_lazy_imports(layers):
    """A lazy import may reach up a layer, but never close a circle: counted with the imports inside
    functions, no two modules need each other (the first-use build reaching the compile side and
    imports of the package root aside)."""
    found = cycles(without_allowed_lazy_reaches(import_graph(lazy=True), layers))
    assert not found, "import cycles through lazy imports:\n" + "\n".join(" <-> ".join(c) for c in found)


def test_imports_follow_the_layer_order(graph, layers):
    found = layer_violations(graph, layers)
    assert not found, "imports against docs/architecture.md's layer order:\n" + "\n".join(found)


def test_the_checker_sees_what_it_must():
    """The rules on a made-up tree: lazy and TYPE_CHECKING imports are free, cycles and reaches up are not."""
    layers = [("1", ["p.low"]), ("2", ["p.mid.*"]), (COMPILE_SIDE, ["p.tiles.*"]), ("3", ["p.high"])]
    source = {
        "p.low": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from p import high\n"
                 "def f():\n    from p import high\n",
        "p.mid.a": "from . import b\n",
        "p.mid.b": "try:\n    from .a import x\nexcept ImportError:\n    pass\n",
        "p.high": "import p.mid.a\nfrom p.tiles import t\nclass C:\n    from p import low\n",
        "p.tiles.t": "from p.mid import a\n",
    }
    graph = {name: imports_of(name, text, False, source) for name, text in source.items()}
    assert graph["p.low"] == set() and graph["p.high"] == {"p.mid.a", "p.tiles.t", "p.low"}
    assert cycles(graph) == [["p.mid.a", "p.mid.b"]]
    assert layer_violations(graph, layers) == ["p.high (layer 3) imports the compile side: p.tiles.t"]

