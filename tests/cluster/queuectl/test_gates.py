"""Pods held by the scheduling gate gpunode.io/admission: the controller's release, and the webhook's patch."""

from __future__ import annotations

import asyncio
import base64
import datetime
import json
import ssl
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gpunode.cluster.queuectl.core import QueueCore
from gpunode.cluster.queuectl.gates import add_gate_patch, gated, release_spec
from gpunode.cluster.queuectl.webhook import AdmissionWebhook, review_response
from gpunode.contract.names import (
    ADMISSION_GATE,
    ADMISSION_WEBHOOK_PATH,
    QUEUE_ADMITTED_ANNOTATION,
    QUEUE_LABEL,
    QUEUE_REASON_ANNOTATION,
)
from gpunode.errors import InvalidRequest
from tests.cluster.queuectl.helpers import config, node, pod
from tests.cluster.queuectl.test_controller import add_node, admission, controller, running, until
from tests.e2e.pki import CertificateAuthority
from tests.fakes.apiserver import ApiServerStandIn

OTHER_GATE = {"name": "example.com/other"}


@pytest.fixture
def api() -> Iterator[ApiServerStandIn]:
    with ApiServerStandIn() as server:
        yield server


def gated_pod(name: str, uid: str, **kw: Any) -> dict[str, Any]:
    p = pod(name, **kw)
    p["metadata"]["uid"] = uid
    p["spec"]["schedulingGates"] = [{"name": ADMISSION_GATE}]
    return p


def write_back(core: QueueCore, actions: Any, *, release: bool = True) -> None:
    """What the API server would make of the actions: annotations, and (with `release`) the releases."""
    for a in actions.annotate:
        notes = core.pods[a.pod.key]["metadata"].setdefault("annotations", {})  # type: ignore[index]
        for k, v in a.annotations.items():
            if v is None:
                notes.pop(k, None)
            else:
                notes[k] = v
    for r in actions.release if release else ():
        spec = core.pods[r.pod.key]["spec"]
        spec.update(r.spec)  # type: ignore[attr-defined]
        if r.spec["schedulingGates"] is None:
            del spec["schedulingGates"]  # type: ignore[attr-defined]


def mark(core: QueueCore, key: str) -> dict[str, Any] | None:
    text = core.pods[key]["metadata"].get("annotations", {}).get(QUEUE_ADMITTED_ANNOTATION)
    return json.loads(text) if text else None


def pinned_node(p: Any) -> list[str]:
    terms = p["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][
        "nodeSelectorTerms"
    ]
    return [v for t in terms for f in t["matchFields"] if f["key"] == "metadata.name" for v in f["values"]]


# ----- the controller ---------------------------------------------------------------------------------


def test_a_gated_gang_is_marked_then_each_member_released_to_its_planned_node() -> None:
    core = QueueCore(config())
    core.node_changed(node("n1", 4))
    core.node_changed(node("n2", 4))
    for i in range(4):
        core.pod_changed(gated_pod(f"g{i}", f"u{i}", gang="g", size=4, gpus=2))
    actions = core.reconcile(1000.0)
    assert actions.admitted_jobs == ["ml/g"]
    assert sorted(r.pod.name for r in actions.release) == ["g0", "g1", "g2", "g3"]
    assert {r.job for r in actions.release} == {"ml/g"}
    write_back(core, actions)
    for i in range(4):
        p = core.pods[f"ml/g{i}"]
        m = mark(core, f"ml/g{i}")
        assert m is not None and not gated(p)
        assert pinned_node(p) == [m["node"]], p["spec"]
    assert core.reconcile(1001.0).release == []  # released once


def test_marks_left_by_a_leader_stopped_before_releasing_are_released_by_the_next() -> None:
    first = QueueCore(config())
    first.node_changed(node("n1", 8))
    for i in range(4):
        first.pod_changed(gated_pod(f"g{i}", f"u{i}", gang="g", size=4))
    actions = first.reconcile(1000.0)
    write_back(first, actions, release=False)  # the leader was killed after the marks, before releasing
    second = QueueCore(config())
    second.node_changed(node("n1", 8))
    for p in first.pods.values():
        second.pod_changed(json.loads(json.dumps(p)))
    again = second.reconcile(1010.0)
    assert (
        again.admitted_jobs == []
        and [a for a in again.annotate if QUEUE_ADMITTED_ANNOTATION in a.annotations] == []
    )
    assert sorted(r.pod.name for r in again.release) == ["g0", "g1", "g2", "g3"]
    for r in again.release:
        assert r.node == mark(second, r.pod.key)["node"]  # type: ignore[index]


