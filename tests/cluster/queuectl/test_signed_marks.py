"""Signed admission marks on the controller's side: a mark the pod's owner patched on (its real UID, a
made-up or borrowed signature) is not read back as an admission by a new leader, takes no quota, and is
removed when it sits in a gang admitted part-way. Each test also runs the same pods without a key or with
the key, to show that the outcome is the signature's doing."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest

from gpunode.cluster.queuectl.cli import build_controller, register_queue_cli
from gpunode.cluster.queuectl.core import QueueCore
from gpunode.cluster.queuectl.jobs import admitted_text
from gpunode.cluster.queueing.model import PodPlacement
from gpunode.cluster.queuemark import SIG_CHARS, MarkKey
from gpunode.contract.names import QUEUE_ADMITTED_ANNOTATION, QUEUE_REASON_ANNOTATION
from gpunode.errors import AdmissionKeyError
from tests.cluster.queuectl.helpers import CONFIG_YAML, config, node, pod

SECRET = b"s" * 40
AT = 1767225600.0  # 2026-01-01T00:00:00Z


def key() -> MarkKey:
    return MarkKey(SECRET)


def signed(p: dict[str, Any], uid: str, node_name: str, gpus: list[str], *, job: str) -> dict[str, Any]:
    """Pod `p` with UID `uid` and the mark the controller (holding SECRET) writes for it."""
    p["metadata"]["uid"] = uid
    text = admitted_text(job, PodPlacement(node=node_name, gpus=tuple(gpus)), AT, uid, key=key())
    p["metadata"].setdefault("annotations", {})[QUEUE_ADMITTED_ANNOTATION] = text
    return p


def forged(
    p: dict[str, Any], uid: str, node_name: str, gpus: list[str], *, job: str, sig: Any
) -> dict[str, Any]:
    """Pod `p` as its owner patched it: its real UID in a mark with signature `sig` (None: no "sig")."""
    p["metadata"]["uid"] = uid
    doc: dict[str, Any] = {
        "job": job,
        "uid": uid,
        "node": node_name,
        "gpus": gpus,
        "at": "2026-01-01T00:00:00Z",
    }
    if sig is not None:
        doc["sig"] = sig
    p["metadata"].setdefault("annotations", {})[QUEUE_ADMITTED_ANNOTATION] = json.dumps(doc)
    return p


def bound(p: dict[str, Any], node_name: str) -> dict[str, Any]:
    p["spec"]["nodeName"] = node_name
    p["status"]["phase"] = "Running"
    return p


def new_leader(
    mark_key: MarkKey | None, nodes: list[dict[str, Any]], pods: list[dict[str, Any]]
) -> QueueCore:
    """A controller that takes the lead and rebuilds from what the API server holds."""
    core = QueueCore(config(), mark_key=mark_key)
    for n in nodes:
        core.node_changed(n)
    for p in pods:
        core.pod_changed(p)
    return core


SIGS = [
    pytest.param(None, id="no-sig"),
    pytest.param("A" * SIG_CHARS, id="made-up-sig"),
    pytest.param(7, id="sig-not-a-string"),
    pytest.param("A" * 50000, id="oversize-sig"),
    pytest.param("borrowed", id="sig-of-another-pods-mark"),
]


def over_quota_pods(sig: Any) -> list[dict[str, Any]]:
    """team-b (4 GPUs at most) runs `ok` on 4 GPUs, admitted by the controller; `jumper` (2 GPUs) carries a
    mark its owner wrote, with its own UID."""
    ok = bound(
        signed(
            pod("ok", queue="team-b", gpus=4), "uid-ok", "n1", [f"GPU-n1-{i}" for i in range(4)], job="ml/ok"
        ),
        "n1",
    )
    if sig == "borrowed":  # ok's valid signature, on a mark with the jumper's own fields
        sig = json.loads(ok["metadata"]["annotations"][QUEUE_ADMITTED_ANNOTATION])["sig"]
    jumper = forged(
        pod("jumper", queue="team-b", gpus=2),
        "uid-j",
        "n1",
        ["GPU-n1-4", "GPU-n1-5"],
        job="ml/jumper",
        sig=sig,
    )
    return [ok, jumper]


@pytest.mark.parametrize("sig", SIGS)
def test_a_forged_mark_with_the_pods_own_uid_is_not_adopted_by_a_new_leader(sig: Any) -> None:
    core = new_leader(key(), [node("n1", 8)], over_quota_pods(sig))
    actions = core.reconcile(1000.0)
    assert core.sched is not None
    assert "ml/ok" in core.sched.running  # the controller's own signed mark is read back as an admission
    assert "ml/jumper" not in core.sched.running and actions.admitted_jobs == []  # no quota taken
    reasons = {a.pod.key: a.annotations.get(QUEUE_REASON_ANNOTATION) for a in actions.annotate}
    assert "team-b is over its quota" in (reasons.get("ml/jumper") or "")
    jumper = next(m for j in core.last_jobs.values() for m in j.members if m.name == "jumper")
    assert jumper.admitted is None and jumper.foreign_mark


@pytest.mark.parametrize("sig", ["A" * SIG_CHARS, None])
def test_without_a_key_the_same_mark_is_taken(sig: Any) -> None:
    """The control: without a key, a mark naming the pod's UID counts (the hole --admission-key-file closes)."""
    core = new_leader(None, [node("n1", 8)], over_quota_pods(sig))
    core.reconcile(1000.0)
    assert core.sched is not None and "ml/jumper" in core.sched.running


