"""The extender's prioritize-claims verb (gpunode.cluster.extender.drasteer): nodes ranked for pods whose
ResourceClaims ask gpunode's DRA devices, by the placement policy on the nodes' DRA GPUs as their claims
hold them; the fast path for pods without claims; hostile pods and claims."""

from __future__ import annotations

import http.client
import json
import time
from collections.abc import Iterator
from typing import Any

import pytest

from gpunode.cluster.extender.claims import ClaimView
from gpunode.cluster.extender.core import Extender, ExtenderConfig
from gpunode.cluster.extender.drasteer import (
    Assumed,
    claim_request,
    dra_state,
    pod_claim_refs,
    read_claim,
    with_assumed,
)
from gpunode.cluster.extender.server import ExtenderServer
from gpunode.contract.dra import CLASS_MIG, CLASS_SHARED, CLASS_TIME_SLICED, CLASS_WHOLE, DEFAULT_DRIVER
from gpunode.contract.draclaims import gpu_device_name, shared_device_name
from gpunode.contract.names import GIB, NODE_STATE_ANNOTATION, Sharing
from gpunode.contract.nodestate import encode
from gpunode.placement import GpuState, NodeState, Request, place
from gpunode.placement.published import published_state

NS = "team-a"
NODES = ("full", "half", "empty")


def uuid(node: str, i: int) -> str:
    return f"GPU-{node}-0000-0000-0000-00000000000{i}"


def node_state(name: str, *, dra: int = 4, plugin: int = 0) -> NodeState:
    """`dra` T4s (16 GiB) served through DRA, then `plugin` served by the device plugin."""
    gpus = [
        GpuState(
            uuid=uuid(name, i),
            index=i,
            model="Tesla T4",
            milli_free=1000,
            memory_total_bytes=16 * GIB,
            memory_free_bytes=16 * GIB,
            numa_node=0,
            sharing=Sharing.DRA if i < dra else Sharing.FRACTIONAL,
            serves_whole=i >= dra,
        )
        for i in range(dra + plugin)
    ]
    return NodeState(name, tuple(gpus), cpu_milli_free=8000, memory_free_bytes=64 * GIB)


def node_json(s: NodeState) -> dict[str, Any]:
    text = encode(published_state(s, updated=time.time()))
    return {
        "metadata": {"name": s.name, "annotations": {NODE_STATE_ANNOTATION: text}},
        "status": {"allocatable": {"cpu": "8", "memory": "64Gi"}},
    }


def allocated(name: str, node: str, device: str, memory: str | None = None) -> dict[str, Any]:
    result: dict[str, Any] = {"request": "gpu", "driver": DEFAULT_DRIVER, "pool": node, "device": device}
    if memory is not None:
        result["consumedCapacity"] = {"memory": memory}
    return {
        "metadata": {"namespace": "other", "name": name, "uid": f"uid-{name}"},
        "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": CLASS_SHARED}}]}},
        "status": {"allocation": {"devices": {"results": [result]}}},
    }


def pending(name: str, requests: Any, *, ns: str = NS, status: Any = None) -> dict[str, Any]:
    claim: dict[str, Any] = {
        "metadata": {"namespace": ns, "name": name, "uid": f"uid-{name}"},
        "spec": {"devices": {"requests": requests}},
    }
    if status is not None:
        claim["status"] = status
    return claim


def share(gib: float | str, cls: str = CLASS_SHARED) -> list[dict[str, Any]]:
    memory = gib if isinstance(gib, str) else f"{gib}Gi"
    return [
        {"name": "gpu", "exactly": {"deviceClassName": cls, "capacity": {"requests": {"memory": memory}}}}
    ]


def whole(count: int = 1) -> list[dict[str, Any]]:
    return [{"name": "gpus", "exactly": {"deviceClassName": CLASS_WHOLE, "count": count}}]


def pod(*claims: Any, ns: str = NS, uid: str = "pod-uid", statuses: Any = None) -> dict[str, Any]:
    spec: dict[str, Any] = {"containers": [{"name": "main", "image": "x"}]}
    if claims:
        spec["resourceClaims"] = list(claims)
    out: dict[str, Any] = {"metadata": {"namespace": ns, "name": "p", "uid": uid}, "spec": spec}
    if statuses is not None:
        out["status"] = {"resourceClaimStatuses": statuses}
    return out


