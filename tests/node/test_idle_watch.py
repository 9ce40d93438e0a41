"""The idle-GPU watch on its own: bounded memory, and failures that never end it."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import pytest

import gpunode.node.idle as idle_mod
from gpunode.config.agent import parse_config
from gpunode.config.idle import IdleConfig
from gpunode.errors import KubeError, KubeUnreachable
from gpunode.infra.kube import KubeClient
from gpunode.node.devices.simnode.backend import SimBackend
from gpunode.node.idle import IdleWatch
from gpunode.node.inventory import build_inventory
from gpunode.node.kubelet.podresources import ContainerDevices


def no_api() -> KubeClient:
    raise KubeUnreachable("no API server here", hint="none needed")


def make_watch(listing: list[Sequence[ContainerDevices] | BaseException]) -> tuple[IdleWatch, SimBackend]:
    """A watch whose kubelet answers `listing` in turn (the last answer again and again)."""
    backend = SimBackend.from_profile("t4")
    inventory = build_inventory(backend.gpus(), parse_config({}, "c.yaml"))

    async def list_containers() -> Sequence[ContainerDevices]:
        answer = listing[0] if len(listing) == 1 else listing.pop(0)
        if isinstance(answer, BaseException):
            raise answer
        return answer

    watch = IdleWatch(
        config=IdleConfig(enabled=True, for_s=1.0, interval_s=0.01),
        backend=backend,
        inventory=lambda: inventory,
        list_containers=list_containers,
        client_factory=no_api,
    )
    return watch, backend


def pods(n: int, gpu_uuid: str) -> list[ContainerDevices]:
    return [ContainerDevices("ns", f"p-{i:05d}", "c", "nvidia.com/gpu", (gpu_uuid,)) for i in range(n)]


def test_a_flood_of_pods_is_bounded_and_vanished_pods_are_forgotten(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(idle_mod, "MAX_TRACKED_PODS", 50)
    backend = SimBackend.from_profile("t4")
    uuid = backend.gpus()[0].uuid
    flood = pods(5000, uuid)  # a kubelet answer naming far more pods than a node runs
    watch, _ = make_watch([flood, flood[:3]])

    asyncio.run(watch.round())
    assert len(watch.pods) == 50 and len(watch.view()) == 50
    asyncio.run(watch.round())
    assert sorted(watch.pods) == [("ns", "p-00000"), ("ns", "p-00001"), ("ns", "p-00002")]
    assert len(watch.view()) == 3
    assert watch.api_errors >= 1  # no API server: counted, not raised


def test_kubelet_failures_and_unexpected_errors_never_end_the_watch(caplog: pytest.LogCaptureFixture) -> None:
    backend = SimBackend.from_profile("t4")
    uuid = backend.gpus()[0].uuid
    good = pods(1, uuid)
    failure = KubeError("pod-resources List failed (UNAVAILABLE)", hint="check the kubelet")
    watch, _ = make_watch([good, failure, failure, RuntimeError("a bug"), good])

    async def main() -> None:
        task = asyncio.create_task(watch.run())
        for _ in range(2000):
            if watch.rounds >= 3:
                break
            await asyncio.sleep(0.01)
        assert not task.done()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    assert watch.rounds >= 3
    assert list(watch.pods) == [("ns", "p-00000")]  # kept through the failed listings
    said = [r.getMessage() for r in caplog.records if "pod-resources list failed" in r.getMessage()]
    assert len(said) == 1  # two failures in a row, said once
    assert any("failed unexpectedly" in r.getMessage() for r in caplog.records)
