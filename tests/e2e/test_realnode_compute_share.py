"""A pod's compute share through a real kubelet: the agent (the real node's device plugin) finds the pod's
container by the kubelet's pod-resources List, writes the pod's gpunode.io/gpu-milli into its region,
follows a change of the annotation, and publishes the share in the Node's GPU state.

Needs the real-node tier (tests/e2e/test_realnode_deviceplugin.py: a kubelet, containerd and runc); run
one at a time machine-wide: `flock /tmp/gpunode-realnode.lock pytest tests/e2e/test_realnode_compute_share.py`.
"""

from __future__ import annotations

import urllib.request
from functools import partial

from prometheus_client.parser import text_string_to_metric_families

from gpunode.contract.names import GPU_MILLI_ANNOTATION, NODE_STATE_ANNOTATION
from gpunode.contract.nodestate import decode
from tests.e2e.api import eventually
from tests.e2e.conftest import REAL_NODE
from tests.e2e.controlplane import ControlPlane
from tests.e2e.objects import create_pod, pod_body
from tests.e2e.test_realnode_deviceplugin import (  # the module's node and agent, started for this module
    MEM_RESOURCE,
    NAMESPACE,
    WAIT_S,
    AgentNode,
    _capacity,
    node_with_agent,  # noqa: F401  (a fixture)
)

POD = "milli"


def compute_share(metrics_url: str, pod: str) -> float | None:
    """The compute share the agent's metrics show in `pod`'s region (0..1), or None if not listed."""
    with urllib.request.urlopen(metrics_url, timeout=10) as resp:
        text = resp.read().decode()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "gpunode_container_compute_share" and sample.labels.get("pod") == pod:
                return sample.value
    return None


def test_a_pods_gpu_milli_reaches_its_region_through_the_real_kubelet(
    node_with_agent: AgentNode,  # noqa: F811
    control_plane: ControlPlane,
) -> None:
    admin = control_plane.api()
    eventually(partial(_capacity, admin, REAL_NODE), timeout_s=WAIT_S, what=f"{MEM_RESOURCE} on the Node")
    body = pod_body(POD, limits={MEM_RESOURCE: "2"}, node_name=REAL_NODE)
    body["metadata"]["annotations"] = {GPU_MILLI_ANNOTATION: "600"}
    create_pod(admin, NAMESPACE, body)
    url = node_with_agent.metrics_url

    def share_is(value: float) -> bool:
        got = compute_share(url, POD)
        return got is not None and abs(got - value) < 1e-9

    eventually(lambda: share_is(0.6) or None, timeout_s=WAIT_S, what="the pod's 600 in its region")
    admin.patch(
        f"/api/v1/namespaces/{NAMESPACE}/pods/{POD}",
        {"metadata": {"annotations": {GPU_MILLI_ANNOTATION: "350"}}},
    )
    eventually(lambda: share_is(0.35) or None, timeout_s=WAIT_S, what="the pod's new 350 in its region")

    def published_share() -> int | None:
        node = admin.get(f"/api/v1/nodes/{REAL_NODE}")
        text = (node["metadata"].get("annotations") or {}).get(NODE_STATE_ANNOTATION)
        if text is None:
            return None
        gpus = [g for g in decode(text, node=REAL_NODE).gpus if f"{NAMESPACE}/{POD}" in g.pods]
        return gpus[0].milli_assigned if gpus and gpus[0].milli_assigned == 350 else None

    assert eventually(published_share, timeout_s=WAIT_S, what="the share in the Node's GPU state") == 350
    admin.delete(f"/api/v1/namespaces/{NAMESPACE}/pods/{POD}")
