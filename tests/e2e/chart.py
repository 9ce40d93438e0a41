"""The Helm chart (helm/gpunode) rendered by a real helm, and its RBAC applied to the real API server."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.e2e.api import Api
from tests.e2e.controlplane import ROOT

RELEASE, NAMESPACE = "gn", "gpunode-system"  # the users in tests/e2e/conftest.py are named after these
RBAC_PATHS = {
    "ClusterRole": "/apis/rbac.authorization.k8s.io/v1/clusterroles",
    "ClusterRoleBinding": "/apis/rbac.authorization.k8s.io/v1/clusterrolebindings",
    "ServiceAccount": f"/api/v1/namespaces/{NAMESPACE}/serviceaccounts",
}


def helm_binary() -> Path | None:
    """scripts/get-helm.sh's helm, or $GPUNODE_HELM."""
    named = os.environ.get("GPUNODE_HELM")
    path = Path(named) if named else ROOT / ".tools" / "bin" / "helm"
    return path if path.is_file() and os.access(path, os.X_OK) else None


def render(values: Mapping[str, Any], tmp: Path) -> list[dict[str, Any]]:
    """`helm template` of the chart with these values (the test is skipped without helm)."""
    helm = helm_binary()
    if helm is None:
        pytest.skip("helm is not installed: run scripts/get-helm.sh (it installs .tools/bin/helm)")
    values_file = tmp / "values.yaml"
    values_file.write_text(yaml.safe_dump(dict(values)))
    chart = str(ROOT / "helm" / "gpunode")
    argv = [str(helm), "template", RELEASE, chart, "-n", NAMESPACE, "-f", str(values_file)]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr
    return [d for d in yaml.safe_load_all(proc.stdout) if d]


def apply_rbac(api: Api, docs: list[dict[str, Any]], part: str) -> str:
    """Apply the ServiceAccount, ClusterRole and ClusterRoleBinding of one part (agent, extender) and
    return the user name the binding grants its rights to."""
    subject = None
    for doc in docs:
        kind, name = doc["kind"], doc["metadata"]["name"]
        if kind in RBAC_PATHS and name == f"{RELEASE}-gpunode-{part}":
            api.apply(RBAC_PATHS[kind], doc)
            if kind == "ClusterRoleBinding":
                subject = doc["subjects"][0]
    assert subject is not None, f"the chart rendered no ClusterRoleBinding {RELEASE}-gpunode-{part}"
    return f"system:serviceaccount:{subject['namespace']}:{subject['name']}"
