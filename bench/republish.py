"""How soon the cluster sees an allocation: Allocate to the Node PATCH that shows it (target < 1 s).

The agent runs in-process on the simulated t4 node with the kubelet and API server stand-ins;
each round admits one pod the extender assigned to a GPU (GetPreferredAllocation, then Allocate)
and times the first PATCH of the Node's gpunode.io/gpu-state annotation that counts the units
held. Also reports how many of the rounds carried the assignment out.

    .venv/bin/python bench/republish.py [--rounds 20]

Prints one JSON document.
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from gpunode.contract.names import ASSIGNMENT_ANNOTATION, GIB
from gpunode.contract.nodestate import ANNOTATION_KEY, decode
from gpunode.node.agent import Agent
from gpunode.node.devices.simnode.backend import SimBackend
from tests.agentrunner import RunningAgent, make_config
from tests.fakes.apiserver import ApiServerStandIn
from tests.fakes.kubelet import KubeletStandIn, short_socket_dir

NODE = "bench-node"
MEM = "gpunode.io/gpu-memory"


def kubeconfig(path: Path, url: str) -> Path:
    cluster = {"name": "c", "cluster": {"server": url}}
    user = {"name": "u", "user": {"token": "t"}}
    context = {"name": "x", "context": {"cluster": "c", "user": "u"}}
    doc = {"apiVersion": "v1", "kind": "Config", "clusters": [cluster], "users": [user]}
    path.write_text(json.dumps({**doc, "contexts": [context], "current-context": "x"}))
    return path


def pending_pod(name: str, gpu: str) -> dict[str, object]:
    return {
        "metadata": {"name": name, "namespace": "bench", "annotations": {ASSIGNMENT_ANNOTATION: gpu}},
        "spec": {"nodeName": NODE, "containers": [{"name": "c", "resources": {"limits": {MEM: "1"}}}]},
        "status": {"phase": "Pending"},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=20)
    args = parser.parse_args()
    d = short_socket_dir("rp")
    delays: list[float] = []
    try:
        with ApiServerStandIn() as api, KubeletStandIn(d / "device-plugins") as kubelet:
            api.add_node(NODE)
            own = {
                "nodeName": NODE,
                "fractional": {"devices": [0, 1, 2, 3], "unit": "1Gi"},
                "podResourcesSocket": str(d / "pr.sock"),
                "nodeState": {"interval": "1h"},
                "remediation": {"mode": "off", "kubeconfig": str(kubeconfig(d / "kubeconfig", api.url))},
            }
            cfg = make_config(d / "device-plugins", d / "state", {"gpunode": own})
            backend = SimBackend.from_profile("t4")
            gpus = [g.uuid for g in backend.gpus()]
            with RunningAgent(Agent(cfg, backend=backend)) as ra:
                kubelet.wait_for_resources([MEM])
                book = ra.agent.assignments
                taken: set[str] = set()  # the kubelet offers only what it has not handed out
                for n in range(args.rounds):
                    gpu = gpus[n % len(gpus)]
                    uid = api.put_pod(pending_pod(f"p{n}", gpu))
                    api.wait_for(lambda u=uid: u in book.pending, timeout=30, what="the pod in the book")
                    held = n // len(gpus) + 1  # units held on that GPU after this round
                    ids = kubelet.preferred(MEM, [u for u in kubelet.healthy(MEM) if u not in taken], 1)
                    taken.update(ids)
                    start = time.monotonic()
                    kubelet.allocate(MEM, ids)
                    index = gpus.index(gpu)

                    def shown(i: int = index, want: int = held) -> bool:
                        text = api.node(NODE)["metadata"].get("annotations", {}).get(ANNOTATION_KEY)
                        return text is not None and decode(text).gpus[i].memory_assigned_bytes == want * GIB

                    api.wait_for(shown, timeout=30, what="the allocation published")
                    patches = [r for r in api.requests("PATCH", f"/api/v1/nodes/{NODE}$") if r.at >= start]
                    delays.append(min(r.at for r in patches) - start)
                outcomes = dict(book.outcomes)
    finally:
        shutil.rmtree(d, ignore_errors=True)
    ms = sorted(x * 1000 for x in delays)
    print(
        json.dumps(
            {
                "bench": "republish",
                "python": platform.python_version(),
                "rounds": len(ms),
                "allocate_to_patch_ms": {
                    "min": round(ms[0], 1),
                    "p50": round(statistics.median(ms), 1),
                    "max": round(ms[-1], 1),
                },
                "target_ms": 1000,
                "outcomes": outcomes,
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
