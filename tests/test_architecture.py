"""The package's layering holds: import-linter's contracts pass and no module imports itself round a cycle.

The contracts live in pyproject.toml ([tool.importlinter]): gpunode.node and
gpunode.cluster never import each other; the shared layer (contract, config,
placement, infra, errors) imports neither side; placement imports nothing of
config or infra; config imports nothing above it; errors imports nothing of
gpunode. Both checks are also shown to fail on a package that breaks them.
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


def gpunode_graph() -> dict[str, set[str]]:
    """Module -> the gpunode modules it imports at run time (function-level imports included; imports
    made only for the type checker are left out, as they never execute)."""
    graph = grimp.build_graph("gpunode", exclude_type_checking_imports=True, cache_dir=None)
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
