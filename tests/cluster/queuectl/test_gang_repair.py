"""Gangs admitted part-way, with a member already bound: completed on the plan their marks began when the
rest fits, else undone (marks removed, bound members evicted) so that no partial gang holds GPUs.

The first tests run the controller against the API server stand-in; the others drive QueueCore directly,
down to every state a gang of three can be left in. Waits are on conditions with generous limits.
"""

from __future__ import annotations

import asyncio
import itertools
import json
from collections.abc import Iterator
from typing import Any

import pytest

from gpunode.cluster.queuectl.core import QueueCore
from gpunode.cluster.queuectl.repair import partly_marked
from gpunode.cluster.queuectl.writes import Actions
from gpunode.contract.names import NODE_STATE_ANNOTATION, QUEUE_ADMITTED_ANNOTATION, QUEUE_REASON_ANNOTATION
from tests.cluster.queuectl.helpers import config, node, node_annotation, pod
from tests.cluster.queuectl.test_controller import (
    admission,
    admission_patches,
    annotation,
    controller,
    gang_is_whole,
    running,
    until,
)
from tests.fakes.apiserver import ApiServerStandIn

AT = "2026-01-01T00:00:00.000000Z"  # when the previous leader admitted the gang
LATER = "2026-01-01T00:05:00.000000Z"


@pytest.fixture
def api() -> Iterator[ApiServerStandIn]:
    with ApiServerStandIn() as server:
        yield server


def member(
    i: int,
    *,
    size: int = 4,
    mark: tuple[str, str] | None = None,
    bound: str | None = None,
    at: str = AT,
    job: str = "ml/g",
    mark_uid: str | None = None,
) -> dict[str, Any]:
    """Member g<i> of gang ml/g; `mark`: (node, GPU) of its admission mark; `bound`: the node it runs on."""
    p = pod(f"g{i}", gang="g", size=size)
    p["metadata"]["uid"] = f"uid-g{i}"
    if mark is not None:
        doc = {"job": job, "uid": mark_uid or f"uid-g{i}", "node": mark[0], "gpus": [mark[1]], "at": at}
        p["metadata"]["annotations"] = {QUEUE_ADMITTED_ANNOTATION: json.dumps(doc)}
    if bound is not None:
        p["spec"]["nodeName"] = bound
        p["status"]["phase"] = "Running"
    return p


def events(api: ApiServerStandIn, reason: str) -> list[dict[str, Any]]:
    return [e for e in api.events() if e["reason"] == reason]


def repairs(text: bytes, outcome: str) -> float:
    prefix = f'gpunode_queue_gang_repairs_total{{outcome="{outcome}"}} '.encode()
    line = next(line for line in text.splitlines() if line.startswith(prefix))
    return float(line[len(prefix) :])


def test_a_bound_partial_gang_with_room_for_the_rest_is_completed_on_its_plan(api: ApiServerStandIn) -> None:
    api.add_node("n1", annotations={NODE_STATE_ANNOTATION: node_annotation("n1", 2, held={0: "ml/g0"})})
    api.add_node("n2", annotations={NODE_STATE_ANNOTATION: node_annotation("n2", 2)})
    api.put_pod(member(0, mark=("n1", "GPU-n1-0"), bound="n1"))  # scheduled before the leader died
    api.put_pod(member(1, mark=("n1", "GPU-n1-1")))
    api.put_pod(member(2))
    api.put_pod(member(3))

    async def main() -> bytes:
        ctl = controller(api)
        async with running(ctl):
            await until(lambda: all(admission(api, f"g{i}") for i in range(4)), "gang completed")
            await until(lambda: repairs(ctl.metrics.render(), "completed") == 1.0, "repair counted")
            await until(lambda: len(events(api, "QueueAdmissionCompleted")) == 2, "the Events")
            await asyncio.sleep(1.0)  # a few more reconciles: nothing else may follow
            return ctl.metrics.render()

    text = asyncio.run(main())
    assert gang_is_whole(api, 4)  # one admission: one moment, distinct GPUs
    plans = [admission(api, f"g{i}") for i in range(4)]
    assert all(p is not None and p["at"] == AT and p["job"] == "ml/g" for p in plans)
    assert plans[0]["gpus"] == ["GPU-n1-0"] and plans[1]["gpus"] == ["GPU-n1-1"]  # type: ignore[index]
    assert {p["node"] for p in plans[2:] if p} == {"n2"}  # the rest placed beside the marked members
    for i in range(4):
        assert admission(api, f"g{i}")["uid"] == f"uid-g{i}"  # type: ignore[index]
    assert admission_patches(api, "g0") == 0 and admission_patches(api, "g1") == 0  # their marks stay
    assert admission_patches(api, "g2") == 1 and admission_patches(api, "g3") == 1
    assert api.evictions() == [] and len(api.pods()) == 4
    assert sorted(e["involvedObject"]["name"] for e in events(api, "QueueAdmissionCompleted")) == ["g2", "g3"]
    assert not events(api, "QueueAdmissionUndone")
    assert repairs(text, "completed") == 1.0 and repairs(text, "undone") == 0.0


