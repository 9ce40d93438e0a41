"""`gpunode agent` with gpunode.dra: beside the device plugin on one simulated node, each GPU served by
one of the two; its slices (written by the agent's publisher to an API server stand-in) are what
the kubelet plugin reads back to prepare a claim; prepared claims outlive an agent restart."""

from __future__ import annotations

import asyncio
import contextlib
import json
from pathlib import Path
from typing import Any

import grpc

from gpunode.contract import dra as names
from gpunode.errors import ConfigError
from gpunode.node.agent import Agent
from gpunode.node.devices.simnode.backend import SimBackend
from gpunode.node.kubelet._proto import dra_v1_pb2 as v1
from gpunode.node.kubelet._proto import dra_v1_pb2_grpc as v1_grpc
from tests.agentrunner import RunningAgent, make_config
from tests.fakes.kubelet import KubeletStandIn
from tests.node.dra_world import DRIVER, NODE, FakeApi, claim

GPU = "nvidia.com/gpu"


def start(sockdir: Path, api: FakeApi, doc: dict[str, Any] | None = None, **dra: Any) -> RunningAgent:
    cfg = make_config(
        sockdir / "device-plugins",
        sockdir / "state",
        doc,
        nodeName=NODE,
        nodeState={"enabled": False},
        remediation={"kubeconfig": str(api.kubeconfig(sockdir / "kubeconfig"))},
        dra={"enabled": True, "cdiDir": str(sockdir / "cdi"), **dra},
    )
    return RunningAgent(Agent(cfg, backend=SimBackend.from_profile("t4"))).start()


def wait_for(predicate: Any, what: str, timeout: float = 15.0) -> Any:
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def shared_device(api: FakeApi, uuid: str) -> tuple[str, str]:
    for s in api.slices:
        for d in s["spec"].get("devices", []):
            a = d.get("attributes", {})
            if (
                a.get(names.ATTR_UUID, {}).get("string") == uuid
                and a.get(names.ATTR_SHARING, {}).get("string") == names.SHARING_SHARED
            ):
                return s["spec"]["pool"]["name"], d["name"]
    raise AssertionError(f"no shared device of {uuid} in the slices")


def prepare(sockdir: Path, obj: dict[str, Any]) -> Any:
    async def call() -> Any:
        path = sockdir / "plugins" / DRIVER / "dra.sock"
        async with grpc.aio.insecure_channel(f"unix://{path}") as ch:
            m = obj["metadata"]
            return await v1_grpc.DRAPluginStub(ch).NodePrepareResources(
                v1.NodePrepareResourcesRequest(
                    claims=[v1.Claim(namespace=m["namespace"], uid=m["uid"], name=m["name"])]
                ),
                timeout=10,
            )

    return asyncio.run(call())


