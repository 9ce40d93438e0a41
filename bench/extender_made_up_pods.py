"""The made-up-pods attack on provisional reservations, with and without the pod check: free GPUs left.

Anyone who reaches the extender's port can POST filter and prioritize bodies for pods that do not exist;
each used to reserve GPUs for --reservation-ttl (60 s), renewable at will. This POSTs filter+prioritize for
`--ghosts` made-up 1-GPU pods against two 8-GPU nodes over loopback HTTP, then counts the whole GPUs a
real, pending 8-GPU pod sees free and the nodes its filter passes:

- "pod_check": the extender as shipped (a pod reader that knows only the real pod);
- "no_pod_check": a pod reader that answers every pod as existing and pending, i.e. the extender as it
  was before it read pods (every made-up body taken at its word).

Also the API reads the attack cost (one per made-up pod: prioritize takes filter's). Prints one JSON
document.

    .venv/bin/python bench/extender_made_up_pods.py [--ghosts 64]
"""

from __future__ import annotations

import argparse
import http.client
import json
import logging
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from gpunode.cluster.extender.core import Extender, ExtenderConfig
from gpunode.cluster.extender.reservations import apply_reservations
from gpunode.cluster.extender.server import ExtenderServer
from tests.cluster.test_extender import gpu_state, v1_node, v1_pod

NODES = ["n1", "n2"]


def post(port: int, verb: str, body: object) -> Any:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request("POST", f"/{verb}", body=json.dumps(body), headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        assert resp.status == 200, resp.status
        return json.loads(resp.read())
    finally:
        conn.close()


def run(ghosts: int, *, check: bool) -> dict[str, Any]:
    real = v1_pod("real", uid="uid-real", limits={"nvidia.com/gpu": "8"})
    reads = 0

    def read(namespace: str, name: str) -> dict[str, Any] | None:
        nonlocal reads
        reads += 1
        if (namespace, name) == ("team-a", "real"):
            return real
        if check:
            return None
        made_up = dict(v1_pod(name, uid=f"uid-{name}", limits={"nvidia.com/gpu": "1"}))
        made_up["metadata"] = {**made_up["metadata"], "namespace": namespace}
        return made_up

    config = ExtenderConfig(policy="bestfit", max_provisional_per_namespace=10_000 if not check else 8)
    extender = Extender(config=config, pod_reader=read)
    extender.refresh_nodes([v1_node(n, gpu_state(n, [1000] * 8)) for n in NODES])
    server = ExtenderServer(extender, port=0)
    server.start()
    try:
        for i in range(ghosts):
            pod = v1_pod(f"ghost-{i}", uid=f"uid-ghost-{i}", limits={"nvidia.com/gpu": "1"})
            pod["metadata"]["namespace"] = f"made-up-{i}"  # one namespace each: no per-namespace bound helps
            body = {"Pod": pod, "NodeNames": NODES}
            post(server.port, "filter", body)
            post(server.port, "prioritize", body)
        free = {}
        for v in extender.nodes.get_many(NODES):
            state = apply_reservations(v, extender.reservations, skip_pod="uid-real")
            free[v.name] = sum(1 for g in state.gpus if g.milli_free == 1000) if state is not None else 0
        passed = post(server.port, "filter", {"Pod": real, "NodeNames": NODES})["NodeNames"]
    finally:
        server.stop()
    return {
        "reservations_held": len(extender.reservations),
        "free_whole_gpus_seen_by_real_pod": free,
        "real_8gpu_pod_passes": passed,
        "api_reads": reads,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ghosts", type=int, default=64)
    args = parser.parse_args()
    logging.disable(logging.WARNING)
    out = {
        "ghosts": args.ghosts,
        "nodes": "2 x 8 GPUs",
        "no_pod_check": run(args.ghosts, check=False),
        "pod_check": run(args.ghosts, check=True),
    }
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