def test_a_bound_partial_gang_without_room_is_undone_and_queued_again_whole(api: ApiServerStandIn) -> None:
    held = {0: "ml/g0", 2: "other/x", 3: "other/y"}  # other pods took the GPUs the rest needed
    api.add_node("n1", annotations={NODE_STATE_ANNOTATION: node_annotation("n1", 4, held=held)})
    api.put_pod(member(0, mark=("n1", "GPU-n1-0"), bound="n1"))
    api.put_pod(member(1, mark=("n1", "GPU-n1-1")))
    api.put_pod(member(2))
    api.put_pod(member(3))

    async def main() -> bytes:
        ctl = controller(api)
        async with running(ctl):
            await until(lambda: ("ml", "g0") not in api.pods(), "the bound member evicted")
            await until(lambda: admission(api, "g1") is None, "the mark removed")
            undone = annotation(api, "g2", QUEUE_REASON_ANNOTATION) or ""
            assert "ml/g was admitted part-way and undone" in undone and "do not fit" in undone
            api.put_pod(pod("g0", gang="g", size=4))  # its owner creates the member again
            await until(
                lambda: all(
                    (annotation(api, f"g{i}", QUEUE_REASON_ANNOTATION) or "").startswith("queued in team-a")
                    for i in range(4)
                ),
                "the gang queued again as one job",
            )
            await until(
                lambda: (
                    {"g0", "g1"} <= {e["involvedObject"]["name"] for e in events(api, "QueueAdmissionUndone")}
                ),
                "the Events",
            )
            return ctl.metrics.render()

    text = asyncio.run(main())
    assert set(api.evictions()) == {("ml", "g0")}  # asked again only while the watch had not shown it gone
    assert all(admission(api, f"g{i}") is None for i in range(4))
    for i in range(4):
        assert (annotation(api, f"g{i}", QUEUE_REASON_ANNOTATION) or "").startswith(
            "queued in team-a, position 1"
        )
    undone = events(api, "QueueAdmissionUndone")
    assert {e["involvedObject"]["name"] for e in undone} == {"g0", "g1"}
    assert any("evicted" in e["message"] for e in undone if e["involvedObject"]["name"] == "g0")
    assert repairs(text, "undone") == 1.0 and repairs(text, "completed") == 0.0


def test_a_bound_partial_gang_with_two_plans_is_undone_then_admitted_whole(api: ApiServerStandIn) -> None:
    api.add_node("n1", annotations={NODE_STATE_ANNOTATION: node_annotation("n1", 8, held={0: "ml/g0"})})
    api.put_pod(member(0, mark=("n1", "GPU-n1-0"), bound="n1"))
    api.put_pod(member(1, mark=("n1", "GPU-n1-1"), at=LATER))  # another admission: room, but not one plan
    api.put_pod(member(2))
    api.put_pod(member(3))

    async def main() -> None:
        ctl = controller(api)
        async with running(ctl):
            await until(lambda: ("ml", "g0") not in api.pods(), "the bound member evicted")
            assert repairs(ctl.metrics.render(), "undone") == 1.0
            assert repairs(ctl.metrics.render(), "completed") == 0.0
            api.put_pod(pod("g0", gang="g", size=4))
            await until(lambda: gang_is_whole(api, 4), "admitted anew, whole")

    asyncio.run(main())
    assert set(api.evictions()) == {("ml", "g0")}  # asked again only while the watch had not shown it gone
    plans = [admission(api, f"g{i}") for i in range(4)]
    assert all(p is not None and p["at"] not in (AT, LATER) for p in plans)
    assert any("2 different admissions" in e["message"] for e in events(api, "QueueAdmissionUndone"))


# ----- the core alone -------------------------------------------------------------------------------------


def apply(core: QueueCore, now: float) -> Actions:
    """One reconcile with its annotations written back onto the pods; evictions are refused (a
    PodDisruptionBudget): the pods stay."""
    actions = core.reconcile(now)
    for a in actions.annotate:
        notes = core.pods[a.pod.key]["metadata"].setdefault("annotations", {})  # type: ignore[index]
        for k, v in a.annotations.items():
            if v is None:
                notes.pop(k, None)
            else:
                notes[k] = v
    return actions


def core_with(nodes: list[dict[str, Any]], members: list[dict[str, Any]]) -> QueueCore:
    core = QueueCore(config())
    for n in nodes:
        core.node_changed(n)
    for m in members:
        core.pod_changed(m)
    return core


BOUND = member(0, mark=("n1", "GPU-n1-0"), bound="n1")  # a member scheduled before the leader died
REST = [member(2), member(3)]  # members the leader did not mark