def test_a_gated_gang_marked_part_way_is_undone_and_none_of_it_released() -> None:
    first = QueueCore(config())
    first.node_changed(node("n1", 8))
    for i in range(4):
        first.pod_changed(gated_pod(f"g{i}", f"u{i}", gang="g", size=4))
    actions = first.reconcile(1000.0)
    actions.annotate = [a for a in actions.annotate if a.pod.name in ("g0", "g1")]  # killed after two marks
    write_back(first, actions, release=False)
    second = QueueCore(config())
    second.node_changed(node("n1", 8))
    for p in first.pods.values():
        second.pod_changed(json.loads(json.dumps(p)))
    undo = second.reconcile(1010.0)
    assert undo.release == []
    removed = {a.pod.name for a in undo.annotate if a.annotations.get(QUEUE_ADMITTED_ANNOTATION, "") is None}
    assert removed == {"g0", "g1"}
    write_back(second, undo)
    assert all(gated(p) for p in second.pods.values())


def test_a_released_pod_whose_release_failed_is_released_again() -> None:
    core = QueueCore(config())
    core.node_changed(node("n1", 8))
    core.pod_changed(gated_pod("one", "u1"))
    actions = core.reconcile(1000.0)
    write_back(core, actions, release=False)
    (r,) = actions.release
    core.release_failed(r.pod.uid)
    (again,) = core.reconcile(1001.0).release
    assert again.pod == r.pod and again.node == r.node


def test_a_gated_pod_over_its_quota_stays_gated_with_the_reason() -> None:
    core = QueueCore(config())
    core.node_changed(node("n1", 8))
    core.pod_changed(gated_pod("big", "u1", queue="team-b", gpus=6))  # team-b may hold 4
    actions = core.reconcile(1000.0)
    assert actions.release == [] and actions.admitted_jobs == []
    write_back(core, actions)
    p = core.pods["ml/big"]
    assert gated(p) and "team-b" in p["metadata"]["annotations"][QUEUE_REASON_ANNOTATION]


def test_an_ungated_pod_is_admitted_by_its_mark_alone() -> None:
    core = QueueCore(config())
    core.node_changed(node("n1", 8))
    plain = pod("plain")
    plain["metadata"]["uid"] = "u1"
    core.pod_changed(plain)
    actions = core.reconcile(1000.0)
    assert actions.admitted_jobs == ["ml/plain"] and actions.release == []


# ----- the release's spec --------------------------------------------------------------------------------


def test_release_keeps_the_pods_own_terms_and_other_gates_and_adds_the_node_to_each_term() -> None:
    p = gated_pod("x", "u")
    p["spec"]["schedulingGates"].insert(0, OTHER_GATE)
    own = {"matchExpressions": [{"key": "zone", "operator": "In", "values": ["a"]}]}
    p["spec"]["affinity"] = {
        "nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [own, own]}}
    }
    spec = release_spec(p, "n7")
    assert spec["schedulingGates"] == [OTHER_GATE]
    terms = spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][
        "nodeSelectorTerms"
    ]
    want = {"key": "metadata.name", "operator": "In", "values": ["n7"]}
    assert terms == [{**own, "matchFields": [want]}, {**own, "matchFields": [want]}]
    assert release_spec(gated_pod("y", "u"), "n7")["schedulingGates"] is None


# ----- the webhook ---------------------------------------------------------------------------------------


def review(obj: Any, *, operation: str = "CREATE", namespace: str = "ml") -> dict[str, Any]:
    return {
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "request": {
            "uid": "r-1",
            "kind": {"group": "", "version": "v1", "kind": "Pod"},
            "operation": operation,
            "namespace": namespace,
            "object": obj,
        },
    }


def patch_of(answer: dict[str, Any]) -> list[dict[str, Any]] | None:
    resp = answer["response"]
    assert resp["uid"] == "r-1" and resp["allowed"] is True
    return json.loads(base64.b64decode(resp["patch"])) if "patch" in resp else None


def test_the_webhook_gates_governed_pods_only() -> None:
    assert patch_of(review_response(review(pod("a")), {})) == [
        {"op": "add", "path": "/spec/schedulingGates", "value": [{"name": ADMISSION_GATE}]}
    ]
    with_other = pod("b")
    with_other["spec"]["schedulingGates"] = [OTHER_GATE]
    assert patch_of(review_response(review(with_other), {})) == [
        {"op": "add", "path": "/spec/schedulingGates/-", "value": {"name": ADMISSION_GATE}}
    ]
    assert patch_of(review_response(review(gated_pod("c", "")), {})) is None  # has it already
    no_gpu = pod("d", gpus=0)
    assert patch_of(review_response(review(no_gpu), {})) is None  # labelled, but asks for no GPU
    unlabelled = pod("e", queue=None)
    del unlabelled["metadata"]["namespace"]  # as at creation: the review names it
    assert patch_of(review_response(review(unlabelled), {})) is None
    assert patch_of(review_response(review(unlabelled), {"ml": "team-a"})) is not None  # mapped namespace
    assert patch_of(review_response(review(pod("f"), operation="UPDATE"), {})) is None


@pytest.mark.parametrize(
    "bad", [None, [], {"apiVersion": "admission.k8s.io/v1beta1"}, {"apiVersion": "admission.k8s.io/v1"}]
)
def test_the_webhook_refuses_what_is_not_a_review_in_one_line(bad: Any) -> None:
    with pytest.raises(InvalidRequest) as info:
        review_response(bad, {})
    assert "\n" not in str(info.value)


