"""The queue controller (gpunode queue) against the API server stand-in: watches, admission annotations,
quota holds, reclaim with notice and eviction, restarts, configuration reloads and leader election.

Every wait is on a condition with a generous limit; nothing asserts how fast anything happens.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from lightkube.resources.core_v1 import Node, Pod

from gpunode.cluster.queuectl.controller import WATCHED, QueueController
from gpunode.cluster.queuectl.core import QueueCore
from gpunode.contract.names import (
    NODE_STATE_ANNOTATION,
    PREEMPTION_NOTICE_ANNOTATION,
    QUEUE_ADMITTED_ANNOTATION,
    QUEUE_REASON_ANNOTATION,
)
from gpunode.infra.kube import ElectionConfig, KubeClient, LeaderElector, LeaseLock
from tests.cluster.queuectl.helpers import CONFIG_YAML, config, node_annotation, pod
from tests.fakes.apiserver import ApiServerStandIn

WAIT_S = 60.0


@pytest.fixture
def api() -> Iterator[ApiServerStandIn]:
    with ApiServerStandIn() as server:
        yield server


def controller(api: ApiServerStandIn, *, identity: str = "q-0", **kw: Any) -> QueueController:
    client = KubeClient.for_host(api.url)
    kw.setdefault("resync_s", 0.5)
    kw.setdefault("settle_s", 0.05)
    return QueueController(client, QueueCore(kw.pop("cfg", None) or config()), identity=identity, **kw)


async def until(predicate: Callable[[], bool], what: str, timeout: float = WAIT_S) -> None:
    async with asyncio.timeout(timeout):
        while not predicate():
            await asyncio.sleep(0.05)
    assert predicate(), what


@contextlib.asynccontextmanager
async def running(ctl: QueueController) -> Any:
    task = asyncio.create_task(ctl.run())
    try:
        yield task
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await ctl.client.close()


def admission(api: ApiServerStandIn, name: str, namespace: str = "ml") -> dict[str, Any] | None:
    text = (api.pod(namespace, name)["metadata"].get("annotations") or {}).get(QUEUE_ADMITTED_ANNOTATION)
    return json.loads(text) if text else None


def annotation(api: ApiServerStandIn, name: str, key: str, namespace: str = "ml") -> str | None:
    with contextlib.suppress(KeyError):
        return (api.pod(namespace, name)["metadata"].get("annotations") or {}).get(key)
    return None


def admission_patches(api: ApiServerStandIn, name: str) -> int:
    return sum(
        1
        for r in api.requests("PATCH", rf"/pods/{name}$")
        if QUEUE_ADMITTED_ANNOTATION in ((r.body or {}).get("metadata") or {}).get("annotations", {})
    )


def add_node(api: ApiServerStandIn, name: str, gpus: int = 8) -> None:
    api.add_node(name, annotations={NODE_STATE_ANNOTATION: node_annotation(name, gpus)})


def test_a_gang_of_four_is_admitted_together_with_a_plan_for_each_member(api: ApiServerStandIn) -> None:
    add_node(api, "n1", 2)
    add_node(api, "n2", 2)

    async def main() -> None:
        ctl = controller(api)
        async with running(ctl):
            for i in range(3):
                api.put_pod(pod(f"g{i}", gang="g", size=4))
            await until(lambda: len(getattr(ctl.core.last_jobs.get("ml/g"), "members", ())) == 3, "3 seen")
            assert all(admission(api, f"g{i}") is None for i in range(3))  # an incomplete gang waits whole
            api.put_pod(pod("g3", gang="g", size=4))
            await until(lambda: all(admission(api, f"g{i}") for i in range(4)), "gang admitted")
            # Events are the reconcile's stage after the marks: wait while the controller still runs.
            await until(
                lambda: len([e for e in api.events() if e["reason"] == "QueueAdmitted"]) == 4, "events"
            )
        plans = [admission(api, f"g{i}") for i in range(4)]
        assert {p["job"] for p in plans if p} == {"ml/g"}
        places = {(p["node"], g) for p in plans if p for g in p["gpus"]}
        assert len(places) == 4 and {n for n, _ in places} == {"n1", "n2"}  # 2 GPUs per node: spread
        for i, p in enumerate(plans):
            assert p is not None and p["uid"] == api.pod("ml", f"g{i}")["metadata"]["uid"]
        events = [e for e in api.events() if e["reason"] == "QueueAdmitted"]
        assert sorted(e["involvedObject"]["name"] for e in events) == ["g0", "g1", "g2", "g3"]

    asyncio.run(main())


def gang_is_whole(api: ApiServerStandIn, n: int) -> bool:
    """Every member carries one admission of the gang (the same moment), on distinct GPUs."""
    plans = [admission(api, f"g{i}") for i in range(n)]
    if not all(plans):
        return False
    places = {(p["node"], g) for p in plans if p for g in p["gpus"]}
    return len({p["at"] for p in plans if p}) == 1 and len(places) == n


def test_a_gang_whose_admission_fails_part_way_is_undone_and_admitted_whole(api: ApiServerStandIn) -> None:
    add_node(api, "n1", 2)
    add_node(api, "n2", 2)
    api.fail("PATCH", r"/pods/g2$", 500, times=1)  # one member's mark is refused, the others land

    async def main() -> None:
        ctl = controller(api)
        async with running(ctl):
            for i in range(4):
                api.put_pod(pod(f"g{i}", gang="g", size=4))
            await until(
                lambda: gang_is_whole(api, 4) and admission_patches(api, "g2") == 2, "gang re-admitted"
            )
        assert [e for e in api.events() if e["reason"] == "QueueAdmissionUndone"]
        removals = [
            r
            for r in api.requests("PATCH", r"/pods/g[013]$")
            if (r.body["metadata"]["annotations"] or {}).get(QUEUE_ADMITTED_ANNOTATION, "") is None
        ]
        assert len(removals) == 3  # the members that got the first admission had it taken off

    asyncio.run(main())


def test_a_gang_left_part_way_marked_by_a_previous_leader_is_admitted_whole(api: ApiServerStandIn) -> None:
    add_node(api, "n1", 4)
    for i in range(4):
        member = pod(f"g{i}", gang="g", size=4)
        if i < 2:  # a leader that stopped after two of the four marks
            member["metadata"]["uid"] = f"uid-g{i}"
            mark = {"job": "ml/g", "uid": f"uid-g{i}", "node": "n1", "gpus": [f"GPU-n1-{i}"]}
            member["metadata"]["annotations"] = {
                QUEUE_ADMITTED_ANNOTATION: json.dumps({**mark, "at": "2026-01-01T00:00:00.000000Z"})
            }
        api.put_pod(member)

    async def main() -> None:
        ctl = controller(api)
        async with running(ctl):
            await until(lambda: gang_is_whole(api, 4), "gang admitted whole")
        assert admission(api, "g0")["at"] != "2026-01-01T00:00:00.000000Z"  # type: ignore[index]

    asyncio.run(main())


class _LosesLead:
    """A leader elector whose lead ends after `checks` leadership checks."""

    def __init__(self, checks: int) -> None:
        self.left = checks

    def is_leader(self) -> bool:
        self.left -= 1
        return self.left >= 0


def test_no_write_is_sent_after_the_lead_is_lost_among_concurrent_writes(api: ApiServerStandIn) -> None:
    add_node(api, "n1", 8)
    add_node(api, "n2", 8)
    for i in range(16):
        api.put_pod(pod(f"p{i}"))

    async def main() -> None:
        ctl = controller(api, elector=_LosesLead(1 + 5))  # this reconcile's own check, then 5 writes
        pods, _ = await ctl.client.list_json(Pod)
        nodes, _ = await ctl.client.list_json(Node)
        ctl.core.replace_all(pods, nodes)
        ctl._synced = set(WATCHED)
        try:
            actions = await ctl.reconcile_once()
        finally:
            await ctl.client.close()
        assert actions is not None and len(actions.admitted_jobs) == 8  # team-a's quota; the others wait
        assert len(actions.annotate) > 5
        assert len(api.requests("PATCH")) == 5 and not api.events()  # 5 written, then the lead ended
        assert len(ctl.core.written) == 5  # the 3 admissions not written are read from the pods again

    asyncio.run(main())


def queued_to(api: ApiServerStandIn) -> set[str]:
    """The pods that got a Queued event."""
    return {e["involvedObject"]["name"] for e in api.events() if e["reason"] == "Queued"}


def test_a_queue_over_its_quota_is_held_with_the_reason(api: ApiServerStandIn) -> None:
    add_node(api, "n1", 8)

    async def main() -> None:
        ctl = controller(api)
        async with running(ctl):
            for i in range(3):  # 3 x 2 GPUs: team-b may hold 4
                api.put_pod(pod(f"b{i}", gang="b", size=3, queue="team-b", gpus=2))
            api.put_pod(pod("a0", queue="team-a", gpus=2))
            await until(lambda: admission(api, "a0") is not None, "team-a admitted")
            await until(lambda: annotation(api, "b0", QUEUE_REASON_ANNOTATION) is not None, "reason written")
            # the Events follow every pod's annotations: wait for them before the controller stops
            await until(lambda: {"b0", "b1", "b2"} <= queued_to(api), "Queued events")
        reason = annotation(api, "b0", QUEUE_REASON_ANNOTATION)
        assert reason is not None and reason.startswith(
            "queued in team-b, position 1: team-b is over its quota"
        )
        assert all(admission(api, f"b{i}") is None for i in range(3))
        queued = [e for e in api.events() if e["reason"] == "Queued"]
        assert {e["involvedObject"]["name"] for e in queued} == {"b0", "b1", "b2"}

    asyncio.run(main())


def test_borrowing_then_reclaim_with_notice_then_eviction(api: ApiServerStandIn) -> None:
    add_node(api, "n1", 8)

    async def main() -> None:
        ctl = controller(api)
        async with running(ctl):
            api.put_pod(pod("a0", gpus=4, created="2026-01-01T00:00:00Z"))
            api.put_pod(pod("a1", gpus=4, created="2026-01-01T00:00:01Z"))  # borrowed: above team-a's 4
            await until(
                lambda: admission(api, "a0") is not None and admission(api, "a1") is not None, "borrow"
            )
            api.put_pod(pod("b0", queue="team-b", gpus=4))  # team-b below its guarantee: reclaims
            await until(
                lambda: any(annotation(api, n, PREEMPTION_NOTICE_ANNOTATION) for n in ("a0", "a1")), "notice"
            )
            noticed = [
                n for n in ("a0", "a1") if annotation(api, n, PREEMPTION_NOTICE_ANNOTATION) is not None
            ]
            assert len(noticed) == 1  # one 4-GPU job makes room for 4 GPUs
            victim, kept = noticed[0], ({"a0", "a1"} - set(noticed)).pop()
            notice = json.loads(annotation(api, victim, PREEMPTION_NOTICE_ANNOTATION) or "{}")
            assert notice["preemptor"] == "ml/b0" and notice["reason"] == "reclaim"
            assert admission(api, "b0") is None  # not before its victim is gone
            await until(lambda: ("ml", victim) not in api.pods(), "victim evicted")
            await until(lambda: admission(api, "b0") is not None, "preemptor admitted")
        assert ("ml", victim) in api.evictions() and ("ml", kept) in api.pods()
        evictions = api.requests("POST", r"/eviction$")
        assert evictions[-1].body["apiVersion"] == "policy/v1"
        preempting = [e for e in api.events() if e["reason"] == "Preempting"]
        assert preempting and all("ml/b0" in e["message"] for e in preempting)
        assert {e["involvedObject"]["name"] for e in preempting} == {victim}
        kept_gpus = set(admission(api, kept)["gpus"])  # type: ignore[index]
        assert not kept_gpus & set(admission(api, "b0")["gpus"])  # type: ignore[index]

    asyncio.run(main())


def test_a_restarted_controller_rebuilds_its_state_and_admits_nothing_twice(api: ApiServerStandIn) -> None:
    add_node(api, "n1", 8)

    async def main() -> None:
        first = controller(api, identity="q-0")
        async with running(first):
            api.put_pod(pod("a0", gpus=4))
            await until(lambda: admission(api, "a0") is not None, "a0 admitted")
        before = admission(api, "a0")
        second = controller(api, identity="q-1")
        async with running(second):
            api.put_pod(pod("b0", queue="team-b", gpus=4))
            api.put_pod(pod("a1", queue="team-a", gpus=4))  # no room left: a0 and b0 hold all 8
            await until(lambda: admission(api, "b0") is not None, "b0 admitted")
            await until(lambda: annotation(api, "a1", QUEUE_REASON_ANNOTATION) is not None, "a1 waits")
        assert admission(api, "a0") == before and admission_patches(api, "a0") == 1
        assert admission(api, "a1") is None
        assert not set(before["gpus"]) & set(admission(api, "b0")["gpus"])  # type: ignore[index]

    asyncio.run(main())


def test_a_bad_configuration_is_refused_and_the_running_one_stays(
    api: ApiServerStandIn, tmp_path: Path
) -> None:
    add_node(api, "n1", 8)
    path = tmp_path / "queues.yaml"
    path.write_text(CONFIG_YAML)

    async def main() -> None:
        ctl = controller(api, config_path=path, reload_s=0.1)
        async with running(ctl):
            path.write_text(CONFIG_YAML.replace("borrowLimit: {gpu: 0}", "borowLimit: {gpu: 0}"))
            await until(lambda: bool(ctl.config_error), "bad file seen")
            assert "queues[1]: unknown key borowLimit" in ctl.config_error
            api.put_pod(pod("a0", gpus=1))
            await until(lambda: admission(api, "a0") is not None, "admitted under the old configuration")
            assert ctl.core.config.queues["team-b"].borrow_limit == {"gpu": 0}
            assert b"gpunode_queue_config_refused_total 1.0" in ctl.metrics.render()
            path.write_text(
                CONFIG_YAML.replace("preemption:", "  - name: team-c\n    guarantee: {gpu: 1}\npreemption:")
            )
            api.put_pod(pod("c0", queue="team-c", gpus=1))
            await until(lambda: admission(api, "c0") is not None, "new configuration taken")
            assert ctl.config_error == ""

    asyncio.run(main())


def test_a_namespace_mapped_in_the_reloaded_file_has_its_pods_admitted(
    api: ApiServerStandIn, tmp_path: Path
) -> None:
    add_node(api, "n1", 8)
    path = tmp_path / "queues.yaml"
    path.write_text(CONFIG_YAML)

    async def main() -> None:
        ctl = controller(api, config_path=path, reload_s=0.1)
        async with running(ctl):
            api.put_pod(pod("r0", queue=None, namespace="research", gpus=1))  # no label, no mapping yet
            api.put_pod(pod("a0", gpus=1))
            await until(lambda: admission(api, "a0") is not None, "the labelled pod admitted")
            assert admission(api, "r0", namespace="research") is None
            path.write_text(CONFIG_YAML + "namespaces: {research: team-b}\n")
            await until(lambda: admission(api, "r0", namespace="research") is not None, "mapped pod admitted")
            assert ctl.core.config.namespaces == {"research": "team-b"}
        r0 = admission(api, "r0", namespace="research")
        assert r0 is not None and r0["job"] == "research/r0"
        assert ctl.core.last_jobs["research/r0"].queue == "team-b"

    asyncio.run(main())


def test_two_controllers_with_leader_election_only_the_leader_acts(api: ApiServerStandIn) -> None:
    add_node(api, "n1", 8)

    def elected(identity: str) -> QueueController:
        ctl = controller(api, identity=identity)
        cfg = ElectionConfig("gpu-system", "gpunode-queue", identity, 3.0, 2.0, 0.5)
        ctl.elector = LeaderElector(LeaseLock(ctl.client, "gpu-system", "gpunode-queue"), cfg)
        return ctl

    async def main() -> None:
        a, b = elected("q-a"), elected("q-b")
        tasks = {a.identity: asyncio.create_task(a.run()), b.identity: asyncio.create_task(b.run())}
        try:
            await until(lambda: a.leading() or b.leading(), "a leader")
            leader, standby = (a, b) if a.leading() else (b, a)
            api.put_pod(pod("a0", gpus=2))
            await until(lambda: admission(api, "a0") is not None, "a0 admitted")
            assert standby.reconciles == 0 and not standby.leading()
            await until(lambda: any(e["reason"] == "QueueAdmitted" for e in api.events()), "admission event")
            assert {e["source"]["host"] for e in api.events()} == {leader.identity}
            tasks[leader.identity].cancel()  # the leader stops (and releases the Lease)
            await asyncio.gather(tasks[leader.identity], return_exceptions=True)
            api.put_pod(pod("a1", gpus=2))
            await until(lambda: admission(api, "a1") is not None, "the standby took over")
            assert standby.reconciles > 0 and standby.leading()
            assert admission_patches(api, "a0") == 1 and admission_patches(api, "a1") == 1
            assert not set(admission(api, "a0")["gpus"]) & set(admission(api, "a1")["gpus"])  # type: ignore[index]
        finally:
            for t in tasks.values():
                t.cancel()
            await asyncio.gather(*tasks.values(), return_exceptions=True)
            await a.client.close()
            await b.client.close()

    asyncio.run(main())


def test_metrics_are_served_over_http(api: ApiServerStandIn) -> None:
    add_node(api, "n1", 8)

    async def main() -> None:
        ctl = controller(api)
        server = ctl.metrics.server("127.0.0.1", 0)
        await server.start()
        try:
            async with running(ctl):
                api.put_pod(pod("a0", gpus=2))
                await until(lambda: admission(api, "a0") is not None, "a0 admitted")
                async with aiohttp.ClientSession() as http:
                    async with http.get(f"http://127.0.0.1:{server.port}/metrics") as r:
                        text = await r.text()
                    async with http.get(f"http://127.0.0.1:{server.port}/other") as r:
                        assert r.status == 404
        finally:
            await server.stop()
        assert 'gpunode_queue_admitted_jobs{queue="team-a"} 1.0' in text
        assert 'gpunode_queue_gpus_used{queue="team-a"} 2.0' in text
        assert 'gpunode_queue_admissions_total{queue="team-a"} 1.0' in text
        assert 'gpunode_queue_wait_seconds_count{queue="team-a"} 1.0' in text

    asyncio.run(main())


def test_an_eviction_a_disruption_budget_refuses_is_asked_again(api: ApiServerStandIn) -> None:
    add_node(api, "n1", 8)
    for name in ("a0", "a1"):
        api.block_evictions("ml", name, times=2)  # whichever is the victim: refused twice, then allowed

    async def main() -> None:
        ctl = controller(api)
        async with running(ctl):
            api.put_pod(pod("a0", gpus=4, created="2026-01-01T00:00:00Z"))
            api.put_pod(pod("a1", gpus=4, created="2026-01-01T00:00:01Z"))
            await until(
                lambda: admission(api, "a0") is not None and admission(api, "a1") is not None, "borrow"
            )
            api.put_pod(pod("b0", queue="team-b", gpus=4))
            await until(lambda: len(api.pods()) == 2, "victim evicted")
            await until(lambda: admission(api, "b0") is not None, "preemptor admitted")
        (victim,) = {"a0", "a1"} - {n for _, n in api.pods()}
        assert api.evictions().count(("ml", victim)) == 3
        survivor = ({"a0", "a1"} - {victim}).pop()
        assert ("ml", survivor) not in api.evictions()

    asyncio.run(main())
