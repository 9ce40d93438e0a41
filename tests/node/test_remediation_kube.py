"""KubeRemediator against the pod-resources stand-in (real Unix socket) and the API server stand-in (loopback HTTP)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import shutil
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from gpunode.config.health import RemediationConfig
from gpunode.contract.names import UNHEALTHY_GPUS_ANNOTATION as ANNOTATION
from gpunode.infra.kube import KubeClient
from gpunode.node.health.actions import ActionRecord
from gpunode.node.health.model import Fault
from gpunode.node.health.remediation import KubeRemediator
from gpunode.node.kubelet.podresources import ContainerDevices
from tests.fakes.apiserver import ApiServerStandIn
from tests.fakes.kubelet import short_socket_dir
from tests.fakes.podresources import PodResourcesStandIn

NODE = "node-a"
G0, G1 = "GPU-aaaaaaaa-0000-0000-0000-000000000000", "GPU-bbbbbbbb-1111-1111-1111-111111111111"
FAST = RemediationConfig(
    retry_initial_s=0.02, retry_max_s=0.1, eviction_deadline_s=5.0, request_timeout_s=0.5, max_evictions=100
)


def fault(gpu: str = G0, ids: tuple[str, ...] | None = None, xid: int = 79) -> Fault:
    return Fault(
        target_uuid=gpu,
        gpu_uuid=gpu,
        mig_uuid=None,
        kind="xid",
        reason=f"XID {xid} (GPU has fallen off the bus): needs a GPU reset",
        xid=xid,
        device_ids=ids if ids is not None else (gpu,),
    )


class Setup:
    def __init__(self, directory: Path, config: RemediationConfig) -> None:
        self.api = ApiServerStandIn().start()
        self.api.add_node(NODE)
        self.podres = PodResourcesStandIn(str(directory / "pr.sock")).start()
        self.remediator = KubeRemediator(
            config,
            node_name=NODE,
            pod_resources_socket=self.podres.socket_path,
            client_factory=lambda: KubeClient.for_host(
                self.api.url, request_timeout_s=config.request_timeout_s
            ),
        )

    def pods(self, *placement: tuple[str, str]) -> dict[str, str]:
        """(pod, device ID) pairs -> the pods' UIDs; each pod gets one container with its devices."""
        records: dict[str, list[str]] = {}
        for pod, device in placement:
            records.setdefault(pod, []).append(device)
        self.podres.set_pods(
            ContainerDevices("team", pod, "main", "nvidia.com/gpu", tuple(ids))
            for pod, ids in records.items()
        )
        return {pod: self.api.add_pod("team", pod, node_name=NODE) for pod in records}

    def records(self, action: str, result: str | None = None) -> list[ActionRecord]:
        return [r for r in self.remediator.journal.records(action) if result is None or r.result == result]

    async def until(self, predicate: Callable[[], bool], what: str, timeout: float = 10.0) -> None:
        deadline = asyncio.get_running_loop().time() + timeout
        while not predicate():
            if asyncio.get_running_loop().time() > deadline:
                raise TimeoutError(
                    f"timed out waiting for {what}; journal: {self.remediator.journal.records()}"
                )
            await asyncio.sleep(0.01)

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[Setup]:
        ready = asyncio.Event()
        task = asyncio.create_task(self.remediator.run(ready=ready))
        await ready.wait()
        try:
            yield self
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            self.api.stop()
            self.podres.stop()


@pytest.fixture
def directory() -> Iterator[Path]:
    d = short_socket_dir("gnr")
    yield d
    shutil.rmtree(d, ignore_errors=True)


def run(directory: Path, config: RemediationConfig, scenario: Callable[[Setup], object]) -> None:
    async def main() -> None:
        async with Setup(directory, config).running() as s:
            await scenario(s)  # type: ignore[misc]

    asyncio.run(main())


