"""The package's import graph has no cycles, counting imports inside
functions too (a lazy import is still a dependency)."""
import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "commlib"


def import_graph():
    """{module: modules of commlib it imports}, package __init__ files aside
    (they re-export, and everything imports through them)."""
    modules = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level:
                base = package.split(".")[:len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
                found |= ({target + "." + a.name for a in node.names} if node.module is None
                          else {target})
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("commlib"):
                found.add(node.module)
        modules[name] = found

    def known(name):
        while name not in modules and "." in name:
            name = name.rsplit(".", 1)[0]
        return name

    packages = {m for m in modules if (PACKAGE.parent / m.replace(".", "/")).is_dir()}
    return {m: {known(d) for d in deps} - {m} - packages for m, deps in modules.items()}


def find_cycle(graph):
    done, path = set(), []

    def visit(m):
        if m in path:
            return path[path.index(m):] + [m]
        if m in done:
            return None
        path.append(m)
        for d in sorted(graph.get(m, ())):
            cycle = visit(d)
            if cycle:
                return cycle
        path.pop()
        done.add(m)
        return None

    for m in sorted(graph):
        cycle = visit(m)
        if cycle:
            return cycle
    return None


def test_no_import_cycles():
    graph = import_graph()
    assert "commlib.transport.mpi" in graph and graph["commlib.communicator"], graph
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph))


def test_cycle_finder_finds_a_planted_cycle():
    graph = import_graph()
    assert "commlib.transport.base" in graph["commlib.transport.shm"]
    graph["commlib.transport.base"] = graph["commlib.transport.base"] | {"commlib.transport.shm"}
    assert find_cycle(graph) is not None