def by_name(name: str) -> dict[str, Any]:
    return {"name": "gpu", "resourceClaimName": name}


def args(p: dict[str, Any], nodes: tuple[str, ...] = NODES) -> dict[str, Any]:
    return {"Pod": p, "NodeNames": list(nodes)}


@pytest.fixture
def extender() -> Extender:
    """Three nodes of four DRA T4s: `full` holds 10 GiB of GPU 0 and GPU 1 whole, `half` 4 GiB of GPU 0,
    `empty` nothing; a fourth, `plugin`, has only device-plugin GPUs."""
    ext = Extender(config=ExtenderConfig(policy="gpunode"))
    ext.nodes.dra = ClaimView(DEFAULT_DRIVER, reader=read_claim(DEFAULT_DRIVER))
    ext.refresh_nodes(
        [node_json(node_state(n)) for n in NODES] + [node_json(node_state("plugin", dra=0, plugin=4))]
    )
    ext.nodes.dra.replace_all(
        [
            allocated("a", "full", shared_device_name(uuid("full", 0)), "10Gi"),
            allocated("b", "full", gpu_device_name(uuid("full", 1))),
            allocated("c", "half", shared_device_name(uuid("half", 0)), "4Gi"),
        ]
    )
    return ext


def scores(answer: list[dict[str, Any]]) -> dict[str, int]:
    return {h["Host"]: h["Score"] for h in answer}


def test_a_share_goes_to_the_node_whose_gpu_is_fullest(extender: Extender) -> None:
    claims = extender.nodes.dra
    assert claims is not None
    claims.claim_changed(pending("mine", share(4)))
    got = scores(extender.prioritize_claims(args(pod(by_name("mine")), (*NODES, "plugin"))))
    assert got == {"full": 10, "half": got["half"], "empty": 0, "plugin": 0}
    assert 0 < got["half"] < 10
    # 7 GiB no longer fits full's GPU 0 (6 GiB left): half's GPU 0 (12 GiB left) is the fullest GPU that
    # fits, where full would have to break one of its whole GPUs
    claims.claim_changed(pending("mine", share(7)))
    got = scores(extender.prioritize_claims(args(pod(by_name("mine")))))
    assert got["half"] == 10 and got["full"] < 10 and got["empty"] < 10


def test_whole_gpus_go_where_the_policy_puts_them_and_never_where_they_do_not_fit(extender: Extender) -> None:
    claims = extender.nodes.dra
    assert claims is not None
    claims.claim_changed(pending("three", whole(3)))  # full has 2 whole GPUs left: it does not fit
    got = scores(extender.prioritize_claims(args(pod(by_name("three")))))
    assert got["full"] == 0 and max(got["half"], got["empty"]) == 10
    ctx = extender._context("pod-uid")
    states = [dra_state(v.state) for v in extender.nodes.get_many(NODES) if v.state is not None]
    best = place(
        [s for s in states if s is not None], Request(gpus=3), policy=ctx.policy, workload=ctx.workload
    )
    assert best is not None and got[best.node] == 10  # the policy's own choice over the same nodes


def test_with_bestfit_whole_gpus_pack_onto_the_node_already_in_use(extender: Extender) -> None:
    ext = Extender(config=ExtenderConfig(policy="bestfit"))
    ext.nodes.dra = extender.nodes.dra
    ext.refresh_nodes([node_json(node_state(n)) for n in NODES])
    claims = ext.nodes.dra
    assert claims is not None
    claims.claim_changed(pending("two", whole(2)))
    got = scores(ext.prioritize_claims(args(pod(by_name("two")))))
    assert got["full"] == 10 and got["empty"] == 0 and 0 < got["half"] < 10


def test_a_template_claim_is_found_through_the_pods_status(extender: Extender) -> None:
    claims = extender.nodes.dra
    assert claims is not None
    claims.claim_changed(pending("p-gpu-x7", share(4)))
    tmpl = {"name": "gpu", "resourceClaimTemplateName": "t"}
    assert extender.prioritize_claims(args(pod(tmpl))) == []  # not made yet: nothing to steer by
    got = extender.prioritize_claims(
        args(pod(tmpl, statuses=[{"name": "gpu", "resourceClaimName": "p-gpu-x7"}]))
    )
    assert scores(got)["full"] == 10


