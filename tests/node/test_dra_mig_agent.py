"""`gpunode agent` with dynamic MIG partitioning on the simulated a100-mig node, GPU 4 half partitioned
by its operator: the agent publishes the free half's placements, a claim for one is prepared over the
kubelet's gRPC as an instance created for it, the agent rediscovers it (its device state lists the new
instance), and unpreparing destroys it and is rediscovered too."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import grpc

from gpunode.contract import dra as names
from gpunode.node.agent import Agent
from gpunode.node.devices.simnode.backend import SimBackend
from gpunode.node.dra.slices import mig_device_name
from gpunode.node.kubelet._proto import dra_v1_pb2 as v1
from gpunode.node.kubelet._proto import dra_v1_pb2_grpc as v1_grpc
from tests.agentrunner import RunningAgent, make_config
from tests.fakes.kubelet import KubeletStandIn
from tests.node.dra_world import DRIVER, NODE, FakeApi, claim
from tests.node.test_dra_agent import wait_for


def call(sockdir: Path, obj: dict[str, Any], method: str) -> Any:
    async def run() -> Any:
        path = sockdir / "plugins" / DRIVER / "dra.sock"
        m = obj["metadata"]
        claims = [v1.Claim(namespace=m["namespace"], uid=m["uid"], name=m["name"])]
        async with grpc.aio.insecure_channel(f"unix://{path}") as ch:
            stub = v1_grpc.DRAPluginStub(ch)
            if method == "prepare":
                return await stub.NodePrepareResources(
                    v1.NodePrepareResourcesRequest(claims=claims), timeout=10
                )
            return await stub.NodeUnprepareResources(
                v1.NodeUnprepareResourcesRequest(claims=claims), timeout=10
            )

    return asyncio.run(run())


def test_the_agent_creates_rediscovers_and_destroys_a_claims_mig_instance(
    sockdir: Path, kubelet: KubeletStandIn
) -> None:
    backend = SimBackend.from_profile("a100-mig")
    gpu = backend.gpus()[4]
    [half] = [m for m in gpu.mig_devices if m.start == 4]
    backend.destroy_mig(half.uuid)  # the operator frees memory slices 4-7
    [operators] = [m.uuid for m in backend.gpus()[4].mig_devices]
    api = FakeApi()
    api.slices = []
    cfg = make_config(
        sockdir / "device-plugins",
        sockdir / "state",
        None,
        nodeName=NODE,
        nodeState={"enabled": False},
        remediation={"kubeconfig": str(api.kubeconfig(sockdir / "kubeconfig"))},
        dra={"enabled": True, "cdiDir": str(sockdir / "cdi"), "devices": [4]},
    )
    ra = RunningAgent(Agent(cfg, backend=backend)).start()
    try:

        def placements() -> set[str]:
            return {
                d["name"]
                for s in list(api.slices)
                for d in s["spec"].get("devices", [])
                if d["attributes"].get(names.ATTR_TYPE, {}).get("string") == names.TYPE_MIG
            }

        wait_for(placements, "GPU 4's MIG placements in the slices")
        assert mig_device_name(gpu.uuid, "1g.10gb", 5) in placements()
        assert mig_device_name(gpu.uuid, "1g.10gb", 2) not in placements()  # on the operator's instance
        pool = next(s["spec"]["pool"]["name"] for s in api.slices if s["spec"].get("devices"))
        obj = claim("mig", device=mig_device_name(gpu.uuid, "1g.10gb", 5), pool=pool, memory=None, share=None)
        api.add(obj)
        answer = call(sockdir, obj, "prepare").claims[obj["metadata"]["uid"]]
        assert answer.error == ""
        spec = json.loads((sockdir / "cdi" / f"{DRIVER}-{obj['metadata']['uid']}.json").read_text())
        created = spec["containerEdits"]["env"][0].removeprefix("NVIDIA_VISIBLE_DEVICES=")
        assert created in {m.uuid for m in backend.gpus()[4].mig_devices} and created != operators

        def known(uuid: str) -> bool:
            state = ra.agent.state
            assert state is not None
            return any(m.uuid == uuid for g in state.snapshot().inventory.gpus for m in g.mig_devices)

        wait_for(lambda: known(created), "the agent's rediscovery of the created instance")
        assert call(sockdir, obj, "unprepare").claims[obj["metadata"]["uid"]].error == ""
        assert [m.uuid for m in backend.gpus()[4].mig_devices] == [operators]
        wait_for(lambda: not known(created), "the agent's rediscovery of the destroyed instance")
        assert known(operators)
    finally:
        ra.stop()
        api.close()
