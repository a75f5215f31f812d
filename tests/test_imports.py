"""The layout shows the design: imports between shmlimit's modules go one way, lazy ones included.

Every ``import`` statement of the package is read (at any depth: a function-level import is
an edge too), and the graph must have no cycle.  The shared-memory core never imports the
Redis tier, the design page's map lists every module with the modules it imports, and no
module is longer than a reader can hold (``MAX_LINES``; the ``Limiter`` facade, ``FACADE_LINES``).
"""

import ast
import os
import re

import pytest

# run once in CI: the import graph, read from the source: no segment
pytestmark = pytest.mark.backend_independent

# the source tree beside this test file (the installed copy has no docs/ beside it)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = os.path.join(ROOT, "shmlimit")
DESIGN = open(os.path.join(ROOT, "docs", "design.md")).read()

#: The shared-memory core (these subpackages, and the modules named): never imports the Redis tier.
CORE_PACKAGES = ("shm", "bucket")
CORE_MODULES = {"config", "errors"}
REDIS_TIER = "redis"
#: The package's top shows its layers: a few modules, the rest in subpackages.
MAX_TOP_MODULES = 20
#: the C extension, by dotted name ("shm._native"): below the atomic layer, not a module here
EXTENSIONS = {
    os.path.relpath(os.path.join(d, f), PACKAGE).split(".")[0].replace(os.sep, ".")
    for d, _, files in os.walk(PACKAGE)
    for f in files
    if f.endswith((".c", ".so"))
}


def modules():
    """Every module of the package, by dotted name relative to it ("integrations.asgi")."""
    out = {}
    for dirpath, _, files in os.walk(PACKAGE):
        for f in files:
            if f.endswith(".py"):
                rel = os.path.relpath(os.path.join(dirpath, f), PACKAGE)[:-3].replace(os.sep, ".")
                out[rel[: -len(".__init__")] if rel.endswith(".__init__") else rel] = os.path.join(
                    dirpath, f
                )
    return out


def imports_of(name, path, known):
    """The package modules ``name`` imports (at module level or inside functions; "__init__" is the package)."""
    pkg = name.rsplit(".", 1)[0] if "." in name else ""
    if path.endswith("__init__.py"):
        pkg = name if name != "__init__" else ""
    found = set()

    def add(target, names):
        for (
            alias
        ) in names:  # ``from target import alias``: a module of its own, or a name of target
            sub = f"{target}.{alias}".lstrip(".")
            if (
                sub not in EXTENSIONS
            ):  # the C extension is below the atomic layer, not a module here
                found.add(sub if sub in known else (target or "__init__"))

    for node in ast.walk(ast.parse(open(path).read())):
        if isinstance(node, ast.ImportFrom) and node.level:
            base = pkg.split(".") if pkg else []
            base = base[: len(base) - (node.level - 1)] if node.level > 1 else base
            add(
                ".".join(base + ([node.module] if node.module else [])),
                [a.name for a in node.names],
            )
        elif (
            isinstance(node, ast.ImportFrom)
            and node.module
            and node.module.split(".")[0] == "shmlimit"
        ):
            add(node.module[len("shmlimit.") :], [a.name for a in node.names])
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == "shmlimit":
                    found.add(a.name[len("shmlimit.") :] or "__init__")
    found.discard(name)
    return {m for m in found if m in known}


def graph():
    mods = modules()
    return {m: imports_of(m, p, mods) for m, p in mods.items()}


def test_no_import_cycles_lazy_ones_included():
    g = graph()
    state = {}

    def visit(m, path):
        if state.get(m) == "done":
            return
        assert state.get(m) != "open", "import cycle: " + " -> ".join(path[path.index(m) :] + [m])
        state[m] = "open"
        for d in sorted(g.get(m, ())):
            visit(d, path + [m])
        state[m] = "done"

    for m in sorted(g):
        visit(m, [])


def in_package(module, package):
    return module == package or module.startswith(package + ".")


def test_the_shared_memory_core_never_imports_the_redis_tier():
    g = graph()
    core = [m for m in g if m in CORE_MODULES or any(in_package(m, p) for p in CORE_PACKAGES)]
    assert len(core) > 10, core
    for m in core:
        redis = {d for d in g[m] if in_package(d, REDIS_TIER)}
        assert not redis, f"{m} imports the Redis tier: {sorted(redis)}"


def design_map():
    """The design page's map, its first section: rows "| `module` | concept | `dep`, `dep` |"."""
    first = DESIGN.split("\n## ")[1]
    assert first.startswith("The map"), "the design page's first section is the map of the modules"
    out = {}
    for line in first.splitlines():
        m = re.match(r"\|\s*`([a-z_.]+)`\s*\|.*\|\s*(.*?)\s*\|\s*$", line)
        if m:
            out[m.group(1)] = set(re.findall(r"`([a-z_.]+)`", m.group(2)))
    return out


def test_the_design_page_maps_every_module_and_its_imports():
    g = {
        ("shmlimit" if m == "__init__" else m): {"shmlimit" if d == "__init__" else d for d in deps}
        for m, deps in graph().items()
    }
    shown = design_map()
    assert set(shown) == set(g), (
        f"missing from the map: {set(g) - set(shown)}; not modules: {set(shown) - set(g)}"
    )
    for m, deps in g.items():
        assert shown[m] == deps, (
            f"design.md says {m} imports {sorted(shown[m])}; it imports {sorted(deps)}"
        )


def test_the_top_of_the_package_shows_its_layers():
    """Subpackages, not prefixes: a few modules at the top, the layers below them."""
    top = [m for m, p in modules().items() if "." not in m and not p.endswith("__init__.py")]
    assert len(top) <= MAX_TOP_MODULES, sorted(top)
    packages = {m.split(".")[0] for m in modules() if "." in m} - {"integrations"}
    assert len(packages) >= 3, packages
    for p in packages:
        assert os.path.exists(os.path.join(PACKAGE, p, "__init__.py")), p
