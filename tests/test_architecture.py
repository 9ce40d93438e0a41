"""The package's layering holds: import-linter's contracts pass and no module imports itself round a cycle.

The contracts live in pyproject.toml ([tool.importlinter]): gpunode.node and
gpunode.cluster never import each other; the shared layer (contract, config,
placement, infra, errors) imports neither side; placement imports nothing of
config or infra; config imports nothing above it; errors imports nothing of
gpunode. Both checks are also shown to fail on a package that breaks them.

Imports made only for the type checker (under `if TYPE_CHECKING:`) never execute,
so they cannot break start-up, but they tie modules together for a reader just the
same: the run-time check alone let the scheduling cycle's modules (engine, admit,
rooms, preempt, reasons, ...) and capacity/nodeview import each other round a
circle. A second check counts them too, for every package that is free of such
cycles (KNOWN_TYPED_CYCLES lists the rest, to be shortened, never lengthened).
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path

import grimp
import pytest

ROOT = Path(__file__).resolve().parents[1]
LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")


def import_cycles(graph: Mapping[str, Iterable[str]]) -> list[list[str]]:
    """Every strongly connected group of more than one module (or a module importing itself), sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    groups: list[list[str]] = []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work: list[tuple[str, list[str]]] = [(root, sorted(graph.get(root, ())))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, todo = work[-1]
            if todo:
                nxt = todo.pop()
                if nxt not in index:
                    index[nxt] = low[nxt] = counter
                    counter += 1
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, sorted(graph.get(nxt, ()))))
                elif nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                group = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    group.append(member)
                    if member == node:
                        break
                if len(group) > 1 or node in graph.get(node, ()):
                    groups.append(sorted(group))
    return sorted(groups)


# Cycles that go through TYPE_CHECKING imports only, outside the packages this file keeps free of them.
KNOWN_TYPED_CYCLES = [
    ["gpunode.infra.http", "gpunode.infra.httpconn"],
    ["gpunode.infra.kube.client", "gpunode.infra.kube.watch"],
]


def gpunode_graph(*, type_checking: bool = False) -> dict[str, set[str]]:
    """Module -> the gpunode modules it imports at run time (function-level imports included); with
    type_checking, the imports made only for the type checker too."""
    graph = grimp.build_graph("gpunode", exclude_type_checking_imports=not type_checking, cache_dir=None)
    return {m: set(graph.find_modules_directly_imported_by(m)) for m in graph.modules}


def _lint(cwd: Path, extra_path: Path | None = None) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    if extra_path is not None:
        env["PYTHONPATH"] = f"{extra_path}{os.pathsep}{env.get('PYTHONPATH', '')}"
    return subprocess.run(
        [str(LINT_IMPORTS), "--no-cache"], cwd=cwd, env=env, capture_output=True, text=True, timeout=120
    )


def test_import_contracts_are_kept() -> None:
    result = _lint(ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 broken" in result.stdout


def test_no_module_takes_part_in_an_import_cycle() -> None:
    assert import_cycles(gpunode_graph()) == []


def test_no_module_takes_part_in_a_cycle_of_typed_imports() -> None:
    # The run-time graph above leaves out `if TYPE_CHECKING:` imports (grimp's
    # exclude_type_checking_imports); this one counts them.
    assert import_cycles(gpunode_graph(type_checking=True)) == KNOWN_TYPED_CYCLES


def test_the_typed_graph_holds_type_checking_imports() -> None:
    # admit.py imports these only for annotations: the typed graph has the edges, the run-time one not.
    typed, run = gpunode_graph(type_checking=True), gpunode_graph()
    admit, quotas = "gpunode.cluster.queueing.admit", "gpunode.cluster.queueing.quotas"
    assert quotas in typed[admit]
    assert quotas not in run[admit]


def test_a_cycle_through_type_checking_imports_is_caught(tmp_path: Path) -> None:
    pkg = tmp_path / "cyc"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "engine.py").write_text("from cyc import step\n")
    (pkg / "step.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from cyc.engine import X\n"
    )
    sys.path.insert(0, str(tmp_path))
    try:
        for exclude, cycles in ((True, []), (False, [["cyc.engine", "cyc.step"]])):
            g = grimp.build_graph("cyc", exclude_type_checking_imports=exclude, cache_dir=None)
            graph = {m: set(g.find_modules_directly_imported_by(m)) for m in g.modules}
            assert import_cycles(graph) == cycles
    finally:
        sys.path.remove(str(tmp_path))
        for name in [m for m in sys.modules if m == "cyc" or m.startswith("cyc.")]:
            del sys.modules[name]


def test_the_cycle_finder_finds_cycles() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"d"}, "e": {"a"}, "f": set()}
    assert import_cycles(graph) == [["a", "b", "c"], ["d"]]
    assert import_cycles({"x": {"y"}, "y": set()}) == []


def test_the_contracts_catch_a_node_module_importing_the_cluster(tmp_path: Path) -> None:
    pkg = tmp_path / "gpunode"
    for sub in ("node", "cluster", "contract", "config", "placement", "infra"):
        (pkg / sub).mkdir(parents=True)
        (pkg / sub / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "errors.py").write_text("")
    (pkg / "cli.py").write_text("")
    (pkg / "node" / "agent.py").write_text("import gpunode.cluster.extender\n")
    (pkg / "cluster" / "extender.py").write_text("")
    (pkg / "placement" / "fit.py").write_text("from gpunode.config import reader\n")
    (pkg / "config" / "reader.py").write_text("")
    start = (ROOT / "pyproject.toml").read_text().index("[tool.importlinter]")
    (tmp_path / "pyproject.toml").write_text((ROOT / "pyproject.toml").read_text()[start:])
    result = _lint(tmp_path, extra_path=tmp_path)
    assert result.returncode != 0
    assert "node and cluster are independent BROKEN" in result.stdout
    assert "placement imports nothing but the contract and errors BROKEN" in result.stdout


@pytest.mark.parametrize("package", ["gpunode.node", "gpunode.cluster"])
def test_each_side_has_code_in_it(package: str) -> None:
    # The independence contract would hold trivially if a side were empty.
    assert sum(1 for m in gpunode_graph() if m.startswith(package + ".")) >= 10