def test_pods_without_claims_are_answered_at_once_without_any_lookup(extender: Extender) -> None:
    def boom(*_: object, **__: object) -> Any:
        raise AssertionError("a pod without claims must not look at nodes or claims")

    claims = extender.nodes.dra
    assert claims is not None
    extender.nodes.get_many = boom  # type: ignore[method-assign]
    claims.kept = boom  # type: ignore[method-assign]
    assert extender.prioritize_claims(args(pod())) == []
    plain = pod()
    plain["spec"]["containers"][0]["resources"] = {"limits": {"nvidia.com/gpu": "1"}}
    assert extender.prioritize_claims(args(plain)) == []
    assert extender.prioritize_claims(args(pod() | {"spec": {"resourceClaims": []}})) == []


def test_claims_not_asking_our_shares_or_whole_gpus_are_not_steered(extender: Extender) -> None:
    claims = extender.nodes.dra
    assert claims is not None
    other = [{"name": "x", "exactly": {"deviceClassName": "nic.example.com"}}]
    mig = [{"name": "m", "exactly": {"deviceClassName": CLASS_MIG}}]
    sliced = [{"name": "t", "exactly": {"deviceClassName": CLASS_TIME_SLICED}}]
    for name, requests in (("other", other), ("mig", mig), ("sliced", sliced)):
        claims.claim_changed(pending(name, requests))
        assert extender.prioritize_claims(args(pod(by_name(name)))) == [], name
    assert claims.kept(f"{NS}/other") is None  # claims of other classes are not even kept
    assert extender.prioritize_claims(args(pod(by_name("never-made")))) == []


def test_without_the_claim_watch_nothing_is_steered() -> None:
    ext = Extender()
    ext.refresh_nodes([node_json(node_state("full"))])
    assert ext.prioritize_claims(args(pod(by_name("mine")), ("full",))) == []


HOSTILE_REQUESTS = [
    pytest.param("not a list", id="requests-not-a-list"),
    pytest.param([{"name": "g", "exactly": {"deviceClassName": CLASS_SHARED}}], id="share-without-memory"),
    pytest.param(share("-4Gi"), id="negative-memory"),
    pytest.param(share("1e400"), id="absurd-memory"),
    pytest.param(share("lots"), id="memory-not-a-quantity"),
    pytest.param(whole(10**9), id="count-beyond-32"),
    pytest.param([{"name": "g", "exactly": {"deviceClassName": CLASS_WHOLE, "count": "2"}}], id="count-text"),
    pytest.param(
        [{"name": "g", "exactly": {"deviceClassName": CLASS_WHOLE, "allocationMode": "All"}}], id="all-gpus"
    ),
    pytest.param([whole(1)[0]] * 10_000, id="10k-requests"),
    pytest.param([7, None, "x"], id="requests-not-objects"),
]


@pytest.mark.parametrize("requests", HOSTILE_REQUESTS)
def test_a_malformed_claim_steers_nothing_and_breaks_nothing(extender: Extender, requests: Any) -> None:
    claims = extender.nodes.dra
    assert claims is not None
    claims.claim_changed(pending("bad", requests))
    assert extender.prioritize_claims(args(pod(by_name("bad")))) == []
    # the node view is intact: another pod's share is still scored
    claims.claim_changed(pending("good", share(4)))
    assert scores(extender.prioritize_claims(args(pod(by_name("good")))))["full"] == 10


def test_claims_of_other_namespaces_other_pods_or_already_allocated_do_not_steer(extender: Extender) -> None:
    claims = extender.nodes.dra
    assert claims is not None
    # a claim of the same name in another namespace: the pod's own namespace is the only one looked in
    claims.claim_changed(pending("theirs", share(4), ns="team-b"))
    assert extender.prioritize_claims(args(pod(by_name("theirs")))) == []
    assert extender.prioritize_claims(args(pod(by_name("team-b/theirs")))) == []
    # reserved for another pod
    reserved = {"reservedFor": [{"resource": "pods", "name": "q", "uid": "someone-else"}]}
    claims.claim_changed(pending("held", whole(1), status=reserved))
    assert extender.prioritize_claims(args(pod(by_name("held")))) == []
    # reserved for this pod: it counts
    mine = {"reservedFor": [{"resource": "pods", "name": "p", "uid": "pod-uid"}]}
    claims.claim_changed(pending("held", whole(1), status=mine))
    assert scores(extender.prioritize_claims(args(pod(by_name("held")))))["full"] == 10
    # already allocated: the allocator keeps it where it is
    claims.claim_changed(
        allocated("done", "empty", gpu_device_name(uuid("empty", 0)))
        | {"metadata": {"namespace": NS, "name": "done"}}
    )
    assert extender.prioritize_claims(args(pod(by_name("done")))) == []


