"""Benchmark: extender filter + prioritize latency over real loopback HTTP, at 1,000 and 5,000 nodes x 8 GPUs.

Each round POSTs /filter then /prioritize for one pending pod (a mix of whole,
multi-GPU and fractional requests) and times the pair: each request from the
first byte sent to the last byte of the answer read, added up. Decoding the
filter answer and encoding the prioritize request between the two is
kube-scheduler's work and is not timed. Between rounds a few nodes change their
gpunode.io/gpu-state annotation (as agents publish after binds), so the caches
see realistic churn. Two modes, as kube-scheduler can use either:

- names: nodeCacheCapable, kube-scheduler sends NodeNames; node objects reach the
  extender through its refresher (refresh_nodes), outside the timed requests.
- nodes: kube-scheduler sends the full v1.NodeList in every request.

Prints one JSON document with p50/p99/max per (nodes, mode, policy). Request
bodies are encoded before timing starts (that cost is kube-scheduler's).

    .venv/bin/python bench/extender.py [--nodes 1000,5000] [--rounds 60] [--policies gpunode,fgd]
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import platform
import random
import sys
import time
from typing import Any

import numpy as np

from gpunode.cluster.extender.core import Extender, ExtenderConfig
from gpunode.cluster.extender.server import ExtenderServer
from gpunode.cluster.extender.workload import WorkloadTracker
from gpunode.contract.nodestate import ANNOTATION_KEY, GpuRecord, NodeGpuState, encode
from gpunode.placement import TargetPod, TargetWorkload

GIB = 2**30
GPU_MEMORY = 80 * GIB


def annotation(name: str, rng: random.Random, generation: int) -> str:
    gpus = []
    for i in range(8):
        used = rng.choice([0, 0, 0, 250, 500, 1000])
        gpus.append(
            GpuRecord(uuid=f"GPU-{name}-{i}", index=i, model="NVIDIA A100-SXM4-80GB", memory_total_bytes=GPU_MEMORY,
                      milli_capacity=1000, milli_assigned=used, memory_assigned_bytes=used * GPU_MEMORY // 1000,
                      nvlink_peers=tuple(f"GPU-{name}-{j}" for j in range(8) if j != i), numa_node=i // 4)
        )  # fmt: skip
    return encode(NodeGpuState(node=name, updated=time.time(), generation=generation, gpus=tuple(gpus)))


def node_object(name: str, text: str) -> dict[str, Any]:
    return {
        "kind": "Node", "apiVersion": "v1",
        "metadata": {"name": name, "uid": f"uid-{name}", "resourceVersion": "1",
                     "labels": {"kubernetes.io/hostname": name, "nvidia.com/gpu.present": "true"},
                     "annotations": {ANNOTATION_KEY: text}},
        "status": {"allocatable": {"cpu": "95500m", "memory": "1047062632Ki", "pods": "110", "nvidia.com/gpu": "8"},
                   "conditions": [{"type": "Ready", "status": "True"}]},
    }  # fmt: skip


POD_SHAPES = [
    ({"nvidia.com/gpu": "1", "cpu": "8", "memory": "32Gi"}, {}),
    ({"nvidia.com/gpu": "2", "cpu": "16", "memory": "64Gi"}, {}),
    ({"gpunode.io/gpu-memory": "10", "cpu": "4", "memory": "16Gi"}, {"gpunode.io/gpu-milli": "250"}),
    ({"gpunode.io/gpu-memory": "20", "cpu": "6", "memory": "24Gi"}, {}),
]


def pod(i: int, rng: random.Random) -> dict[str, Any]:
    limits, annotations = rng.choice(POD_SHAPES)
    return {
        "kind": "Pod", "apiVersion": "v1",
        "metadata": {"name": f"job-{i}", "namespace": "bench", "uid": f"uid-pod-{i}", "annotations": annotations},
        "spec": {"containers": [{"name": "main", "image": "trainer:1",
                                 "resources": {"limits": limits, "requests": limits}}]},
    }  # fmt: skip


def workload() -> TargetWorkload:
    return TargetWorkload(
        (
            TargetPod(cpu_milli=8000, gpu_milli=1000, gpus=1, gpu_models=None, weight=40),
            TargetPod(cpu_milli=16000, gpu_milli=1000, gpus=2, gpu_models=None, weight=10),
            TargetPod(cpu_milli=4000, gpu_milli=250, gpus=1, gpu_models=None, weight=30),
            TargetPod(cpu_milli=6000, gpu_milli=250, gpus=1, gpu_models=None, weight=20),
        )
    )


def post(conn: http.client.HTTPConnection, verb: str, body: bytes) -> bytes:
    conn.request("POST", f"/{verb}", body=body, headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    data = resp.read()
    if resp.status != 200:
        raise SystemExit(f"/{verb} answered {resp.status}: {data[:300]!r}")
    return data


def run(n_nodes: int, mode: str, policy: str, rounds: int, churn: int) -> dict[str, Any]:
    rng = random.Random(n_nodes)
    names = [f"gpu-{i:05d}" for i in range(n_nodes)]
    generation = dict.fromkeys(names, 1)
    texts = {n: annotation(n, rng, 1) for n in names}
    objects = {n: node_object(n, texts[n]) for n in names}
    extender = Extender(config=ExtenderConfig(policy=policy, provisional_reservations=False),
                        workload=WorkloadTracker(seed=workload()))  # fmt: skip
    server = ExtenderServer(extender, port=0)
    server.start()
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    try:
        if mode == "names":
            extender.refresh_nodes(objects.values())
        samples: list[float] = []
        for i in range(rounds + 3):
            for name in rng.sample(names, churn):  # agents publishing after binds
                generation[name] += 1
                texts[name] = annotation(name, rng, generation[name])
                objects[name] = node_object(name, texts[name])
                if mode == "names":
                    extender.refresh_nodes([objects[name]])
            p = pod(i, rng)
            if mode == "names":
                body = json.dumps({"Pod": p, "Nodes": None, "NodeNames": names}).encode()
            else:
                body = json.dumps({"Pod": p, "Nodes": {"kind": "NodeList", "apiVersion": "v1",
                                                       "items": list(objects.values())}, "NodeNames": None}).encode()  # fmt: skip
            started = time.perf_counter()
            answer = post(conn, "filter", body)
            elapsed = time.perf_counter() - started
            # Reading the filter answer and encoding the next request is kube-scheduler's work: not timed.
            filtered = json.loads(answer)
            if mode == "names":
                body2 = json.dumps({"Pod": p, "Nodes": None, "NodeNames": filtered["NodeNames"]}).encode()
            else:
                body2 = json.dumps({"Pod": p, "Nodes": filtered["Nodes"], "NodeNames": None}).encode()
            started = time.perf_counter()
            post(conn, "prioritize", body2)
            elapsed += time.perf_counter() - started
            if i >= 3:  # the first rounds fill the caches
                samples.append(elapsed)
        ms = np.array(samples) * 1000
        return {
            "nodes": n_nodes, "gpus_per_node": 8, "mode": mode, "policy": policy, "rounds": rounds,
            "annotation_changes_per_round": churn,
            "filter_plus_prioritize_ms": {"p50": round(float(np.percentile(ms, 50)), 2),
                                          "p99": round(float(np.percentile(ms, 99)), 2),
                                          "max": round(float(ms.max()), 2)},
            "request_bytes": len(body),
        }  # fmt: skip
    finally:
        conn.close()
        server.stop()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nodes", default="1000,5000")
    p.add_argument("--modes", default="names,nodes")
    p.add_argument("--policies", default="gpunode,fgd,bestfit")
    p.add_argument("--rounds", type=int, default=60)
    p.add_argument("--churn", type=int, default=5, help="nodes whose annotation changes between rounds")
    args = p.parse_args(argv)
    results = []
    for n in (int(x) for x in args.nodes.split(",")):
        for mode in args.modes.split(","):
            for policy in args.policies.split(","):
                results.append(run(n, mode, policy, args.rounds, args.churn))
                print(json.dumps(results[-1]), file=sys.stderr, flush=True)
    print(json.dumps({"benchmark": "extender", "target": "p99 < 100 ms at 5,000 nodes x 8 GPUs",
                      "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
                      "results": results}, indent=2))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
