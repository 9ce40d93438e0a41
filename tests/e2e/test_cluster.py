"""The test cluster itself (tests/e2e/controlplane.py): the version get-kube.sh built, the DRA APIs and
features the next tiers build on, and kube-controller-manager at work."""

from __future__ import annotations

import re
import ssl
import urllib.request

from tests.e2e.api import STRATEGIC, ApiError, eventually
from tests.e2e.controlplane import FEATURE_GATES, KUBE_MINOR, ControlPlane, kube_version
from tests.e2e.objects import create_fake_node, ensure_namespace

NAMESPACE = "e2e-cluster"


def test_the_api_server_is_the_version_built(control_plane: ControlPlane) -> None:
    version = control_plane.api().get("/version")
    assert version["gitVersion"] == kube_version() and version["minor"] == str(KUBE_MINOR), version


def test_resource_api_v1_and_device_taint_rules_are_served(control_plane: ControlPlane) -> None:
    admin = control_plane.api()
    v1 = {r["name"] for r in admin.get("/apis/resource.k8s.io/v1")["resources"]}
    assert {"deviceclasses", "resourceclaims", "resourceclaimtemplates", "resourceslices"} <= v1, v1
    # DeviceTaintRule: v1beta2 from 1.36 (RUNTIME_CONFIG turns it on), v1alpha3 before.
    version = "v1beta2" if KUBE_MINOR >= 36 else "v1alpha3"
    served = {r["name"] for r in admin.get(f"/apis/resource.k8s.io/{version}")["resources"]}
    assert "devicetaintrules" in served, (version, served)


def test_the_dra_feature_gates_are_on(control_plane: ControlPlane) -> None:
    req = urllib.request.Request(
        f"{control_plane.server}/metrics",
        headers={"Authorization": f"Bearer {control_plane.tokens['admin']}"},
    )
    tls = ssl.create_default_context(cafile=str(control_plane.ca_file))
    with urllib.request.urlopen(req, timeout=30, context=tls) as resp:
        metrics = resp.read().decode()
    # The stage differs by version (alpha in 1.34, beta in 1.36): what matters is that each gate is on.
    for gate in FEATURE_GATES:
        assert re.search(rf'kubernetes_feature_enabled{{name="{gate}",stage="[A-Z]*"}} 1\n', metrics), gate


def test_the_garbage_collector_removes_what_an_owner_leaves(control_plane: ControlPlane) -> None:
    admin = control_plane.api()
    ensure_namespace(admin, NAMESPACE)  # waits for the ServiceAccount controller's default account
    path = f"/api/v1/namespaces/{NAMESPACE}/configmaps"
    owner = admin.create(path, {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "owner"}})
    ref = {"apiVersion": "v1", "kind": "ConfigMap", "name": "owner", "uid": owner["metadata"]["uid"]}
    admin.create(
        path,
        {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {"name": "dependent", "ownerReferences": [ref]},
        },
    )
    admin.delete(f"{path}/owner")

    def collected() -> bool:
        try:
            admin.get(f"{path}/dependent")
        except ApiError as exc:
            return exc.status == 404
        return False

    eventually(collected, timeout_s=120, what="the dependent ConfigMap collected")


def test_the_root_ca_is_published_in_every_namespace(control_plane: ControlPlane) -> None:
    admin = control_plane.api()
    ensure_namespace(admin, NAMESPACE)
    published = eventually(
        lambda: admin.get(f"/api/v1/namespaces/{NAMESPACE}/configmaps/kube-root-ca.crt"),
        timeout_s=120,
        what=f"kube-root-ca.crt in {NAMESPACE}",
    )
    assert published["data"]["ca.crt"] == control_plane.ca_file.read_text()


def test_a_fake_node_marked_unknown_is_ready_again_and_the_controller_lifts_its_taint(
    control_plane: ControlPlane,
) -> None:
    # What a late Lease renewal on a loaded machine leads to: the node lifecycle controller sets Ready to
    # Unknown and taints the Node unreachable. A fake node must come back as a kubelet's would, or every
    # later pod that needs it stays Pending ("untolerated taint") for the rest of the tier.
    admin = control_plane.api()
    create_fake_node(admin, "e2e-cluster-unknown")
    unreachable = "node.kubernetes.io/unreachable"
    admin.patch(  # the controller's taints, as it writes them
        "/api/v1/nodes/e2e-cluster-unknown",
        {"spec": {"taints": [{"key": unreachable, "effect": e} for e in ("NoSchedule", "NoExecute")]}},
    )
    admin.patch(
        "/api/v1/nodes/e2e-cluster-unknown/status",
        {"status": {"conditions": [{"type": "Ready", "status": "Unknown", "reason": "NodeStatusUnknown"}]}},
        content_type=STRATEGIC,
    )
    eventually(
        lambda: not admin.get("/api/v1/nodes/e2e-cluster-unknown").get("spec", {}).get("taints"),
        timeout_s=60,
        what="Ready posted again and the controller lifting the unreachable taint",
    )
    admin.delete("/api/v1/nodes/e2e-cluster-unknown")