def test_evicts_only_the_pods_on_the_failed_gpu_and_tells_everyone(directory: Path) -> None:
    async def scenario(s: Setup) -> None:
        uids = s.pods(("on-g0", G0), ("on-g1", G1))
        s.remediator.notify({G0: "XID 79"}, [fault(G0)])
        await s.until(lambda: len(s.records("evict", "requested")) == 1, "the eviction")
        assert s.api.evictions() == [("team", "on-g0")]
        assert s.api.pods() == [("team", "on-g1")]
        body = s.api.requests("POST", "/eviction$")[0].body
        assert body["deleteOptions"]["preconditions"] == {"uid": uids["on-g0"]}
        await s.until(lambda: len(s.api.events()) == 2, "a node and a pod Event")
        by_kind = {e["involvedObject"]["kind"]: e for e in s.api.events()}
        assert by_kind["Node"]["reason"] == "GpuUnhealthy"
        assert G0 in by_kind["Node"]["message"] and "XID 79" in by_kind["Node"]["message"]
        assert by_kind["Pod"]["reason"] == "GpuFaultEviction"
        assert by_kind["Pod"]["involvedObject"]["uid"] == uids["on-g0"]
        assert G0 in by_kind["Pod"]["message"] and "XID 79" in by_kind["Pod"]["message"]
        await s.until(
            lambda: ANNOTATION in s.api.node(NODE)["metadata"]["annotations"], "the node annotation"
        )
        assert json.loads(s.api.node(NODE)["metadata"]["annotations"][ANNOTATION]) == {G0: "XID 79"}

    run(directory, FAST, scenario)


def test_pdb_429_is_retried_until_the_eviction_is_allowed(directory: Path) -> None:
    async def scenario(s: Setup) -> None:
        s.pods(("guarded", G0))
        s.api.block_evictions("team", "guarded", times=3)
        s.remediator.notify({G0: "x"}, [fault()])
        await s.until(lambda: len(s.records("evict", "requested")) == 1, "the eviction")
        assert len(s.api.evictions()) == 4  # three 429s, then 201
        (blocked,) = s.records("evict", "blocked")
        assert "disruption budget" in blocked.detail
        assert s.records("evict", "requested")[0].attempts == 4
        assert s.api.pods() == []

    run(directory, FAST, scenario)


@pytest.mark.parametrize(
    "delete", [pytest.param(True, id="then-delete"), pytest.param(False, id="then-give-up")]
)
def test_eviction_deadline(directory: Path, delete: bool) -> None:
    config = replace(FAST, eviction_deadline_s=0.3, delete_after_deadline=delete)

    async def scenario(s: Setup) -> None:
        s.pods(("guarded", G0))
        s.api.block_evictions("team", "guarded")  # forever
        s.remediator.notify({G0: "x"}, [fault()])
        if delete:
            await s.until(lambda: bool(s.records("delete", "done")), "the deletion")
            assert s.api.pods() == []
            assert s.api.requests("DELETE")[0].path == "/api/v1/namespaces/team/pods/guarded"
            reason = "GpuFaultDeleted"
        else:
            await s.until(lambda: bool(s.records("evict", "failed")), "the eviction to give up")
            assert s.api.pods() == [("team", "guarded")]
            assert s.api.requests("DELETE") == []
            assert "not evicted within 0.3 s" in s.records("evict", "failed")[0].detail
            reason = "GpuFaultEvictionFailed"
        await s.until(lambda: any(e["reason"] == reason for e in s.api.events()), f"a {reason} Event")

    run(directory, config, scenario)


def test_dry_run_only_reports(directory: Path) -> None:
    async def scenario(s: Setup) -> None:
        s.pods(("a", G0), ("b", G0))
        s.remediator.notify({G0: "x"}, [fault()])
        await s.until(lambda: len(s.records("evict", "dry-run")) == 2, "two dry-run records")
        await s.until(lambda: len(s.api.events()) == 3, "the Events")
        assert all(e["message"].startswith("[dry-run] ") for e in s.api.events())
        assert s.api.evictions() == [] and s.api.requests("DELETE") == [] and s.api.requests("PATCH") == []
        assert s.api.pods() == [("team", "a"), ("team", "b")]
        assert s.records("annotate-node", "dry-run")

    run(directory, replace(FAST, dry_run=True), scenario)


