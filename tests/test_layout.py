"""How the code is laid out, checked: gradscale/ reads bottom-up (no import cycle, function-level imports
included), the loop never builds and finding weights never trains, and the metric keys are named in one place."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from tests.conftest import ROOT

PACKAGE = ROOT / "gradscale"


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """Module -> the gradscale modules it imports anywhere in its file (top level, in functions, under
    TYPE_CHECKING): `from gradscale import data` counts as gradscale.data."""
    files = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph = {}
    for name, path in files.items():
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                deps |= {a.name for a in node.names if a.name in files}
            elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("gradscale"):
                base = node.module
                found = {f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in files}
                deps |= found or ({base} if base in files else set())
        graph[name] = deps - {name}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, str] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = "open"
        stack.append(node)
        for dep in sorted(graph.get(node, ())):
            if state.get(dep) == "open":
                return stack[stack.index(dep):] + [dep]
            if dep not in state and (cycle := visit(dep)):
                return cycle
        state[node] = "done"
        stack.pop()
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for dep in graph[todo.pop()]:
            if dep not in seen:
                seen.add(dep)
                todo.append(dep)
    return seen


def test_the_cycle_finder_finds_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_gradscale_has_no_import_cycle():
    graph = import_graph()
    assert "gradscale.optimizers.muon" in graph and "gradscale.train" in graph["gradscale.job"]
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph))


def test_the_loop_never_builds_and_finding_weights_never_trains():
    graph = import_graph()
    assert not reachable(graph, "gradscale.train") & {"gradscale.job", "gradscale.run", "gradscale.pretrain"}
    assert not reachable(graph, "gradscale.weights") & {"gradscale.train", "gradscale.job",
                                                          "gradscale.pretrain"}
    leaves = ("gradscale.checks", "gradscale.cache", "gradscale.records")
    assert all(not graph[leaf] for leaf in leaves)


def test_the_training_side_never_imports_the_reading_side():
    """gradscale.analysis reads run folders; nothing that trains, audits or advises imports it (the advisor's
    command runs its reading in a process of its own)."""
    graph = import_graph()
    reading = {m for m in graph if m.startswith("gradscale.analysis")}
    assert "gradscale.analysis.report" in reading and "gradscale.advise" in graph
    crossings = sorted(f"{m} -> {d}" for m in graph if m not in reading for d in graph[m] & reading)
    assert crossings == []


def test_the_reading_side_imports_neither_torch_nor_hydra():
    """Every module of gradscale.analysis, imported together (python -X importtime lists what that loads): the
    theory, the metric keys, the buckets, the registries and the run folders it reads come from torch-free,
    Hydra-free modules both sides share."""
    import subprocess
    import sys

    modules = sorted(m for m in import_graph() if m.startswith("gradscale.analysis") and ".notebooks." not in m)
    proc = subprocess.run([sys.executable, "-X", "importtime", "-c", f"import {', '.join(modules)}"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    loaded = {line.rsplit("|", 1)[1].strip() for line in proc.stderr.splitlines() if line.startswith("import time:")}
    assert "gradscale.analysis.report" in loaded and "pandas" in loaded  # the list is real
    assert sorted(m for m in loaded if m.split(".")[0] in ("torch", "hydra")) == []


METRIC_KEY = re.compile(r"^(train|eval|adam|perf)/\w*$")  # a key, not prose that starts with one


def test_metric_keys_are_named_only_in_records():
    """A bare "train/loss" in the loop, a plot or the dashboard is how a typo drops a panel unnoticed: every
    string (or f-string) that starts like a metric key lives in gradscale/records.py."""
    found = []
    for path in PACKAGE.rglob("*.py"):
        if path.name == "records.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.JoinedStr):
                node = node.values[0] if node.values else node
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and METRIC_KEY.match(node.value):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {node.value!r}")
    assert found == []
