"""docs/performance.md and its plots are what tools/perf_page.py makes of the committed run,
docs/img/bench.json (the output of ``tools/bench.py --json``): the page cannot drift from the run
whose figures it shows, and a run missing a section is refused, naming the key."""

import copy
import importlib.util
import json
import os
import re

import pytest

# run once in CI: a docs page against a committed run: no segment
pytestmark = pytest.mark.backend_independent

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = os.path.join(ROOT, "docs")
RUN = os.path.join(DOCS, "img", "bench.json")
MADE = ["performance.md", "img/perf-cost.svg", "img/perf-waiting.svg"]


@pytest.fixture(scope="module")
def perf_page():
    spec = importlib.util.spec_from_file_location(
        "perf_page", os.path.join(ROOT, "tools", "perf_page.py")
    )
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def run():
    with open(RUN) as f:
        return json.load(f)


def _read(path):
    with open(path, encoding="utf-8") as f:
        return f.read()


def test_the_committed_page_and_plots_are_made_from_the_committed_run(perf_page, tmp_path):
    assert perf_page.main([RUN, "--docs", str(tmp_path)]) == 0
    made = sorted(
        os.path.relpath(os.path.join(d, f), tmp_path) for d, _, fs in os.walk(tmp_path) for f in fs
    )
    assert made == sorted(MADE)
    for rel in MADE:
        assert _read(tmp_path / rel) == _read(os.path.join(DOCS, rel)), (
            f"docs/{rel} is not what tools/perf_page.py makes of docs/img/bench.json: "
            "run `python tools/perf_page.py`"
        )


def test_the_page_shows_its_plots_and_links_its_run():
    page = _read(os.path.join(DOCS, "performance.md"))
    for target in ["img/perf-cost.svg", "img/perf-waiting.svg", "img/bench.json"]:
        assert f"]({target})" in page
    assert "python tools/bench.py --json > docs/img/bench.json" in page
    assert "python tools/perf_page.py" in page


def test_a_figure_of_the_run_is_on_the_page_as_a_ratio(perf_page, run):
    single = run["single_ns"]
    x = single["shmlimit acquire (native)"] / single["floor: native fetch_add"]
    row = f"| acquire() granted (native) | {perf_page.ns(single['shmlimit acquire (native)'])} | "
    page = perf_page.render(run)["performance.md"]
    assert row + perf_page.ratio(x) + " |" in page
    changed = copy.deepcopy(run)
    changed["single_ns"]["shmlimit acquire (native)"] *= 2
    assert perf_page.render(changed)["performance.md"] != page


@pytest.mark.parametrize(
    "key", ["fidelity", "keyed", "machine.load_end", "machine.cpus", "asyncio.turns"]
)
def test_a_run_missing_a_section_is_refused_naming_the_key(perf_page, run, key, tmp_path, capsys):
    broken = copy.deepcopy(run)
    *parents, last = key.split(".")
    node = broken
    for p in parents:
        node = node[p]
    del node[last]
    with pytest.raises(perf_page.RunError, match=re.escape(repr(key))):
        perf_page.render(broken)
    path = tmp_path / "run.json"
    path.write_text(json.dumps(broken))
    assert perf_page.main([str(path), "--docs", str(tmp_path / "docs")]) == 2
    assert repr(key) in capsys.readouterr().err
    assert not (tmp_path / "docs").exists()  # nothing half-written


def test_an_only_section_run_is_refused(perf_page, run):
    part = {"machine": run["machine"], "waiting": run["waiting"]}
    with pytest.raises(perf_page.RunError, match="'single_ns'"):
        perf_page.render(part)


def test_a_file_that_is_not_json_is_refused(perf_page, tmp_path, capsys):
    path = tmp_path / "run.json"
    path.write_text("shmlimit benchmark — Python 3.11 (the table, not --json)\n")
    assert perf_page.main([str(path), "--docs", str(tmp_path / "docs")]) == 2
    assert "not the JSON of tools/bench.py --json" in capsys.readouterr().err
    assert not (tmp_path / "docs").exists()


def _section(page, title):
    """The text under the page's heading that starts with ``title`` (the heading left out)."""
    return page.split(f"\n## {title}", 1)[1].split("\n", 1)[1].split("\n## ", 1)[0]


def test_limits_hits_on_shm_are_on_the_page_as_ratios_to_memory(perf_page, run):
    hits = run["limits_hits"]["ns_per_hit"]

    def row(r):
        x = perf_page.ratio(r["fixed window"]["shm"] / r["fixed window"]["memory"])
        mem, shm = (perf_page.ns(r["fixed window"][k]) for k in ("memory", "shm"))
        return f"| fixed window | {mem} | {shm} | {x} | at most 1.5 |"

    page = perf_page.render(run)["performance.md"]
    assert row(hits) in _section(page, "`limits` on shared memory")
    changed = copy.deepcopy(run)
    changed["limits_hits"]["ns_per_hit"]["fixed window"]["shm"] *= 2
    other = perf_page.render(changed)["performance.md"]
    assert row(changed["limits_hits"]["ns_per_hit"]) in other and row(hits) not in other
    agg = run["limits_hits"]["aggregate_per_s"]["sliding window counter"]
    cells = " | ".join(perf_page.count(agg[k]) for k in ("shm", "memory", "redis"))
    assert f"| sliding window counter | {cells} |" in page


def test_the_hierarchical_cpu_and_the_keyed_atomics_ratio_are_on_the_page(perf_page, run):
    page = perf_page.render(run)["performance.md"]
    tree = perf_page.ratio(run["hierarchy_cpu"]["tree_ratio"])
    assert f"burned {tree} times the local runs' (the target: at most 1.5)" in page
    atomics = run["keyed"]["atomics"]
    x = atomics["keyed try_acquire, live key (granted)"] / atomics["Limiter.try_acquire (granted)"]
    sentence = f"costs {perf_page.ratio(x)} times this backend's `Limiter.try_acquire`"
    assert sentence + " (the target: at most 5)" in page
    changed = copy.deepcopy(run)
    changed["hierarchy_cpu"]["tree_ratio"] *= 2
    changed["keyed"]["atomics"]["keyed try_acquire, live key (granted)"] *= 2
    other = perf_page.render(changed)["performance.md"]
    assert f"burned {tree} times" not in other and sentence not in other


@pytest.mark.parametrize(
    "key, title, absent",
    [
        ("limits_hits", "`limits` on shared memory", "`limits` is not installed"),
        ("hierarchy_cpu", "The hierarchical mode's CPU", "no `redis-server` on the PATH"),
    ],
)
def test_a_run_without_an_optional_section_says_so(perf_page, run, key, title, absent):
    assert key in run and run[key]  # the committed run measured it
    older = copy.deepcopy(run)
    del older[key]
    section = _section(perf_page.render(older)["performance.md"], title)
    assert section.strip() == perf_page.NOT_MEASURED.format(key=key)
    skipped = copy.deepcopy(run)
    skipped[key] = None  # the run could not measure it
    assert absent in _section(perf_page.render(skipped)["performance.md"], title)
    assert "Not measured" not in _section(perf_page.render(run)["performance.md"], title)