HOSTILE_PODS = [
    pytest.param({"resourceClaims": "x"}, id="claims-not-a-list"),
    pytest.param({"resourceClaims": [1, None, "x", {"resourceClaimName": 7}]}, id="claims-not-objects"),
    pytest.param({"resourceClaims": [{"resourceClaimName": "x" * 10_000}]}, id="name-too-long"),
    pytest.param(
        {"resourceClaims": [{"name": "g", "resourceClaimTemplateName": "t"}]}, id="template-no-status"
    ),
]


@pytest.mark.parametrize("spec", HOSTILE_PODS)
def test_a_malformed_pod_gets_an_empty_answer(extender: Extender, spec: dict[str, Any]) -> None:
    p = {
        "metadata": {"namespace": NS, "name": "p", "uid": "u"},
        "spec": spec,
        "status": {"resourceClaimStatuses": 5},
    }
    assert extender.prioritize_claims(args(p)) == []


def test_a_pod_naming_many_claims_is_read_within_the_bound(extender: Extender) -> None:
    claims = extender.nodes.dra
    assert claims is not None
    claims.claim_changed(pending("c0", share(4)))
    many = [by_name(f"c{i}") for i in range(100_000)]
    refs = pod_claim_refs(pod(*many))
    assert refs is not None and len(refs) == 128
    assert scores(extender.prioritize_claims(args(pod(*many))))["full"] == 10
    metaless = {"spec": {"resourceClaims": [by_name("c0")]}}
    assert extender.prioritize_claims(args(metaless)) == []  # no name: not a pod to score


def test_shares_round_up_to_the_memory_unit_and_the_largest_share_counts() -> None:
    reader = read_claim(DEFAULT_DRIVER)
    two = reader(pending("two", [*share("3500Mi"), {"name": "b", "exactly": share(6)[0]["exactly"]}]))
    req = claim_request([two], pod_uid="u", memory_unit_bytes=GIB)
    assert req is not None and req.gpu_memory_bytes == 6 * GIB
    one = reader(pending("one", share("3500Mi")))
    req = claim_request([one], pod_uid="u", memory_unit_bytes=GIB)
    assert req is not None and req.gpu_memory_bytes == 4 * GIB
    both = reader(pending("both", whole(2)))
    req = claim_request([one, both], pod_uid="u", memory_unit_bytes=GIB)
    assert req is not None and req.gpus == 2  # whole GPUs weigh more than a share


def test_only_dra_gpus_count_and_nvlink_peers_stay_within_them() -> None:
    s = node_state("mixed", dra=2, plugin=2)
    gpus = tuple(
        g if g.index else GpuState(**{**g.__dict__, "nvlink_peers": frozenset({uuid("mixed", 3)})})
        for g in s.gpus
    )
    got = dra_state(NodeState(s.name, gpus, s.cpu_milli_free, s.memory_free_bytes))
    assert got is not None and [g.uuid for g in got.gpus] == [uuid("mixed", 0), uuid("mixed", 1)]
    assert all(g.sharing == Sharing.FRACTIONAL and g.serves_whole and not g.nvlink_peers for g in got.gpus)
    assert dra_state(node_state("none", dra=0, plugin=2)) is None


def test_a_reader_that_fails_skips_the_claim_and_the_watch_goes_on() -> None:
    def reader(claim: Any) -> object:
        if claim["metadata"]["name"] == "bad":
            raise ValueError("boom")
        return "kept"

    view = ClaimView(reader=reader)
    view.replace_all([pending("bad", []), pending("good", [])])
    assert view.kept(f"{NS}/good") == "kept" and view.kept(f"{NS}/bad") is None
    assert view.problems == 1
    view.claim_changed(pending("good", []), deleted=True)
    assert view.kept(f"{NS}/good") is None


@pytest.fixture
def served(extender: Extender) -> Iterator[int]:
    server = ExtenderServer(extender, port=0)
    server.start()
    yield server.port
    server.stop()