def gang(third: str) -> list[dict[str, Any]]:
    """Gang ml/g of 3 on n1: g0 bound and g1 marked (signed), g2 `third`: unmarked, or forged by its owner."""
    members = [pod(f"g{i}", gang="g", size=3) for i in range(3)]
    bound(signed(members[0], "uid-g0", "n1", ["GPU-n1-0"], job="ml/g"), "n1")
    signed(members[1], "uid-g1", "n1", ["GPU-n1-1"], job="ml/g")
    members[2]["metadata"]["uid"] = "uid-g2"
    if third == "forged":
        forged(members[2], "uid-g2", "n1", ["GPU-n1-2"], job="ml/g", sig="A" * SIG_CHARS)
    return members


def test_a_forged_mark_in_a_gang_admitted_part_way_is_removed_and_the_gang_undone() -> None:
    # the control: the member without a mark is completed onto the plan of the signed ones
    core = new_leader(key(), [node("n1", 4)], gang("unmarked"))
    assert core.reconcile(1000.0).repairs == [("ml/g", "completed")]
    # the member with a forged mark: not this gang's admission; the mark is removed, the gang undone
    core = new_leader(key(), [node("n1", 4)], gang("forged"))
    actions = core.reconcile(1000.0)
    assert actions.repairs == [("ml/g", "undone")]
    removed = {
        a.pod.key for a in actions.annotate if a.annotations.get(QUEUE_ADMITTED_ANNOTATION, "") is None
    }
    assert "ml/g2" in removed
    reason = next(a.annotations[QUEUE_REASON_ANNOTATION] for a in actions.annotate if a.pod.key == "ml/g2")
    assert "carries an admission mark that is not its own" in reason


def test_marks_are_signed_by_the_key_and_read_back_only_with_it() -> None:
    first = new_leader(key(), [node("n1", 8)], [])
    p = pod("a", gpus=2)
    p["metadata"]["uid"] = "uid-a"
    first.pod_changed(p)
    actions = first.reconcile(1000.0)
    (write,) = [a for a in actions.annotate if QUEUE_ADMITTED_ANNOTATION in a.annotations]
    mark = json.loads(write.annotations[QUEUE_ADMITTED_ANNOTATION])
    assert key().verify(mark) and mark["uid"] == "uid-a"
    p["metadata"]["annotations"] = {QUEUE_ADMITTED_ANNOTATION: write.annotations[QUEUE_ADMITTED_ANNOTATION]}
    same = new_leader(key(), [node("n1", 8)], [p])
    assert same.reconcile(1001.0).admitted_jobs == []  # read back as admitted: nothing to write
    assert same.sched is not None and "ml/a" in same.sched.running
    other = new_leader(MarkKey(b"o" * 40), [node("n1", 8)], [p])  # a controller with another key
    assert other.reconcile(1001.0).admitted_jobs == ["ml/a"]  # not taken as admitted: it admits anew


def test_the_queue_flag(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    import argparse

    parser = argparse.ArgumentParser(prog="gpunode")
    register_queue_cli(parser.add_subparsers(dest="command"))
    (tmp_path / "queues.yaml").write_text(CONFIG_YAML)
    (tmp_path / "key").write_bytes(SECRET + b"\n")
    (tmp_path / "short").write_bytes(b"x" * 16)
    base = ["queue", "--config", str(tmp_path / "queues.yaml"), "--kube-api", "https://127.0.0.1:1"]

    def core_of(*flags: str) -> QueueCore:
        return build_controller(parser.parse_args([*base, *flags])).core

    caplog.set_level(logging.WARNING, logger="gpunode.cluster.queuectl.cli")
    with_key = core_of("--admission-key-file", str(tmp_path / "key"))
    assert with_key.mark_key is not None and with_key.mark_key.verify(
        json.loads(admitted_text("j", PodPlacement("n1", ()), AT, "u", key=key()))
    )
    assert not [r for r in caplog.records if "NOT signed" in r.getMessage()]
    assert core_of().mark_key is None
    assert len([r for r in caplog.records if "NOT signed" in r.getMessage()]) == 1
    for bad, message in (("short", "16 bytes of key, fewer than 32"), ("missing", "cannot read it")):
        with pytest.raises(AdmissionKeyError, match=message):
            core_of("--admission-key-file", str(tmp_path / bad))