def test_each_pod_is_evicted_once_however_often_its_gpus_fail(directory: Path) -> None:
    async def scenario(s: Setup) -> None:
        s.pods(("two-gpus", G0), ("two-gpus", G1))
        s.api.block_evictions("team", "two-gpus", times=2)  # still blocked when the other faults arrive
        s.remediator.notify({G0: "x"}, [fault(G0)])
        s.remediator.notify({G0: "x", G1: "y"}, [fault(G1), fault(G0)])
        await s.until(lambda: len(s.records("evict", "requested")) == 1, "the eviction")
        await s.until(lambda: len(s.records("evict", "skipped")) == 2, "the repeats to be skipped")
        assert len(s.api.evictions()) == 3  # one eviction: two 429s and the success
        # The pod comes back under the same name (a StatefulSet): a new UID is a new pod.
        s.api.add_pod("team", "two-gpus", node_name=NODE)
        s.remediator.notify({G0: "x"}, [fault(G0)])
        await s.until(lambda: len(s.records("evict", "requested")) == 2, "the new pod's eviction")

    run(directory, FAST, scenario)


def test_a_terminating_pod_is_not_evicted_again(directory: Path) -> None:
    async def scenario(s: Setup) -> None:
        s.pods(("slow-to-stop", G0))
        s.api.set_termination(30.0)
        s.remediator.notify({G0: "x"}, [fault(G0)])
        await s.until(lambda: len(s.records("evict", "requested")) == 1, "the eviction")
        assert s.api.pods() == [("team", "slow-to-stop")]  # still terminating
        s.remediator.notify({G0: "x"}, [fault(G0)])  # the GPU flaps
        await s.until(lambda: len(s.records("evict", "skipped")) == 1, "the repeat to be skipped")
        assert "evicted once already" in s.records("evict", "skipped")[0].detail
        assert len(s.api.evictions()) == 1

    run(directory, FAST, scenario)


def test_node_wide_rate_limit(directory: Path) -> None:
    config = replace(FAST, max_evictions=2, eviction_interval_s=600.0)

    async def scenario(s: Setup) -> None:
        s.pods(*[(f"p{i}", G0) for i in range(5)])
        s.remediator.notify({G0: "x"}, [fault()])
        await s.until(lambda: len(s.api.evictions()) == 2, "two evictions")
        await asyncio.sleep(0.3)  # the others wait for the next tokens, minutes away
        assert len(s.api.evictions()) == 2
        assert len(s.api.pods()) == 3

    run(directory, config, scenario)


def test_forbidden_eviction_is_not_retried(directory: Path) -> None:
    async def scenario(s: Setup) -> None:
        s.pods(("p", G0))
        s.api.fail("POST", r"/eviction$", 403, times=None)
        s.remediator.notify({G0: "x"}, [fault()])
        await s.until(lambda: bool(s.records("evict", "failed")), "the failure")
        assert len(s.api.evictions()) == 1
        assert "403" in s.records("evict", "failed")[0].detail

    run(directory, FAST, scenario)


def test_server_errors_and_timeouts_are_retried(directory: Path) -> None:
    async def scenario(s: Setup) -> None:
        s.pods(("p", G0))
        s.api.fail("GET", r"/pods/p$", 500, times=2)
        s.api.fail("POST", r"/eviction$", 503, times=2)
        s.remediator.notify({G0: "x"}, [fault()])
        await s.until(lambda: bool(s.records("evict", "requested")), "the eviction")
        assert len(s.api.requests("GET", r"/pods/p$")) == 3
        assert s.records("evict", "requested")[0].attempts == 3

    run(directory, FAST, scenario)


