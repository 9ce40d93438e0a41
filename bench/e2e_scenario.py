"""The end-to-end scenario of tests/e2e/test_scenario.py, run standalone. Prints JSON.

    .venv/bin/python bench/e2e_scenario.py [--workdir DIR]

Starts the test cluster (etcd, kube-apiserver, kube-controller-manager, kube-scheduler: Kubernetes 1.36
as scripts/get-kube.sh builds it, or the version GPUNODE_KUBE_VERSION names), the extender, four
simulated-agent nodes and the real-kubelet node, runs tests.e2e.scenario and prints its figures:
agreement rate (and each disagreeing pod), over-commit samples, the error lines' count, wall time, max concurrent binds, and filter/prioritize/bind p99 as the
extender's access log measured them for kube-scheduler's requests. Needs helm (scripts/get-helm.sh).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.e2e import scenario, scenario_figures
from tests.e2e.conftest import E2E_USERS
from tests.e2e.controlplane import ControlPlane, missing_reason


def main() -> int:
    """Run the scenario once and print its figures."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", type=Path, help="keep the logs here (default: a temporary directory)")
    args = parser.parse_args()
    reason = missing_reason()
    if reason is not None:
        print(json.dumps({"skipped": reason}))
        return 1
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="gpunode-e2e-"))
    cp = ControlPlane(workdir / "kube", users=E2E_USERS).start()
    try:
        cluster = scenario.build_cluster(cp, workdir)
        try:
            outcome = scenario.run_scenario(cluster)
            figures = scenario_figures.figures(cluster, outcome)
            errors = scenario_figures.error_lines(cluster)
            figures["errors_in_logs"] = len(errors)
            figures["error_lines"] = errors[:20]
            figures["logs"] = str(cp.logs)
        finally:
            scenario.stop_cluster(cluster)
    finally:
        cp.stop()
    print(json.dumps(figures, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
