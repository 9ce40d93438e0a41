"""The pieces of the extender's HA mode: rebuilding reservations, the leader's binder, the flags."""

from __future__ import annotations

from typing import Any

import pytest

from gpunode.cluster.extender.cli import build_ha
from gpunode.cluster.extender.core import Extender
from gpunode.cluster.extender.ha import LeaderBinder, Leadership, reserve_bound_pods
from gpunode.cluster.extender.kubeapi import KubeApi
from gpunode.contract.names import ASSIGNMENT_ANNOTATION
from gpunode.errors import ConfigError, NotLeader
from gpunode.infra.kube import ElectionConfig, LeaderElector, LeaseLock
from tests.cluster.test_extender import gpu_state, parser, v1_node, v1_pod


def bound(
    name: str, node: str, *, gpus: str = "", phase: str = "Running", limits: dict[str, str] | None = None
) -> Any:
    pod = v1_pod(name, uid=f"u-{name}", limits=limits or {"nvidia.com/gpu": "1"})
    pod["spec"]["nodeName"] = node
    pod["status"]["phase"] = phase
    if gpus:
        pod["metadata"]["annotations"][ASSIGNMENT_ANNOTATION] = gpus
    return pod


def extender_with(*nodes: Any) -> Extender:
    extender = Extender()
    extender.refresh_nodes(nodes)
    return extender


def test_rebuild_reserves_the_gpus_of_bound_pods_the_annotations_do_not_list() -> None:
    extender = extender_with(
        v1_node("n1", gpu_state("n1", [1000, 1000, 1000])),
        v1_node("n2", gpu_state("n2", [0, 1000], pods={0: ["team-a/listed"]})),
    )
    pods = [
        bound("recorded", "n1", gpus="GPU-n1-2"),  # the GPUs it was bound to, as bind recorded them
        bound("unrecorded", "n1"),  # bound without the extender: the GPU bestfit would pick
        bound("listed", "n2", gpus="GPU-n2-0"),  # the annotation counts it already
        bound("finished", "n1", gpus="GPU-n1-0", phase="Succeeded"),
        bound("no-room", "n2", gpus="GPU-n2-0"),  # its GPU is full: the annotation counts it
        bound("cpu-only", "n1", limits={"cpu": "1"}),
        bound("unknown-node", "n9", gpus="GPU-n9-0"),
        v1_pod("pending", uid="u-pending"),
    ]
    assert reserve_bound_pods(extender, pods) == 2
    recorded, unrecorded = extender.reservations.get("u-recorded"), extender.reservations.get("u-unrecorded")
    assert recorded is not None and (recorded.node, recorded.gpu_uuids, recorded.final) == (
        "n1",
        ("GPU-n1-2",),
        True,
    )
    assert unrecorded is not None and unrecorded.node == "n1" and unrecorded.gpu_uuids[0] != "GPU-n1-2"
    assert len(extender.reservations) == 2
    # Of n1's three GPUs one is left: a pod for one fits, a pod for two does not.
    one = {"Pod": v1_pod("one", uid="u-one"), "NodeNames": ["n1"]}
    two = {"Pod": v1_pod("two", uid="u-two", limits={"nvidia.com/gpu": "2"}), "NodeNames": ["n1"]}
    assert extender.filter(one)["NodeNames"] == ["n1"] and extender.filter(two)["NodeNames"] == []


class Clock:
    now = 100.0

    def __call__(self) -> float:
        return self.now


def test_the_leaders_binder_refuses_when_its_lease_may_be_taken_over_before_the_bind_lands() -> None:
    config = ElectionConfig(
        namespace="ns", name="l", identity="me", lease_duration_s=3, renew_deadline_s=2, retry_period_s=0.5
    )
    api = KubeApi("http://127.0.0.1:1")
    clock = Clock()
    elector = LeaderElector(LeaseLock(api.client, "ns", "l"), config, clock=clock)
    leadership = Leadership(elector)
    binder = LeaderBinder(api, leadership)
    args: dict[str, Any] = {"namespace": "team-a", "name": "p", "uid": "u", "node": "n1", "gpu_uuids": ()}
    with pytest.raises(NotLeader):
        binder.bind(**args)  # never led
    assert "standby; the leader is not elected yet" in (leadership.refusal() or "")
    elector._won(elector._observed or _record("me"), clock.now)  # as after a successful renewal
    assert "is taking over as leader" in (leadership.refusal() or "")  # not rebuilt yet: no serving
    leadership.serve(True)
    assert leadership.refusal() is None and leadership.status()["role"] == "leader"
    assert leadership.seconds_left() == pytest.approx(3.0)  # others wait 3 s from the renewal
    clock.now += 1.5  # still leading, but another replica could take over within 1.5 s
    assert elector.is_leader() and leadership.seconds_left() == pytest.approx(1.5)
    with pytest.raises(NotLeader, match="no longer leads long enough to bind pod team-a/p"):
        binder.bind(**args)
    clock.now += 0.6  # past its renew deadline: it answers nothing any more
    assert leadership.refusal() is not None and leadership.status()["role"] == "standby"


def _record(holder: str) -> Any:
    from gpunode.infra.kube import LeaseRecord

    return LeaseRecord(holder, 15, "", "", 0, "1")


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["extender", "--leader-elect"], "--leader-elect needs --kube-api"),
        (["extender", "--leader-elect", "--kube-api", "http://127.0.0.1:1", "--leader-elect-namespace", "ns",
          "--leader-elect-renew-deadline", "20s"], "do not go together"),
        (["extender", "--leader-elect", "--kube-api", "http://127.0.0.1:1", "--leader-elect-namespace", ""],
         "needs the Lease's namespace"),
    ],
)  # fmt: skip
def test_leader_election_flags_that_cannot_work_are_config_errors(argv: list[str], message: str) -> None:
    args = parser().parse_args(argv)
    api = KubeApi(args.kube_api) if args.kube_api else None
    with pytest.raises(ConfigError) as exc:
        build_ha(args, Extender(), api)
    assert message in str(exc.value) and exc.value.hint


def test_leader_election_flags_build_the_election() -> None:
    args = parser().parse_args(
        ["extender", "--leader-elect", "--kube-api", "http://127.0.0.1:1", "--leader-elect-namespace", "gpu",
         "--leader-elect-pod", "ext-0", "--bind", "--insecure-bind-without-tls"]
    )  # fmt: skip
    extender = Extender(binder=KubeApi(args.kube_api))
    ha = build_ha(args, extender, KubeApi(args.kube_api))
    assert ha is not None and isinstance(extender.binder, LeaderBinder)
    cfg = ha.config
    assert (cfg.namespace, cfg.name, cfg.lease_duration_s, cfg.renew_deadline_s, cfg.retry_period_s) == (
        "gpu", "gpunode-extender", 15.0, 10.0, 2.0,
    )  # fmt: skip
    assert cfg.identity.startswith("ext-0_") and ha.pod_name == "ext-0"
    assert build_ha(parser().parse_args(["extender"]), Extender(), None) is None