@pytest.mark.parametrize(
    ("members", "why"),
    [
        (
            [BOUND, member(1, mark=("n1", "GPU-n1-1"), at=LATER), *REST],
            "its marks record 2 different admissions",
        ),
        (
            [BOUND, member(1, mark=("n1", "GPU-n1-1"), mark_uid="x"), *REST],
            "pod ml/g1 carries an admission mark that is not its own",
        ),
        (
            [BOUND, member(1, mark=("n1", "GPU-n1-1"), job="ml/z"), *REST],
            "the mark of pod ml/g1 names job 'ml/z'",
        ),
        (
            [member(0, mark=("n2", "GPU-n2-0"), bound="n1"), member(1, mark=("n2", "GPU-n2-1")), *REST],
            "pod ml/g0 is bound to node n1, its mark names node n2",
        ),
        (
            [member(0, bound="n1"), member(1, mark=("n1", "GPU-n1-1")), *REST],
            "bound to node n1 without an admission",
        ),
        ([BOUND, member(1, mark=("n1", "GPU-n1-1")), member(2)], "3 of its 4 members exist"),
        (
            [member(0, size=3, mark=("n1", "GPU-n1-0"), bound="n1"), *(member(i, size=3) for i in (1, 2, 3))],
            "gang ml/g has 4 pods, more than its gpunode.io/gang-size of 3",
        ),
        ([member(0, mark=("n1", "GPU-n1-0")), member(1), *REST], "none of its members is bound"),
    ],
    ids=[
        "two-plans",
        "foreign-uid",
        "other-job",
        "bound-elsewhere",
        "bound-unmarked",
        "missing",
        "size",
        "unbound",
    ],
)
def test_a_partial_gang_that_cannot_be_completed_is_undone(members: list[dict[str, Any]], why: str) -> None:
    core = core_with([node("n1", 8), node("n2", 8)], members)  # room for anything: the marks decide
    actions = apply(core, 1000.0)
    assert actions.repairs == [("ml/g", "undone")]
    bound = {m["metadata"]["name"] for m in members if m["spec"].get("nodeName")}
    assert {r.name for r in actions.evict} == bound
    unbound = [m for m in members if not m["spec"].get("nodeName")]
    for m in unbound:
        notes = core.pods[f"ml/{m['metadata']['name']}"]["metadata"]["annotations"]
        assert QUEUE_ADMITTED_ANNOTATION not in notes  # foreign marks removed too
        assert why in notes[QUEUE_REASON_ANNOTATION]
    again = apply(core, 1001.0)  # the evictions were refused: asked again, decided once
    assert again.repairs == [] and {r.name for r in again.evict} == bound


STATES = ("waiting", "marked", "bound", "bound-unmarked")


def gang_member(i: int, state: str) -> dict[str, Any]:
    place = ("n1", f"GPU-n1-{i}")
    if state == "marked":
        return member(i, size=3, mark=place)
    if state == "bound":
        return member(i, size=3, mark=place, bound="n1")
    if state == "bound-unmarked":
        return member(i, size=3, bound="n1")
    return member(i, size=3)


@pytest.mark.parametrize("room", [True, False])
def test_no_bound_partial_gang_is_left_alone_across_a_cycle(room: bool) -> None:
    """Every state a gang of 3 can be found in, with and without room for it; the evictions refused, and a
    new leader taking over at the end: at every reconcile where the pods show a partial gang holding a bound
    member, that reconcile either marks all its other members on one plan or evicts every bound member."""
    held = {} if room else {1: "other/x", 2: "other/y"}
    seen = {"completed": 0, "undone": 0}
    for states in itertools.product(STATES, repeat=3):
        core = core_with([node("n1", 4, held=held)], [gang_member(i, s) for i, s in enumerate(states)])
        for step in range(4):
            if step == 3:  # a new leader on the pods as they are now
                core = core_with([node("n1", 4, held=held)], list(core.pods.values()))
            before = {key: json.loads(json.dumps(p)) for key, p in core.pods.items()}
            actions = apply(core, 1000.0 + step)
            j = core.last_jobs["ml/g"]
            assert [m.key for m in j.members] == sorted(before)  # the pods as they were at this reconcile
            if not partly_marked(j) or not any(m.node for m in j.members):
                continue
            evicted = {r.key for r in actions.evict}
            bound = {m.key for m in j.members if m.node}
            marked_now = {a.pod.key for a in actions.annotate if a.annotations.get(QUEUE_ADMITTED_ANNOTATION)}
            rest = {m.key for m in j.members if not m.node and m.admitted is None}
            assert bound <= evicted or (rest and rest <= marked_now), (states, step)
            if bound <= evicted:
                seen["undone"] += 1
                assert not marked_now, (states, step)
                continue
            seen["completed"] += 1  # one plan: the marked members' places kept, the others beside them
            docs = [
                json.loads(core.pods[m.key]["metadata"]["annotations"][QUEUE_ADMITTED_ANNOTATION])
                for m in j.members
            ]
            assert len({d["at"] for d in docs}) == 1 and len({g for d in docs for g in d["gpus"]}) == 3
            for m in j.members:
                if m.admitted is not None:
                    assert (
                        before[m.key]["metadata"]["annotations"]
                        == core.pods[m.key]["metadata"]["annotations"]
                    )
    assert seen["undone"] > 0
    assert (seen["completed"] > 0) == room