def _post(port: int, ca: Path, body: bytes) -> tuple[int, bytes]:
    ctx = ssl.create_default_context(cafile=str(ca))
    req = urllib.request.Request(
        f"https://127.0.0.1:{port}{ADMISSION_WEBHOOK_PATH}",
        data=body,
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(req, timeout=10, context=ctx) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as err:
        return err.code, err.read()


def test_the_webhook_answers_over_tls_and_takes_a_renewed_certificate(tmp_path: Path) -> None:
    ca = CertificateAuthority(tmp_path)
    now = datetime.datetime.now(datetime.UTC)
    old = (now - datetime.timedelta(days=2), now - datetime.timedelta(days=1))
    files = ca.issue("hook", common_name="hook", server=True, hosts=("127.0.0.1",), valid=old)

    async def main() -> None:
        hook = AdmissionWebhook(
            lambda: {}, host="127.0.0.1", port=0, cert_file=str(files.cert), key_file=str(files.key)
        )
        await hook.start()
        try:
            body = json.dumps(review(pod("a", queue="team-a"))).encode()
            with pytest.raises(urllib.error.URLError, match="expired"):
                await asyncio.to_thread(_post, hook.server.port, ca.cert, body)
            ca.issue("hook", common_name="hook", server=True, hosts=("127.0.0.1",))  # renewed in place
            assert hook.certificates.reload()
            status, answer = await asyncio.to_thread(_post, hook.server.port, ca.cert, body)
            assert status == 200 and patch_of(json.loads(answer)) is not None
            status, answer = await asyncio.to_thread(_post, hook.server.port, ca.cert, b"{not json")
            assert status == 400 and answer == b"the body is not JSON\n"
            files.key.write_text("not a key")  # a bad renewal: the last good pair stays
            assert not hook.certificates.reload()
            status, _ = await asyncio.to_thread(_post, hook.server.port, ca.cert, body)
            assert status == 200 and hook.reviews == 2
        finally:
            await hook.stop()

    asyncio.run(main())


def test_an_unaffected_pod_needs_no_patch() -> None:
    p = pod("x")
    p["spec"]["schedulingGates"] = [{"name": ADMISSION_GATE}]
    assert add_gate_patch(p) == [] and gated(p)
    assert QUEUE_LABEL in p["metadata"]["labels"]


# ----- the live controller against the API server stand-in ------------------------------------------


def _spec_patches(api: ApiServerStandIn) -> list[Any]:
    return [r for r in api.requests("PATCH", r"/pods/") if "spec" in (r.body or {})]


def test_the_controller_sends_every_mark_before_any_release(api: ApiServerStandIn) -> None:
    add_node(api, "n1", 2)
    add_node(api, "n2", 2)
    for i in range(4):
        member = pod(f"g{i}", gang="g", size=4)
        member["spec"]["schedulingGates"] = [{"name": ADMISSION_GATE}]
        api.put_pod(member)

    async def main() -> None:
        ctl = controller(api)
        async with running(ctl):
            await until(lambda: len(_spec_patches(api)) == 4, "four releases")
        writes = api.requests("PATCH", r"/pods/g\d$")
        kinds = ["spec" if "spec" in (r.body or {}) else "mark" for r in writes]
        assert kinds == ["mark"] * 4 + ["spec"] * 4, kinds
        for r in _spec_patches(api):
            name = r.path.rsplit("/", 1)[1]
            mark = admission(api, name)
            assert mark is not None
            terms = r.body["spec"]["affinity"]["nodeAffinity"][
                "requiredDuringSchedulingIgnoredDuringExecution"
            ]
            assert terms["nodeSelectorTerms"] == [
                {"matchFields": [{"key": "metadata.name", "operator": "In", "values": [mark["node"]]}]}
            ]
            assert r.body["spec"]["schedulingGates"] is None

    asyncio.run(main())


def test_no_member_is_released_when_a_mark_of_its_gang_fails(api: ApiServerStandIn) -> None:
    add_node(api, "n1", 2)
    add_node(api, "n2", 2)
    api.fail("PATCH", r"/pods/g2$", 500, times=1)  # one member's mark is refused, the others land
    for i in range(4):
        member = pod(f"g{i}", gang="g", size=4)
        member["spec"]["schedulingGates"] = [{"name": ADMISSION_GATE}]
        api.put_pod(member)

    async def main() -> None:
        ctl = controller(api)
        async with running(ctl):
            await until(lambda: len(_spec_patches(api)) == 4, "the gang released once re-admitted whole")
        writes = api.requests("PATCH", r"/pods/g\d$")
        first_release = next(i for i, r in enumerate(writes) if "spec" in (r.body or {}))
        undone = [
            r
            for r in writes[:first_release]
            if ((r.body or {}).get("metadata") or {})
            .get("annotations", {})
            .get(QUEUE_ADMITTED_ANNOTATION, "")
            is None
        ]
        assert len(undone) == 3, writes  # the part-way admission was undone before anything was released
        marks = {admission(api, f"g{i}")["at"] for i in range(4)}  # type: ignore[index]
        assert len(marks) == 1

    asyncio.run(main())
