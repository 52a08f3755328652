"""The package's import graph has no cycles, counting imports inside
functions too (a lazy import is still a dependency), neither between modules
nor between packages; packages import downward only, in the layers of
docs/layout.md; no module imports a private module or name of another
package, or uses a private member of another module's class."""
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
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("commlib"):
                target = node.module
            else:
                continue
            # ``from package import module`` depends on the module; ``from
            # module import name`` on the module (``known`` maps it back)
            found |= {target} | {target + "." + a.name for a in node.names}
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


# -- packages import downward only ----------------------------------------------------

#: commlib's packages and root modules, bottom layer first (docs/layout.md);
#: a package may import its own layer and the layers below it
LAYERS = [
    ("errors", "settings", "files", "trace_files", "trace", "core"),
    ("ops", "interop"),
    ("progress", "faults"),
    ("transport",),
    ("compression",),
    ("collective",),
    ("startup",),
    ("communicator", "overlap"),
    ("optim", "launch", "info", "commlib"),
]


def package_of(module):
    """``commlib.collective.session`` -> ``collective``; ``commlib.errors``
    -> ``errors``; ``commlib`` (its __init__) -> ``commlib``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def package_graph(graph):
    """{package: packages it imports} of a module graph (see import_graph)."""
    found = {}
    for module, deps in graph.items():
        mine = package_of(module)
        found.setdefault(mine, set()).update(package_of(d) for d in deps)
        found[mine].discard(mine)
    return found


def upward_imports(packages):
    """``[(importer, imported)]`` of the package graph ``packages`` where the
    imported package lies in a higher layer of :data:`LAYERS` (or in none)."""
    layer = {name: i for i, names in enumerate(LAYERS) for name in names}
    return sorted((a, b) for a, deps in packages.items() for b in deps
                  if layer.get(b, len(LAYERS)) > layer.get(a, -1))


def test_no_package_imports_a_package_that_imports_it():
    packages = package_graph(import_graph())
    assert {"core", "collective", "transport", "communicator"} <= set(packages)
    assert find_cycle(packages) is None, " -> ".join(find_cycle(packages))


def test_packages_import_downward_only():
    packages = package_graph(import_graph())
    layered = {name for names in LAYERS for name in names}
    assert set(packages) <= layered, "not in LAYERS: %s" % sorted(set(packages) - layered)
    assert upward_imports(packages) == []


def test_the_package_checks_find_planted_upward_imports_and_cycles():
    packages = package_graph(import_graph())
    assert "transport" in packages["startup"]
    packages["transport"] = packages["transport"] | {"collective"}
    assert upward_imports(packages) == [("transport", "collective")]
    packages["collective"] = packages["collective"] | {"transport"}
    assert find_cycle(packages) is not None


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
