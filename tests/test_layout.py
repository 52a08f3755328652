"""The package's import graph has no cycles, counting imports inside
functions too (a lazy import is still a dependency); no module imports a
private module or name of another package, or uses a private member of
another module's class."""
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


# -- private names stay in their module (or package) ------------------------------------

#: private attributes that belong to no commlib class: the standard library's
ALLOWED_PRIVATE = {"_exit", "_asdict", "_replace", "_fields", "_make"}
#: private modules imported across packages on purpose: the compiled
#: extension, loaded only by its loader (commlib.ops.native)
ALLOWED_PRIVATE_MODULES = {("commlib.ops.native", "commlib._hostloops")}


def _modules():
    """(module name, package name, syntax tree) of every commlib module."""
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        yield name, package, ast.parse(path.read_text())


def private_imports_across_packages(modules):
    """[(importer, private module or name)] of imports of a private module or
    name (one leading underscore) that belongs to another package."""
    found = []
    for name, package, tree in modules:
        for node in ast.walk(tree):
            if not isinstance(node, ast.ImportFrom):
                continue
            if node.level:
                base = package.split(".")[:len(package.split(".")) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            elif (node.module or "").startswith("commlib"):
                source = node.module
            else:
                continue
            targets = [source + "." + a.name for a in node.names]
            for target in [source] + targets:
                parts = target.split(".")
                private = [i for i, p in enumerate(parts) if p.startswith("_")
                           and not p.startswith("__")]
                if not private:
                    continue
                owner = ".".join(parts[:private[0]])       # the package it belongs to
                if owner != package and (name, target) not in ALLOWED_PRIVATE_MODULES:
                    found.append((name, target))
    return found


def private_members_of_other_modules(modules):
    """[(module, line, text)] of ``obj._member`` where ``obj`` is not
    ``self``/``cls`` and ``_member`` is defined nowhere in that module: a
    private member of another module's class or module."""
    found = []
    for name, _, tree in modules:
        own = set()
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                own.add(node.name)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                own.add(node.attr)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                own.add(node.id)
            elif isinstance(node, ast.alias):
                own.add((node.asname or node.name).split(".")[0])
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                own.add(node.value)                      # __slots__ entries
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and node.attr.startswith("_")
                    and not node.attr.startswith("__") and node.attr not in own
                    and node.attr not in ALLOWED_PRIVATE
                    and not (isinstance(node.value, ast.Name)
                             and node.value.id in ("self", "cls"))):
                found.append((name, node.lineno, ast.unparse(node)))
    return found


def test_no_private_import_across_packages():
    assert private_imports_across_packages(list(_modules())) == []


def test_no_private_member_of_another_module():
    assert private_members_of_other_modules(list(_modules())) == []


def test_the_private_checks_find_planted_reaches():
    planted = ast.parse("from ..ops._arrays import is_cupy\n"
                        "from commlib.collective.bucketing import _span\n"
                        "def f(comm):\n    return comm._transport('numpy')\n")
    modules = [("commlib.optim.planted", "commlib.optim", planted)]
    assert sorted(t for _, t in private_imports_across_packages(modules)) == \
        ["commlib.collective.bucketing._span", "commlib.ops._arrays", "commlib.ops._arrays.is_cupy"]
    assert [t for _, _, t in private_members_of_other_modules(modules)] == \
        ["comm._transport"]