def test_a_replaced_pod_is_not_evicted(directory: Path) -> None:
    async def scenario(s: Setup) -> None:
        s.pods(("p", G0))
        s.api.hang(r"/eviction$", 0.2)  # the pod is replaced while the first eviction is on its way
        s.remediator.notify({G0: "x"}, [fault()])
        await s.until(lambda: len(s.api.evictions()) == 1, "the eviction request")
        s.api.add_pod("team", "p", node_name=NODE, uid="replacement")
        await s.until(lambda: bool(s.records("evict", "gone")), "the conflict")
        assert s.api.pods() == [("team", "p")]

    run(directory, FAST, scenario)


def test_missing_pod_resources_socket_is_reported(directory: Path) -> None:
    async def scenario(s: Setup) -> None:
        s.podres.stop()
        s.remediator.notify({G0: "x"}, [fault()])
        await s.until(lambda: bool(s.records("lookup", "failed")), "the failed lookup")
        assert "does not exist" in s.records("lookup", "failed")[0].detail
        await s.until(lambda: len(s.api.events()) == 1, "the node Event")  # still posted
        assert s.api.evictions() == []

    run(directory, FAST, scenario)


def test_annotation_follows_the_level_and_stale_ones_are_cleared(directory: Path) -> None:
    async def scenario(s: Setup) -> None:
        await s.until(lambda: bool(s.records("annotate-node", "done")), "the first annotation")
        s.remediator.notify({G0: "a", G1: "b"}, [])
        await s.until(
            lambda: (
                s.api.node(NODE)["metadata"]["annotations"].get(ANNOTATION) == json.dumps({G0: "a", G1: "b"})
            ),
            "both GPUs in the annotation",
        )
        s.remediator.notify({G1: "b"}, [])
        await s.until(
            lambda: s.api.node(NODE)["metadata"]["annotations"].get(ANNOTATION) == json.dumps({G1: "b"}),
            "one GPU left",
        )
        await s.until(lambda: any(e["reason"] == "GpuHealthy" for e in s.api.events()), "a recovery Event")
        s.remediator.notify({}, [])
        await s.until(lambda: ANNOTATION not in s.api.node(NODE)["metadata"]["annotations"], "no annotation")

    def start_with_a_stale_annotation(directory: Path) -> None:
        async def main() -> None:
            setup = Setup(directory, FAST)
            setup.api.node(NODE)  # exists
            with setup.api._cond:
                setup.api._state.nodes[NODE]["metadata"]["annotations"][ANNOTATION] = '{"GPU-old": "stale"}'
            async with setup.running() as s:
                await s.until(
                    lambda: ANNOTATION not in s.api.node(NODE)["metadata"]["annotations"],
                    "the stale one removed",
                )
                await scenario(s)

        asyncio.run(main())

    start_with_a_stale_annotation(directory)


def test_api_server_down_then_back(directory: Path) -> None:
    async def scenario(s: Setup) -> None:
        s.pods(("p", G0))
        s.api.stop()
        s.remediator.notify({G0: "x"}, [fault()])
        await asyncio.sleep(0.3)  # retries against a closed port
        assert s.records("evict", "requested") == []
        s.api.start()
        await s.until(lambda: bool(s.records("evict", "requested")), "the eviction once the server is back")
        await s.until(
            lambda: bool(s.records("annotate-node", "done")), "the annotation once the server is back"
        )

    run(directory, FAST, scenario)


def test_a_cleared_device_gets_an_event_naming_who_cleared_it(directory: Path) -> None:
    async def scenario(s: Setup) -> None:
        s.remediator.notify({G0: "XID 79", G1: "XID 48"}, [])
        await s.until(lambda: bool(s.records("annotate-node", "done")), "the annotation")
        s.remediator.note_recovery(G0, "GpuHealthCleared", "cleared by alice: reseated the card")
        s.remediator.notify({G1: "XID 48"}, [])
        await s.until(lambda: any(e["reason"] == "GpuHealthCleared" for e in s.api.events()), "the Event")
        (event,) = [e for e in s.api.events() if e["reason"] == "GpuHealthCleared"]
        assert event["type"] == "Normal" and G0 in event["message"]
        assert event["message"].endswith("cleared by alice: reseated the card")
        assert not any(e["reason"] == "GpuHealthy" for e in s.api.events())

    run(directory, FAST, scenario)
