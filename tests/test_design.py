"""The design pages stay true: every constant they quote as `NAME = <number>` has that value in the
code, and every layout version they state (`(shm/layout.py, version 5)`) is the module's `VERSION`.

The pages are docs/design.md (the map) and docs/design/*.md (one page per mechanism)."""

import ast
import glob
import importlib
import os
import re

import pytest

import shmlimit

# run once in CI: the design pages against the code: no segment
pytestmark = pytest.mark.backend_independent

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGES = [os.path.join(ROOT, "docs", "design.md")] + sorted(
    glob.glob(os.path.join(ROOT, "docs", "design", "*.md"))
)
DESIGN = "\n".join(open(p).read() for p in PAGES)
QUOTED = re.findall(r"`([A-Z][A-Z0-9_]+) = ([0-9][0-9_.eE+-]*)`", DESIGN)
PACKAGE = os.path.dirname(shmlimit.__file__)


def module_constants():
    """NAME -> value for every module-level ``NAME = <literal>`` in the package."""
    found = {}
    paths = [os.path.join(d, f) for d, _, fs in os.walk(PACKAGE) for f in fs if f.endswith(".py")]
    for path in sorted(paths):
        for node in ast.parse(open(path).read()).body:
            if (
                isinstance(node, ast.Assign)
                and len(node.targets) == 1
                and isinstance(node.targets[0], ast.Name)
            ):
                try:
                    found.setdefault(node.targets[0].id, []).append(ast.literal_eval(node.value))
                except ValueError:
                    pass
    return found


def test_the_design_quotes_constants():
    assert len(QUOTED) >= 4


@pytest.mark.parametrize("const, value", QUOTED)
def test_every_quoted_constant_matches_the_code(const, value):
    values = module_constants().get(const)
    assert values, f"the design pages quote {const}, which no module defines"
    assert ast.literal_eval(value) in values, (
        f"the design pages say {const} = {value}; the code says {values}"
    )


#: "(shm/layout.py, version 5)": a section that states a module's layout version
STATED_VERSIONS = re.findall(r"\(([\w/]+)\.py, version (\d+)\)", DESIGN)


def test_the_design_states_both_layout_versions():
    assert {m for m, _ in STATED_VERSIONS} >= {"shm/layout", "keyed/layout"}, STATED_VERSIONS


@pytest.mark.parametrize("module, version", STATED_VERSIONS)
def test_every_stated_layout_version_matches_the_code(module, version):
    code = importlib.import_module("shmlimit." + module.replace("/", ".")).VERSION
    assert int(version) == code, (
        f"the design pages say {module}.py is version {version}; the code says {code}"
    )