def post(port: int, path: str, body: bytes) -> tuple[int, Any]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    conn.request("POST", path, body=body, headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    out = resp.status, json.loads(resp.read())
    conn.close()
    return out


def test_the_verb_is_served_over_http(extender: Extender, served: int) -> None:
    claims = extender.nodes.dra
    assert claims is not None
    claims.claim_changed(pending("mine", share(4)))
    status, body = post(served, "/prioritize-claims", json.dumps(args(pod(by_name("mine")))).encode())
    assert status == 200 and scores(body)["full"] == 10
    status, body = post(served, "/prioritize-claims", json.dumps(args(pod())).encode())
    assert (status, body) == (200, [])
    status, body = post(served, "/prioritize-claims", b'{"Pod": 5}')
    assert status == 400 and "Pod" in body["Error"]
    status, body = post(served, "/prioritize-claims", b"{not json")
    assert status == 400 and "malformed JSON" in body["Error"]


def test_a_burst_counts_the_answers_given_until_their_claims_are_allocated() -> None:
    """kube-scheduler asks for the next pod before the last one's claim is allocated: the answer given to
    the first counts in the second's ranking, until the claim's allocation is seen (then it counts)."""
    ext = Extender(config=ExtenderConfig(policy="bestfit"))
    claims = ClaimView(DEFAULT_DRIVER, reader=read_claim(DEFAULT_DRIVER))
    ext.nodes.dra = claims
    ext.refresh_nodes([node_json(node_state(n)) for n in NODES])
    for i in range(2):
        claims.claim_changed(pending(f"c{i}", share(4)))
    first = scores(ext.prioritize_claims(args(pod(by_name("c0"), uid="u0"))))
    assert first == {"full": 10, "half": 10, "empty": 10}  # three empty nodes: the policy has no preference
    assumed = ext.assumed.live(lambda _: False, skip_pod="")
    assert [(a.node, a.request.gpu_memory_bytes) for a in assumed] == [("full", 4 * GIB)]
    assert scores(ext.prioritize_claims(args(pod(by_name("c1"), uid="u1")))) == {
        "full": 10,
        "half": 0,
        "empty": 0,
    }
    # c0 was allocated on `half` after all: the allocation counts, the answer no longer does
    done = allocated("c0", "half", shared_device_name(uuid("half", 0)), "4Gi")
    done["metadata"]["namespace"] = NS
    done["spec"] = pending("c0", share(4))["spec"]
    claims.claim_changed(done)
    assert scores(ext.prioritize_claims(args(pod(by_name("c1"), uid="u1")))) == {
        "full": 0,
        "half": 10,
        "empty": 0,
    }
    assert [a.node for a in ext.assumed.live(lambda _: False, skip_pod="")] == ["half"]  # u1's own answer


def test_answers_are_forgotten_after_their_ttl_and_beyond_the_bound() -> None:
    now = [0.0]
    book = Assumed(ttl_s=30.0, limit=2, clock=lambda: now[0])
    for i in range(3):
        book.assume(f"u{i}", "full", (uuid("full", 0),), Request(gpu_memory_bytes=GIB), [f"{NS}/c{i}"])
    assert [a.claims for a in book.live(lambda _: False, skip_pod="")] == [(f"{NS}/c1",), (f"{NS}/c2",)]
    assert [a.claims for a in book.live(lambda _: False, skip_pod="u2")] == [(f"{NS}/c1",)]
    now[0] = 31.0
    assert book.live(lambda _: False, skip_pod="") == [] and len(book) == 0
    state = node_state("full")
    book.assume("w", "full", (uuid("full", 1),), Request(gpus=1), [])
    book.assume("s", "full", (uuid("full", 0),), Request(gpu_memory_bytes=20 * GIB), [])  # beyond the GPU
    got = with_assumed(state, book.live(lambda _: False, skip_pod=""))
    assert [(g.milli_free, g.memory_free_bytes) for g in got.gpus[:3]] == [
        (1000, 0),
        (0, 0),
        (1000, 16 * GIB),
    ]


def test_a_pod_whose_claims_do_not_exist_or_ask_nothing_leaves_no_answer_behind(extender: Extender) -> None:
    for i in range(10):
        extender.prioritize_claims(args(pod(by_name(f"ghost-{i}"), uid=f"g{i}")))
    assert len(extender.assumed) == 0
