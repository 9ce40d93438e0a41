"""How soon a change reaches the cluster through gpunode's ResourceSlices, on a real Kubernetes 1.36.

Starts the e2e tier's control plane (etcd, kube-apiserver, kube-controller-manager with the device-taint
eviction controller, kube-scheduler; scripts/get-kube.sh builds them) and one fake node whose pool a
SlicePublisher keeps current, as the agent runs it (woken by the device state, gpunode's KubeClient).

- republish: a device turns unhealthy in the device state (the health monitor's output) -> the new pool
  generation, with the taint, is readable from the API server; then healthy again -> the taint is gone.
  Timed by polling the API server every 5 ms, so each figure is up to 5 ms late.
- eviction: a pod holding the GPU through a claim is bound by kube-scheduler; XID 79 goes through
  gpunode's HealthMonitor -> NoExecute taint on the slice -> the device-taint eviction controller marks
  the pod for deletion (its deletionTimestamp). Then the GPU is reset and the taint cleared.

    .venv/bin/python bench/dra_slices.py [--profile t4] [--rounds 30] [--evictions 5]

Prints one JSON document.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from gpunode.config.health import HealthConfig
from gpunode.contract import dra as names
from gpunode.contract.names import GIB
from gpunode.infra.kube import KubeClient
from gpunode.node.devices.base import DeviceEvent, EventKind
from gpunode.node.devices.simnode.backend import SimBackend
from gpunode.node.dra.slices import Pool, SlicePublisher, build_pool
from gpunode.node.dra.taints import DeviceTaint, device_taints
from gpunode.node.health import HealthMonitor
from gpunode.node.inventory import Inventory
from gpunode.node.state import DeviceState
from tests.e2e.api import Api, ApiError, eventually
from tests.e2e.controlplane import ControlPlane, kube_version, missing_reason
from tests.e2e.objects import create_fake_node, ensure_namespace

NODE = "bench-dra-node"
NAMESPACE = "bench-dra"
RESOURCE = "/apis/resource.k8s.io/v1"
POLL_S = 0.005


def run_publisher(plane: ControlPlane, pool: Callable[[], Pool], state: DeviceState) -> Callable[[], None]:
    """A SlicePublisher for NODE in a thread of its own (as the agent's admin user); returns its stop."""
    loop = asyncio.new_event_loop()

    async def changed(version: int) -> int:
        return (await state.wait_for_change(version)).version

    publisher = SlicePublisher(
        client_factory=lambda: KubeClient.for_host(
            plane.server, token_file=plane.token_file("admin"), ca_file=plane.ca_file
        ),
        node_name=NODE,
        driver=names.DEFAULT_DRIVER,
        pool=pool,
        changed=changed,
        interval_s=3600.0,
    )
    started = threading.Event()
    holder: list[asyncio.Task[None]] = []

    def main() -> None:
        asyncio.set_event_loop(loop)

        async def go() -> None:
            ready = asyncio.Event()
            holder.append(asyncio.ensure_future(publisher.run(ready=ready)))
            await ready.wait()
            started.set()
            await asyncio.gather(holder[0], return_exceptions=True)

        loop.run_until_complete(go())

    thread = threading.Thread(target=main, daemon=True)
    thread.start()
    started.wait(60)

    def stop() -> None:
        loop.call_soon_threadsafe(holder[0].cancel)
        thread.join(30)

    return stop


def taints_on_api(api: Api) -> int:
    listed = api.get(f"{RESOURCE}/resourceslices?fieldSelector=spec.nodeName={NODE}")
    return sum(len(d.get("taints") or []) for s in listed["items"] for d in s["spec"].get("devices") or [])


def until(check: Callable[[], bool], timeout_s: float = 60.0) -> float:
    started = time.monotonic()
    while not check():
        if time.monotonic() - started > timeout_s:
            raise SystemExit(f"bench/dra_slices.py: nothing changed on the API server within {timeout_s:g} s")
        time.sleep(POLL_S)
    return time.monotonic() - started


def summary(values: list[float]) -> dict[str, float]:
    ms = sorted(v * 1000 for v in values)
    return {
        "median_ms": round(statistics.median(ms), 1),
        "p90_ms": round(ms[int(0.9 * (len(ms) - 1))], 1),
        "max_ms": round(ms[-1], 1),
    }


def bench_republish(plane: ControlPlane, api: Api, backend: SimBackend, rounds: int) -> dict[str, Any]:
    gpus = backend.gpus()
    state = DeviceState(Inventory(gpus=gpus))

    def pool() -> Pool:
        marks = {
            u: DeviceTaint(names.TAINT_KEY, "probe", names.NO_SCHEDULE) for u in state.snapshot().unhealthy
        }
        return build_pool(gpus, unit_bytes=GIB, driver_version=backend.driver_version(), taints=marks)

    stop = run_publisher(plane, pool, state)
    up, down = [], []
    try:
        until(lambda: bool(api.get(f"{RESOURCE}/resourceslices?fieldSelector=spec.nodeName={NODE}")["items"]))
        for _ in range(rounds):
            state.set_unhealthy("bench", {gpus[0].uuid: "bench"})
            up.append(until(lambda: taints_on_api(api) > 0))
            state.set_unhealthy("bench", {})
            down.append(until(lambda: taints_on_api(api) == 0))
    finally:
        stop()
    slices = api.get(f"{RESOURCE}/resourceslices?fieldSelector=spec.nodeName={NODE}")["items"]
    for s in slices:
        api.delete(f"{RESOURCE}/resourceslices/{s['metadata']['name']}")
    return {
        "slices": len(slices),
        "devices": len(pool().devices),
        "taint_published": summary(up),
        "taint_cleared": summary(down),
    }


def bench_eviction(plane: ControlPlane, api: Api, rounds: int) -> dict[str, Any]:
    backend = SimBackend.from_profile("t4")
    gpu = backend.gpus()[0]
    state = DeviceState(Inventory(gpus=(gpu,)))
    config = HealthConfig(recovery_window_s=0.5)
    monitor = HealthMonitor(backend=backend, state=state, config=config)
    asyncio.run(monitor.probe_once())

    def pool() -> Pool:
        marks = device_taints(monitor.verdicts(), config.xid)
        return build_pool([gpu], unit_bytes=GIB, driver_version=backend.driver_version(), taints=marks)

    stop = run_publisher(plane, pool, state)
    taint_s, evict_s = [], []
    try:
        for n in range(rounds):
            claim, pod = f"whole-{n}", f"holder-{n}"
            api.create(
                f"{RESOURCE}/namespaces/{NAMESPACE}/resourceclaims",
                {
                    "apiVersion": "resource.k8s.io/v1",
                    "kind": "ResourceClaim",
                    "metadata": {"name": claim},
                    "spec": {
                        "devices": {
                            "requests": [{"name": "gpu", "exactly": {"deviceClassName": names.CLASS_WHOLE}}]
                        }
                    },
                },
            )
            api.create(
                f"/api/v1/namespaces/{NAMESPACE}/pods",
                {
                    "apiVersion": "v1",
                    "kind": "Pod",
                    "metadata": {"name": pod},
                    "spec": {
                        "nodeSelector": {"kubernetes.io/hostname": NODE},
                        "resourceClaims": [{"name": "gpu", "resourceClaimName": claim}],
                        "containers": [
                            {"name": "main", "image": "none:1", "resources": {"claims": [{"name": "gpu"}]}}
                        ],
                        "terminationGracePeriodSeconds": 0,
                    },
                },
            )
            eventually(
                lambda pod=pod: api.get(f"/api/v1/namespaces/{NAMESPACE}/pods/{pod}")["spec"].get("nodeName"),
                timeout_s=120,
                what=f"{pod} bound",
            )
            started = time.monotonic()
            monitor.handle_event(DeviceEvent(EventKind.XID, gpu.uuid, xid=79))
            until(lambda: taints_on_api(api) > 0)
            taint_s.append(time.monotonic() - started)

            def gone(pod: str = pod) -> bool:
                try:
                    p = api.get(f"/api/v1/namespaces/{NAMESPACE}/pods/{pod}")
                except ApiError as exc:
                    return exc.status == 404
                return bool(p["metadata"].get("deletionTimestamp"))

            until(gone, timeout_s=120)
            evict_s.append(time.monotonic() - started)
            try:  # with no grace period the eviction removed it already
                api.request("DELETE", f"/api/v1/namespaces/{NAMESPACE}/pods/{pod}", {"gracePeriodSeconds": 0})
            except ApiError as exc:
                if exc.status != 404:
                    raise
            api.delete(f"{RESOURCE}/namespaces/{NAMESPACE}/resourceclaims/{claim}")
            backend.reset_gpu(gpu.uuid)
            asyncio.run(monitor.probe_once())
            time.sleep(0.6)
            asyncio.run(monitor.probe_once())
            until(lambda: taints_on_api(api) == 0)
            eventually(
                lambda claim=claim: (
                    not any(
                        c["metadata"]["name"] == claim
                        for c in api.get(f"{RESOURCE}/namespaces/{NAMESPACE}/resourceclaims")["items"]
                    )
                ),
                timeout_s=120,
                what=f"{claim} gone",
            )
    finally:
        stop()
    return {"rounds": rounds, "xid_to_taint": summary(taint_s), "xid_to_eviction": summary(evict_s)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", default="t4", help="simulated node profile for the republish rounds")
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--evictions", type=int, default=5)
    args = parser.parse_args()
    reason = missing_reason()
    if reason is not None:
        raise SystemExit(f"bench/dra_slices.py: {reason}")
    with tempfile.TemporaryDirectory(prefix="bench-dra-") as tmp:
        plane = ControlPlane(Path(tmp)).start()
        try:
            api = plane.api()
            ensure_namespace(api, NAMESPACE)
            # The whole-GPU class as the chart renders it (tests/deploy/test_helm_dra.py checks the chart's).
            for cls, sharing in ((names.CLASS_WHOLE, names.SHARING_WHOLE),):
                expr = (
                    f'device.driver == "{names.DEFAULT_DRIVER}" && '
                    f'device.attributes["{names.DEFAULT_DRIVER}"].{names.ATTR_SHARING} == "{sharing}"'
                )
                api.apply(
                    f"{RESOURCE}/deviceclasses",
                    {
                        "apiVersion": "resource.k8s.io/v1",
                        "kind": "DeviceClass",
                        "metadata": {"name": cls},
                        "spec": {"selectors": [{"cel": {"expression": expr}}]},
                    },
                )
            create_fake_node(api, NODE)
            republish = bench_republish(plane, api, SimBackend.from_profile(args.profile), args.rounds)
            scheduler = plane.start_scheduler()
            try:
                eviction = bench_eviction(plane, api, args.evictions) if args.evictions else None
            finally:
                scheduler.stop()
        finally:
            plane.stop()
    print(
        json.dumps(
            {
                "bench": "dra_slices",
                "kubernetes": kube_version(),
                "profile": args.profile,
                "rounds": args.rounds,
                "poll_ms": POLL_S * 1000,
                "republish": republish,
                "eviction": eviction,
                "python": platform.python_version(),
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
