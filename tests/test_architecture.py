"""The package's shape, checked: no import cycles (the layers themselves are import-linter's
`layers` contract in pyproject.toml, run by `lint-imports`).

The import graph is grimp's, the one import-linter checks: every `import` in a module counts,
those inside functions and under `TYPE_CHECKING` too, since a cycle hidden in a function is a
cycle all the same (it only fails later, at the first call).
"""

from __future__ import annotations

import itertools

import grimp

PACKAGE = "replay_audit"


def _import_graph() -> grimp.ImportGraph:
    return grimp.build_graph(PACKAGE, cache_dir=None)


def strongly_connected(graph: grimp.ImportGraph) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm,
    iterative): the modules of each import cycle."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []
    for root in sorted(graph.modules):
        if root in index:
            continue
        work: list[tuple[str, list[str]]] = []
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        work.append((root, sorted(graph.find_modules_directly_imported_by(root))))
        while work:
            node, todo = work[-1]
            if todo:
                nxt = todo.pop()
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, sorted(graph.find_modules_directly_imported_by(nxt))))
                elif nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
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
    return components


def describe_cycle(graph: grimp.ImportGraph, component: list[str]) -> str:
    """One cycle through the component, each import with its line: `a (l.3) -> b (l.9) -> a`."""
    members = set(component)
    start = component[0]
    first = sorted(graph.find_modules_directly_imported_by(start) & members)[0]
    back = graph.find_shortest_chain(importer=first, imported=start)
    assert back is not None  # same component: a path back exists
    chain = [start, *back]
    steps = []
    for importer, imported in itertools.pairwise(chain):
        lines = sorted(
            d["line_number"] for d in graph.get_import_details(importer=importer, imported=imported)
        )
        steps.append(f"{importer} (l.{','.join(map(str, lines))})")
    return " -> ".join([*steps, start])


def test_no_import_cycles() -> None:
    graph = _import_graph()
    cycles = [describe_cycle(graph, c) for c in strongly_connected(graph)]
    assert not cycles, "import cycles in replay_audit:\n" + "\n".join(cycles)


def test_the_cycle_check_sees_a_cycle() -> None:
    """The check itself: a graph with a cycle (and one without) is told apart, and the message
    names every module of the cycle."""
    graph = grimp.ImportGraph()
    for module in ("p", "p.a", "p.b", "p.c", "p.d"):
        graph.add_module(module)
    graph.add_import(importer="p.a", imported="p.b", line_number=3, line_contents="import p.b")
    graph.add_import(importer="p.b", imported="p.c", line_number=4, line_contents="import p.c")
    graph.add_import(importer="p.c", imported="p.d", line_number=5, line_contents="import p.d")
    assert strongly_connected(graph) == []
    graph.add_import(importer="p.c", imported="p.a", line_number=9, line_contents="import p.a")
    [component] = strongly_connected(graph)
    assert component == ["p.a", "p.b", "p.c"]
    assert describe_cycle(graph, component) == "p.a (l.3) -> p.b (l.4) -> p.c (l.9) -> p.a"