def test_dra_and_the_device_plugin_share_a_node_without_selling_a_gpu_twice(
    sockdir: Path, kubelet: KubeletStandIn
) -> None:
    api = FakeApi()
    api.slices = []
    ra = start(sockdir, api, devices=[0, 1])
    try:
        gpus = ra.agent.backend.gpus()
        kubelet.wait_for_resources([GPU])
        assert sorted(kubelet.healthy(GPU)) == sorted(g.uuid for g in gpus[2:])  # the device plugin's two
        assert (sockdir / "plugins_registry" / f"{DRIVER}-reg.sock").exists()

        def published() -> set[str]:
            return {
                d["attributes"][names.ATTR_UUID]["string"]
                for s in list(api.slices)
                for d in s["spec"].get("devices", [])
            }

        wait_for(published, "the node's ResourceSlices with devices")
        assert published() == {gpus[0].uuid, gpus[1].uuid}  # DRA's two, and only those
        pool, device = shared_device(api, gpus[0].uuid)
        obj = claim("train", device=device, pool=pool, memory="4Gi")
        api.add(obj)
        answer = prepare(sockdir, obj).claims[obj["metadata"]["uid"]]
        assert answer.error == ""
        spec = json.loads((sockdir / "cdi" / f"{DRIVER}-{obj['metadata']['uid']}.json").read_text())
        env = dict(e.split("=", 1) for e in spec["containerEdits"]["env"])
        assert env["NVIDIA_VISIBLE_DEVICES"] == gpus[0].uuid and env["GPUNODE_MEMCAP_LIMIT_BYTES"] == str(
            4 * 2**30
        )
        # a claim on a GPU the device plugin serves is refused, even if a slice claimed it
        plugin_gpu = claim("sneaky", device=gpus[2].uuid.lower(), pool=pool)
        with_devices = next(s for s in api.slices if s["spec"].get("devices"))
        with_devices["spec"]["devices"].append(
            {
                "name": gpus[2].uuid.lower(),
                "attributes": {names.ATTR_UUID: {"string": gpus[2].uuid}, names.ATTR_TYPE: {"string": "gpu"}},
            }
        )
        api.add(plugin_gpu)
        refused = prepare(sockdir, plugin_gpu).claims[plugin_gpu["metadata"]["uid"]].error
        assert "is not served through DRA on this node" in refused
        # an agent that must exit at once removes its DRA sockets too, registration first
        reg = sockdir / "plugins_registry" / f"{DRIVER}-reg.sock"
        ra.agent.stuck_cleanup()
        assert not reg.exists() and not (sockdir / "plugins" / DRIVER / "dra.sock").exists()
    finally:
        ra.stop()
    # the restarted agent answers the kubelet's repeated prepare from its record
    ra = start(sockdir, api, devices=[0, 1])
    try:
        again = prepare(sockdir, obj).claims[obj["metadata"]["uid"]]
        assert again == answer
    finally:
        ra.stop()
        api.close()


def test_dra_without_a_node_name_is_refused_with_one_line(sockdir: Path, kubelet: KubeletStandIn) -> None:
    cfg = make_config(sockdir / "device-plugins", sockdir / "state", None, dra={"enabled": True})
    ra = RunningAgent(Agent(cfg, backend=SimBackend.from_profile("t4")))
    with contextlib.suppress(ConfigError):  # raised by start() unless the agent was seen ready first
        ra.start()
    ra._thread.join(10)
    assert isinstance(ra.error, ConfigError)
    assert "gpunode.dra.enabled" in str(ra.error) and "node's name" in str(ra.error)
    assert "\n" not in str(ra.error)
    assert not (sockdir / "plugins_registry").exists()  # nothing served


def test_a_gpu_a_time_slicing_list_names_is_published_time_sliced_by_the_agent(
    sockdir: Path, kubelet: KubeletStandIn
) -> None:
    """sharing.timeSlicing lists GPU 0 (DRA's) and GPU 2 (the device plugin's): the agent publishes GPU 0
    time-sliced in 3 through DRA, GPU 1 shared by memory, and the device plugin advertises GPU 2's three
    replicas and GPU 3 whole."""
    api = FakeApi()
    api.slices = []
    doc = {"sharing": {"timeSlicing": {"resources": [{"name": GPU, "replicas": 3, "devices": [0, 2]}]}}}
    ra = start(sockdir, api, doc, devices=[0, 1])
    try:
        gpus = ra.agent.backend.gpus()

        def devices() -> dict[str, dict[str, Any]]:
            return {d["name"]: d for s in list(api.slices) for d in s["spec"].get("devices", [])}

        wait_for(lambda: len(devices()) == 4, "the node's four DRA devices")
        sliced = devices()[f"{gpus[0].uuid.lower()}-timesliced"]
        assert sliced["capacity"][names.CAPACITY_REPLICAS]["value"] == "3"
        assert sliced["attributes"][names.ATTR_SHARING]["string"] == names.SHARING_TIME_SLICED
        assert f"{gpus[1].uuid.lower()}-shared" in devices()
        assert f"{gpus[0].uuid.lower()}-shared" not in devices()
        kubelet.wait_for_resources([GPU])
        wait_for(lambda: len(kubelet.healthy(GPU)) == 4, "the device plugin's devices")
        held = sorted(d.split("::")[0] for d in kubelet.healthy(GPU))
        assert held == sorted([gpus[2].uuid] * 3 + [gpus[3].uuid])
    finally:
        ra.stop()
        api.close()
