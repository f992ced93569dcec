"""The package's shape: import-linter's layer contracts (pyproject.toml) hold, and no two modules import each
other, directly or through others."""
from pathlib import Path

import grimp
from importlinter import cli as importlinter_cli

ROOT = Path(__file__).resolve().parents[2]


def test_import_linter_contracts_are_kept():
    assert importlinter_cli.lint_imports(config_filename=str(ROOT / "pyproject.toml"), no_cache=True) == 0


def import_cycles(package: str = "servelab") -> list[list[str]]:
    """Strongly connected components of more than one module in the package's import graph (Tarjan)."""
    graph = grimp.build_graph(package)
    modules = sorted(graph.modules)
    edges = {m: sorted(graph.find_modules_directly_imported_by(m)) for m in modules}
    index, low, on_stack, stack, components = {}, {}, set(), [], []

    def visit(module: str) -> None:
        work = [(module, iter(edges[module]))]
        index[module] = low[module] = len(index)
        stack.append(module)
        on_stack.add(module)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(edges[child])))
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
                    components.append(sorted(component))

    for module in modules:
        if module not in index:
            visit(module)
    return components


def test_no_import_cycles():
    assert import_cycles() == []


def test_the_cycle_finder_finds_a_cycle(tmp_path, monkeypatch):
    package = tmp_path / "circular"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("from circular import b\n")
    (package / "b.py").write_text("from circular import c\n")
    (package / "c.py").write_text("import circular.a\n")
    (package / "d.py").write_text("import circular.a\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert import_cycles("circular") == [["circular.a", "circular.b", "circular.c"]]
