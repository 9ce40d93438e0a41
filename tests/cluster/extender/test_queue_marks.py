"""The extender holds queued GPU pods until the queue controller admits them, and then honours its plan.

Every test of the `ext` fixture runs in both hold modes (--queue-hold): error (the filter answers Error,
so kube-scheduler never preempts for the pod) and unschedulable (every node failed with the reason).

Every such test runs with and without an admission key (--admission-key-file): the marks are signed
with KEY, which an unkeyed extender ignores (it takes marks by UID alone).

Each attack is performed: a tenant forges an admission (a mark copied from another pod, one written
before the pod had a UID, one patched onto its own pod with its real UID and a made-up signature),
writes a long or odd waiting reason, or POSTs a bind for a waiting pod; the marks are written with the
controller's own admitted_text so both sides are proven to agree.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest

from gpunode.cluster.extender import queued as queued_module
from gpunode.cluster.extender.cli import build_extender
from gpunode.cluster.extender.core import Extender, ExtenderConfig
from gpunode.cluster.extender.kubeapi import KubeApi
from gpunode.cluster.extender.queued import (
    HOLD_ERROR,
    HOLD_MODES,
    HOLD_UNSCHEDULABLE,
    MAX_REASON,
    WAITING_REASON,
    QueueNamespaces,
    clean_reason,
    queue_hold,
)
from gpunode.cluster.queuectl.jobs import admitted_text, queued_pod
from gpunode.cluster.queueing.model import PodPlacement
from gpunode.cluster.queuemark import SIG_CHARS, MarkKey, canonical, load_mark_key, mark_accepted
from gpunode.contract.names import QUEUE_ADMITTED_ANNOTATION, QUEUE_LABEL, QUEUE_REASON_ANNOTATION
from gpunode.errors import AdmissionKeyError, InvalidRequest, KubeError, QueueConfigError
from tests.cluster.queuectl.helpers import config
from tests.cluster.test_extender import (
    FakeApiServer,
    gpu_state,
    node_list,
    parser,
    start,
    v1_node,
    v1_pod,
)

REASON = "queued in team-a, position 12: team-a is over its quota"
SECRET = b"k" * 32 + b"the controller's and extender's secret"
KEY = MarkKey(SECRET)


class Binder:
    """An API server in memory: the pods a bind reads, and the binds made."""

    def __init__(self) -> None:
        self.pods: dict[str, dict[str, Any]] = {}
        self.binds: list[tuple[str, str, tuple[str, ...]]] = []

    def add(self, pod: dict[str, Any]) -> None:
        meta = pod["metadata"]
        self.pods[f"{meta['namespace']}/{meta['name']}"] = pod

    def read_pod(self, *, namespace: str, name: str) -> Mapping[str, Any] | None:
        return self.pods.get(f"{namespace}/{name}")

    def bind(self, *, namespace: str, name: str, uid: str, node: str, gpu_uuids: tuple[str, ...]) -> None:
        if f"{namespace}/{name}" not in self.pods:
            raise KubeError(f"pod {namespace}/{name} not found")
        self.binds.append((f"{namespace}/{name}", node, gpu_uuids))


def queued(
    name: str, uid: str, *, gpus: str = "1", queue: str | None = "team-a", **notes: str
) -> dict[str, Any]:
    """A pending pod asking for whole GPUs, labelled into `queue`, with these annotations."""
    pod = v1_pod(name, uid=uid, limits={"nvidia.com/gpu": gpus}, annotations=dict(notes))
    if queue:
        pod["metadata"]["labels"][QUEUE_LABEL] = queue
    return pod


def admit(
    pod: dict[str, Any], node: str, gpus: tuple[str, ...], *, job: str = "team-a/gang"
) -> dict[str, Any]:
    """The pod with the admission the controller writes for it (its own UID), signed with KEY."""
    text = admitted_text(
        job, PodPlacement(node=node, gpus=gpus), 1732252800.0, pod["metadata"]["uid"], key=KEY
    )
    pod["metadata"]["annotations"][QUEUE_ADMITTED_ANNOTATION] = text
    pod["metadata"]["annotations"].pop(QUEUE_REASON_ANNOTATION, None)
    return pod


NODES = node_list(
    v1_node("n1", gpu_state("n1", [1000, 1000])),
    v1_node("n2", gpu_state("n2", [1000, 1000])),
    v1_node("n3", gpu_state("n3", [1000, 1000])),
)


@pytest.fixture(params=[(mode, key) for mode in HOLD_MODES for key in ("signed", "unsigned")], ids=str)
def ext(request: pytest.FixtureRequest) -> tuple[Extender, Binder]:
    binder = Binder()
    mode, signed = request.param
    extender = Extender(
        config=ExtenderConfig(policy="bestfit", queue_hold=mode),
        binder=binder,
        mark_key=KEY if signed == "signed" else None,
    )
    extender.refresh_nodes(NODES["items"])
    return extender, binder


def bind_args(pod: dict[str, Any], node: str) -> dict[str, str]:
    meta = pod["metadata"]
    return {"PodName": meta["name"], "PodNamespace": meta["namespace"], "PodUID": meta["uid"], "Node": node}


def passing(result: dict[str, Any]) -> list[str]:
    return [n["metadata"]["name"] for n in result["Nodes"]["items"]]


def held(extender: Extender, result: dict[str, Any]) -> set[str]:
    """Why a held pod's filter passed no node, checked against the extender's hold mode: the Error alone
    (error), or every node failed with the reason in both maps and no Error (unschedulable)."""
    assert passing(result) == []
    if extender.config.queue_hold == HOLD_ERROR:
        assert result["Error"] and result["FailedNodes"] == result["FailedAndUnresolvableNodes"] == {}
        return {result["Error"]}
    assert result["Error"] == "" and set(result["FailedNodes"]) == {"n1", "n2", "n3"}
    assert result["FailedAndUnresolvableNodes"] == result["FailedNodes"]
    return set(result["FailedNodes"].values())


def plan_refused(extender: Extender, result: dict[str, Any], node: str) -> str:
    """Why an admitted pod's filter passed no node, checked against the hold mode: the Error alone (error:
    kube-scheduler's preemption never runs for the pod, the controller re-plans it), or the plan's `node`
    failed with the reason and no Error (unschedulable); that reason."""
    assert not (result.get("Nodes") or {}).get("items") and not result.get("NodeNames")
    if extender.config.queue_hold == HOLD_ERROR:
        assert result["Error"] and result["FailedNodes"] == result["FailedAndUnresolvableNodes"] == {}
        assert result["Error"].isprintable() and len(result["Error"]) <= MAX_REASON
        return str(result["Error"])
    assert result["Error"] == "" and node in result["FailedNodes"]
    return str(result["FailedNodes"][node])


# ----- waiting pods ---------------------------------------------------------------------------------------


def test_a_waiting_pod_is_refused_everywhere_with_the_controllers_reason(
    ext: tuple[Extender, Binder],
) -> None:
    extender, _ = ext
    pod = queued("train-0", "uid-0", **{QUEUE_REASON_ANNOTATION: REASON})
    result = extender.filter({"Pod": pod, "Nodes": NODES})
    assert held(extender, result) == {REASON}
    if extender.config.queue_hold == HOLD_ERROR:
        # kube-scheduler takes an Error as a scheduling error, not a fit failure: no preemption at all,
        # and the text is the pod's event as it is
        assert result["Error"] == REASON
    else:
        assert result["FailedNodes"] == {"n1": REASON, "n2": REASON, "n3": REASON}
        # later kube-schedulers read the unresolvable map first: their own preemption never acts for it
        assert result["FailedAndUnresolvableNodes"] == result["FailedNodes"]
    assert {h["Score"] for h in extender.prioritize({"Pod": pod, "Nodes": NODES})} == {0}
    assert len(extender.reservations) == 0  # a waiting pod holds nothing
    # without a reason written yet, the pod still waits, saying for whom
    bare = queued("train-1", "uid-1")
    assert held(extender, extender.filter({"Pod": bare, "Nodes": NODES})) == {WAITING_REASON}


def test_a_bind_posted_for_a_waiting_pod_is_refused(ext: tuple[Extender, Binder]) -> None:
    extender, binder = ext
    pod = queued("train-0", "uid-0", **{QUEUE_REASON_ANNOTATION: REASON})
    binder.add(pod)
    extender.filter({"Pod": pod, "Nodes": NODES})
    result = extender.bind(bind_args(pod, "n1"))
    assert result["Error"].startswith("bind refused:") and binder.binds == []
    # Filtered while admitted, then the admission withdrawn on the API server (the job was preempted):
    # the bind reads the pod as it is now and refuses.
    admit(pod, "n1", ("GPU-n1-0",))
    assert passing(extender.filter({"Pod": pod, "Nodes": NODES})) == ["n1"]
    del pod["metadata"]["annotations"][QUEUE_ADMITTED_ANNOTATION]
    result = extender.bind(bind_args(pod, "n1"))
    assert "waits in queue team-a" in result["Error"] and binder.binds == []


@pytest.mark.parametrize(
    "forge",
    [
        pytest.param(lambda pod: {"uid": "uid-other"}, id="another-pods-uid"),
        pytest.param(lambda pod: {"uid": ""}, id="empty-uid"),
        pytest.param(lambda pod: {"uid": None}, id="no-uid"),
        pytest.param(lambda pod: {"node": 3}, id="node-not-a-string"),
        pytest.param(lambda pod: {"gpus": "GPU-n1-0"}, id="gpus-not-a-list"),
    ],
)
def test_a_forged_admission_does_not_admit(ext: tuple[Extender, Binder], forge: Any) -> None:
    extender, binder = ext
    pod = admit(queued("train-0", "uid-0"), "n1", ("GPU-n1-0",))
    mark = json.loads(pod["metadata"]["annotations"][QUEUE_ADMITTED_ANNOTATION])
    mark.update(forge(pod))
    pod["metadata"]["annotations"][QUEUE_ADMITTED_ANNOTATION] = json.dumps(mark)
    binder.add(pod)
    result = extender.filter({"Pod": pod, "Nodes": NODES})
    assert held(extender, result) == {WAITING_REASON}
    assert extender.bind(bind_args(pod, "n1"))["Error"] and binder.binds == []


def test_a_mark_copied_from_an_admitted_pod_does_not_admit_the_copy(ext: tuple[Extender, Binder]) -> None:
    extender, _ = ext
    admitted = admit(queued("train-0", "uid-0"), "n1", ("GPU-n1-0",))
    copy = queued(
        "sneaky",
        "uid-sneaky",
        **{QUEUE_ADMITTED_ANNOTATION: admitted["metadata"]["annotations"][QUEUE_ADMITTED_ANNOTATION]},
    )
    assert held(extender, extender.filter({"Pod": copy, "Nodes": NODES})) == {WAITING_REASON}
    # the pod without a UID (as created, before the API server gives one) is not admitted either
    no_uid = admit(queued("early", "uid-early"), "n1", ("GPU-n1-0",))
    del no_uid["metadata"]["uid"]
    assert held(extender, extender.filter({"Pod": no_uid, "Nodes": NODES})) == {WAITING_REASON}
    # the controller reads the same marks the same way
    for pod in (copy, no_uid):
        q = queued_pod(pod, config())
        assert q is not None and q.admitted is None


# ----- signed marks (--admission-key-file) ----------------------------------------------------------------

MADE_UP_SIG = "A" * SIG_CHARS


@pytest.mark.parametrize(
    "sig",
    [
        pytest.param(None, id="no-sig"),
        pytest.param(MADE_UP_SIG, id="made-up-sig"),
        pytest.param("", id="empty-sig"),
        pytest.param(12345, id="sig-not-a-string"),
        pytest.param(["x"], id="sig-a-list"),
        pytest.param("\u00e9" * SIG_CHARS, id="sig-not-ascii"),
        pytest.param("A" * 60000, id="oversize-sig"),
        pytest.param("copied", id="sig-of-another-pod"),
    ],
)
def test_a_mark_the_tenant_patches_on_its_own_pod_with_its_real_uid_is_refused(
    ext: tuple[Extender, Binder], sig: Any
) -> None:
    """The attack the UID binding does not stop: the pod's owner reads its UID and patches a mark on."""
    extender, binder = ext
    other = admit(queued("train-1", "uid-1"), "n1", ("GPU-n1-0",))
    pod = queued("train-0", "uid-0", **{QUEUE_REASON_ANNOTATION: REASON})
    mark: dict[str, Any] = {"job": "team-a/x", "uid": "uid-0", "node": "n1", "gpus": ["GPU-n1-0"]}
    mark["at"] = "2024-11-22T05:20:00.000000Z"
    if sig == "copied":  # the valid signature of another pod's mark, with the fields made this pod's
        mark.update(
            {**json.loads(other["metadata"]["annotations"][QUEUE_ADMITTED_ANNOTATION]), "uid": "uid-0"}
        )
    elif sig is not None:
        mark["sig"] = sig
    pod["metadata"]["annotations"][QUEUE_ADMITTED_ANNOTATION] = json.dumps(mark)
    binder.add(pod)
    result = extender.filter({"Pod": pod, "Nodes": NODES})
    controller_reads = queued_pod(pod, config(), mark_key=extender.mark_key)
    assert controller_reads is not None
    if extender.mark_key is None:  # without a key the mark is taken by its UID: the hole the key closes
        assert passing(result) == ["n1"] and controller_reads.admitted is not None
        return
    assert held(extender, result) == {REASON}  # held, with the controller's reason unchanged
    assert {h["Score"] for h in extender.prioritize({"Pod": pod, "Nodes": NODES})} == {0}
    assert extender.bind(bind_args(pod, "n1"))["Error"] and binder.binds == []
    assert len(extender.reservations) == 0
    # the controller reads it alike: not admitted, a foreign mark (a gang's repair removes it)
    assert controller_reads.admitted is None and controller_reads.foreign_mark


def test_a_valid_signed_mark_copied_onto_another_pod_does_not_admit_it(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # a key of its own (the same secret as KEY): what it has already logged starts empty
    extender = Extender(config=ExtenderConfig(policy="bestfit"), mark_key=MarkKey(SECRET))
    extender.refresh_nodes(NODES["items"])
    admitted = admit(queued("train-0", "uid-0"), "n1", ("GPU-n1-0",))
    assert passing(extender.filter({"Pod": admitted, "Nodes": NODES})) == ["n1"]  # the original passes
    copy = queued("sneaky", "uid-sneaky", **dict(admitted["metadata"]["annotations"]))
    caplog.set_level("INFO", logger="gpunode.cluster.queuemark")
    for _ in range(20):  # kube-scheduler retries: held each time, logged once
        assert held(extender, extender.filter({"Pod": copy, "Nodes": NODES})) == {WAITING_REASON}
    lines = [r.getMessage() for r in caplog.records if "sneaky" in r.getMessage()]
    assert len(lines) == 1 and "another pod's UID" in lines[0]
    # the same for a forged signature on the pod's own UID: one line per pod
    caplog.clear()
    forged = json.loads(admitted["metadata"]["annotations"][QUEUE_ADMITTED_ANNOTATION])
    forged.update({"uid": "uid-sneaky", "sig": MADE_UP_SIG})
    copy["metadata"]["annotations"][QUEUE_ADMITTED_ANNOTATION] = json.dumps(forged)
    other = queued("sneaky-2", "uid-sneaky-2", **{QUEUE_ADMITTED_ANNOTATION: json.dumps(forged)})
    other["metadata"]["annotations"][QUEUE_ADMITTED_ANNOTATION] = json.dumps(
        {**forged, "uid": "uid-sneaky-2"}
    )
    for _ in range(20):
        for pod in (copy, other):
            assert held(extender, extender.filter({"Pod": pod, "Nodes": NODES})) == {WAITING_REASON}
    assert len([r for r in caplog.records if "sneaky-2" in r.getMessage()]) == 1
    assert [r for r in caplog.records if "default/sneaky " in r.getMessage()] == []  # already reported


@pytest.mark.parametrize("mode", HOLD_MODES)
def test_an_old_mark_put_back_after_the_controller_replaced_it_no_longer_passes(mode: str) -> None:
    controller = MarkKey(SECRET)  # the controller's key; the extender has its own (the same secret)
    binder = Binder()
    extender = Extender(
        config=ExtenderConfig(policy="bestfit", queue_hold=mode), binder=binder, mark_key=MarkKey(SECRET)
    )
    extender.refresh_nodes(NODES["items"])
    pod = queued("train-0", "uid-0")
    binder.add(pod)
    notes = pod["metadata"]["annotations"]
    old = admitted_text("team-a/train-0", PodPlacement("n1", ("GPU-n1-0",)), 1.0, "uid-0", key=controller)
    notes[QUEUE_ADMITTED_ANNOTATION] = old
    assert passing(extender.filter({"Pod": pod, "Nodes": NODES})) == ["n1"]
    # The controller re-plans the pod onto n2: a new mark replaces the old one.
    new = admitted_text("team-a/train-0", PodPlacement("n2", ("GPU-n2-1",)), 2.0, "uid-0", key=controller)
    notes[QUEUE_ADMITTED_ANNOTATION] = new
    assert passing(extender.filter({"Pod": pod, "Nodes": NODES})) == ["n2"]
    # The pod's owner puts the old mark back (it verifies: the controller's own signature, the pod's UID).
    notes[QUEUE_ADMITTED_ANNOTATION] = old
    assert passing(extender.filter({"Pod": pod, "Nodes": NODES})) == []
    assert "n1" not in {r.node for r in [extender.reservations.get("uid-0")] if r is not None}
    assert extender.bind(bind_args(pod, "n1"))["Error"] and binder.binds == []
    # The controller refuses it alike once it wrote the newer one: the pod is not admitted on n1.
    pod["metadata"]["annotations"][QUEUE_ADMITTED_ANNOTATION] = old
    read_back = queued_pod(pod, config(), mark_key=controller)
    assert read_back is not None and read_back.admitted is None and read_back.foreign_mark
    # The newer mark still admits it.
    hold = queue_hold({**pod, "metadata": {**pod["metadata"], "annotations": {
        QUEUE_ADMITTED_ANNOTATION: new}}}, {}, controller)  # fmt: skip
    assert hold is not None and hold.admitted is not None and hold.admitted.node == "n2"
    notes[QUEUE_ADMITTED_ANNOTATION] = new
    assert passing(extender.filter({"Pod": pod, "Nodes": NODES})) == ["n2"]


def test_generations_grow_and_a_mark_without_one_counts_as_the_oldest() -> None:
    key = MarkKey(SECRET)
    gens = [key.next_generation("u") for _ in range(100)]
    assert gens == sorted(gens) and len(set(gens)) == 100
    legacy = {"job": "j", "uid": "v", "node": "n1", "gpus": [], "at": "2026-01-01T00:00:00Z"}
    legacy["sig"] = key.sign(legacy)  # a mark written before generations
    assert mark_accepted(legacy, "v", key, where="ns/v")
    newer = json.loads(admitted_text("j", PodPlacement("n2", ()), 0.0, "v", key=key))
    assert mark_accepted(newer, "v", key, where="ns/v") and not mark_accepted(legacy, "v", key, where="ns/v")
    for bad in ("7", True, -1, 2**63, 1.5):
        forged = {**newer, "gen": bad}
        forged["sig"] = key.sign(forged)
        assert not mark_accepted(forged, "v", key, where="ns/v"), bad


def test_sign_and_verify() -> None:
    fields = {
        "job": "team-a/x",
        "uid": "u-1",
        "node": "n1",
        "gpus": ["GPU-1", "GPU-2"],
        "at": "2026-01-01T00:00Z",
    }
    mark = json.loads(admitted_text("team-a/x", PodPlacement("n1", ("GPU-1", "GPU-2")), 0.0, "u-1", key=KEY))
    assert set(mark) == {"job", "uid", "node", "gpus", "at", "gen", "sig"} and KEY.verify(mark)
    assert not KEY.verify({**mark, "gen": mark["gen"] + 1})  # the generation is signed too
    assert len(mark["sig"]) == SIG_CHARS and "=" not in mark["sig"]  # base64url, no padding
    signed = {**fields, "sig": KEY.sign(fields)}
    assert KEY.verify(signed)
    assert KEY.verify(dict(reversed(list(signed.items()))))  # the order of the keys does not matter
    assert KEY.verify({**signed, "extra": "ignored"})  # fields outside the signed five are not read
    for name, value in [
        ("job", "team-a/y"),
        ("uid", "u-2"),
        ("node", "n2"),
        ("gpus", ["GPU-2", "GPU-1"]),
        ("gpus", ["GPU-1"]),
        ("at", "2026-01-01T00:01Z"),
    ]:
        assert not KEY.verify({**signed, name: value}), name
    assert not KEY.verify({k: v for k, v in signed.items() if k != "at"})  # a field left out
    assert not MarkKey(b"x" * 32).verify(signed)  # another key
    assert not KEY.verify(fields)  # no sig
    for sig in (None, 7, b"x", ["x"], "", signed["sig"][:-1], signed["sig"] + "A", "\u00e9" * SIG_CHARS):
        assert not KEY.verify({**fields, "sig": sig}), repr(sig)
    # the domain prefix: the same fields under another purpose do not give the same signature
    assert canonical(fields).startswith(b"gpunode.io/queue-admitted/v1\n")
    assert "secret" not in repr(KEY)
    # unsigned marks (no key) carry no sig
    assert "sig" not in json.loads(admitted_text("j", PodPlacement("n1", ()), 0.0, "u", key=None))


def test_remembered_checks_are_by_exact_text_and_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("gpunode.cluster.queuemark.CACHED_MARKS", 4)
    key = MarkKey(SECRET)
    text = admitted_text("j", PodPlacement("n1", ("GPU-1",)), 0.0, "u", key=KEY)
    assert key.verify_text(text, json.loads(text)) and key.verify_text(text, json.loads(text))
    forged = text.replace('"n1"', '"n2"')  # another text: checked afresh, not taken from the memory
    assert not key.verify_text(forged, json.loads(forged)) and key.verify_text(text, json.loads(text))
    for i in range(10):
        other = text.replace('"u"', f'"u{i}"')
        assert not key.verify_text(other, json.loads(other))
        assert len(key._checked) <= 4
    # a text too long to remember is still checked
    long = json.dumps({**json.loads(text), "pad": "x" * 3000})
    assert key.verify_text(long, json.loads(long)) and long not in key._checked


UNSIGNED = (
    "extender: queue admissions are NOT signed (no --admission-key-file): any tenant able to patch its "
    "own pods can write an admission mark and skip the queue; give the controller and the extender the "
    "same key file"
)


@pytest.fixture
def fresh_warning(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """The once-per-process warning about unsigned marks not given yet, its logger captured."""
    monkeypatch.setattr(queued_module, "_unsigned_warned", threading.Event())
    caplog.set_level("WARNING", logger="gpunode.cluster.extender.queued")


def test_a_queued_pod_met_without_a_key_is_warned_about_once(
    fresh_warning: None, caplog: pytest.LogCaptureFixture
) -> None:
    """Queues by label need no --queue-config: the warning comes with the first queued pod instead."""
    assert queue_hold(v1_pod("plain", uid="u0", limits={"nvidia.com/gpu": "1"}), {}, None) is None
    assert queue_hold(queued("p", "u1"), {}, KEY) is not None
    assert not caplog.records  # no queued pod without a key yet
    for i in range(3):
        assert queue_hold(queued(f"p{i}", f"u{i}"), {}, None) is not None
    assert [r.getMessage() for r in caplog.records] == [UNSIGNED]


def test_the_key_file_and_its_flag(
    tmp_path: Path, fresh_warning: None, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "key"
    path.write_bytes(b"k" * 32 + b"the controller's and extender's secret\n")  # a trailing newline is not key
    path.chmod(0o644)  # a Secret's default mode: fine
    assert load_mark_key(path).verify(
        json.loads(admit(queued("p", "u"), "n1", ())["metadata"]["annotations"][QUEUE_ADMITTED_ANNOTATION])
    )
    cases = {
        tmp_path / "missing": "cannot read it",
        tmp_path: "cannot read it",  # a directory
        tmp_path / "short": "31 bytes of key, fewer than 32",
        tmp_path / "large": "larger than 4096 bytes",
    }
    (tmp_path / "short").write_bytes(b"s" * 31 + b"\n")
    (tmp_path / "large").write_bytes(b"l" * 5000)
    for bad, message in cases.items():
        with pytest.raises(AdmissionKeyError, match=message) as info:
            load_mark_key(bad)
        assert "\n" not in str(info.value) and info.value.hint and info.value.exit_code == 2
    with pytest.raises(AdmissionKeyError, match="fewer than 32"):
        MarkKey(b"short")

    def key_of(*flags: str) -> MarkKey | None:
        return build_extender(parser().parse_args(["extender", *flags]))[0].mark_key

    queues = tmp_path / "queues.yaml"
    queues.write_text(QUEUES)
    assert key_of("--admission-key-file", str(path), "--queue-config", str(queues)) is not None
    assert key_of() is None and not caplog.records  # no queue served: nothing to warn about
    assert key_of("--queue-config", str(queues)) is None
    assert [r.getMessage() for r in caplog.records] == [UNSIGNED]
    with pytest.raises(AdmissionKeyError, match="fewer than 32"):
        key_of("--admission-key-file", str(tmp_path / "short"))


# ----- admitted pods --------------------------------------------------------------------------------------


def test_an_admitted_gang_lands_on_its_plan_and_binds_to_its_gpus(ext: tuple[Extender, Binder]) -> None:
    extender, binder = ext
    # The plan takes GPU 1 of n2 and GPU 0 of n3; bestfit alone would take GPU 0 of n2 for the first.
    a = admit(queued("gang-0", "uid-a", gpus="1"), "n2", ("GPU-n2-1",))
    b = admit(queued("gang-1", "uid-b", gpus="1"), "n3", ("GPU-n3-0",))
    for pod, node in ((a, "n2"), (b, "n3")):
        binder.add(pod)
        result = extender.filter({"Pod": pod, "Nodes": NODES})
        assert passing(result) == [node] and result["Error"] == ""
        others = {n for n in ("n1", "n2", "n3") if n != node}
        assert set(result["FailedNodes"]) == others
        assert all(f"admitted this pod to node {node}" in r for r in result["FailedNodes"].values())
        scores = {h["Host"]: h["Score"] for h in extender.prioritize({"Pod": pod, "Nodes": NODES})}
        assert scores == {n: (10 if n == node else 0) for n in ("n1", "n2", "n3")}
    # Meanwhile a pod outside any queue cannot take the planned GPU: only GPU 0 of n2 is left there.
    other = v1_pod("plain", uid="uid-plain", limits={"nvidia.com/gpu": "2"})
    assert "n2" in extender.filter({"Pod": other, "Nodes": NODES})["FailedNodes"]
    plain = v1_pod("plain-1", uid="uid-plain-1")
    binder.add(plain)
    assert "n2" in passing(extender.filter({"Pod": plain, "Nodes": node_list(NODES["items"][1])}))
    assert extender.bind(bind_args(plain, "n2")) == {"Error": ""}
    assert binder.binds[-1] == ("team-a/plain-1", "n2", ("GPU-n2-0",))
    # The gang binds where the plan put it, to the plan's GPUs.
    assert extender.bind(bind_args(a, "n2")) == {"Error": ""}
    assert extender.bind(bind_args(b, "n3")) == {"Error": ""}
    assert binder.binds[-2:] == [
        ("team-a/gang-0", "n2", ("GPU-n2-1",)),
        ("team-a/gang-1", "n3", ("GPU-n3-0",)),
    ]


def test_a_plan_that_no_longer_fits_is_refused_so_the_controller_replans(
    ext: tuple[Extender, Binder],
) -> None:
    extender, binder = ext
    pod = admit(queued("gang-0", "uid-a"), "n1", ("GPU-n1-1",))
    binder.add(pod)
    assert passing(extender.filter({"Pod": pod, "Nodes": NODES})) == ["n1"]
    # GPU 1 of n1 is taken by a pod the controller did not know of; the node publishes it.
    taken = v1_node("n1", gpu_state("n1", [1000, 0], generation=2, pods={1: ["other/hog"]}))
    extender.refresh_nodes([taken])
    result = extender.bind(bind_args(pod, "n1"))
    assert "no longer fits" in result["Error"] and "re-plan" in result["Error"] and binder.binds == []
    filtered = extender.filter({"Pod": pod, "Nodes": node_list(taken, *NODES["items"][1:])})
    # an admitted pod whose plan fails is refused as a waiting one is: in mode error with an Error saying why
    # (failed nodes would make kube-scheduler preempt for it, evicting the GPUs' new holder when its owner
    # gave it a high PriorityClass); the controller re-plans it, and kube-scheduler tries it again at once
    shown = plan_refused(extender, filtered, "n1")
    assert "queue controller's plan (node n1, GPUs GPU-n1-1) no longer fits" in shown
    if extender.config.queue_hold == HOLD_UNSCHEDULABLE:  # the other nodes say where the plan is
        assert "admitted this pod to node n1" in filtered["FailedNodes"]["n2"]
    seen = extender.filtered.get("uid-a")
    assert seen is not None and not seen.passed_node("n1")  # a bind of the earlier answer is refused
    # a plan naming a GPU the node does not have is refused the same way
    ghost = admit(queued("gang-1", "uid-g"), "n2", ("GPU-n2-7",))
    assert "no longer fits" in plan_refused(extender, extender.filter({"Pod": ghost, "Nodes": NODES}), "n2")


def test_a_plan_whose_node_was_not_offered_is_refused(ext: tuple[Extender, Binder]) -> None:
    # kube-scheduler's own filters failed the plan's node (or it is gone): the others are offered
    extender, _ = ext
    pod = admit(queued("gang-0", "uid-a"), "n1", ("GPU-n1-1",))
    result = extender.filter({"Pod": pod, "Nodes": node_list(*NODES["items"][1:])})
    shown = plan_refused(extender, result, "n2")
    if extender.config.queue_hold == HOLD_ERROR:
        assert shown.startswith(
            "the queue controller's plan names node n1, which kube-scheduler did not offer"
        )
        assert "re-plan" in shown
    else:
        assert shown == "the queue controller admitted this pod to node n1"
    assert len(extender.reservations) == 0


def test_an_odd_plan_is_refused_in_one_clean_line(ext: tuple[Extender, Binder]) -> None:
    # The pod's owner rewrites its own mark (keeping its UID) with a node that is not offered, or GPUs named
    # with control characters, a '%' and length: the Error is one printable bounded line, no format verbs.
    extender, _ = ext
    odd = "n9\n\x1b[31m%s%d\u202e" + "x" * 5000
    away = admit(queued("gang-0", "uid-a"), odd, ("GPU-n1-0",))
    gpus = admit(queued("gang-1", "uid-b"), "n1", ("GPU-%s\r\n" + "y" * 5000, "GPU-n1-1"))
    for pod, node in ((away, "n1"), (gpus, "n1")):
        shown = plan_refused(extender, extender.filter({"Pod": pod, "Nodes": NODES}), node)
        if extender.config.queue_hold == HOLD_ERROR:
            assert "%" not in shown and "\uff05" in shown and "\x1b" not in shown and "\u202e" not in shown
            assert shown == shown.strip() and "  " not in shown


def test_an_admission_onto_gpus_freed_since_the_last_refresh_is_judged_on_fresh_nodes() -> None:
    # Names-only mode: the cache still shows GPU 0 of n1 held by a pod that has gone; the controller saw
    # it freed and admitted a pod onto it. Filter lists the nodes once and passes n1; bind uses that list.
    held = v1_node("n1", gpu_state("n1", [0, 0], pods={0: ["team-a/gone"], 1: ["other/hog"]}))
    freed = v1_node("n1", gpu_state("n1", [1000, 0], generation=2, pods={1: ["other/hog"]}))
    listed: list[list[dict[str, Any]]] = [[held]]
    binder = Binder()
    extender = Extender(
        config=ExtenderConfig(policy="bestfit"), binder=binder, node_lister=lambda: listed[-1]
    )
    extender.refresh_nodes([held])
    pod = admit(queued("late", "uid-late"), "n1", ("GPU-n1-0",))
    binder.add(pod)
    stale = extender.filter({"Pod": pod, "NodeNames": ["n1"]})
    assert passing_names(stale) == [] and "no longer fits" in plan_refused(extender, stale, "n1")
    assert extender.on_demand is not None and extender.on_demand.refreshes == 1  # it did look again
    listed.append([freed])  # the agent published the GPU free
    assert passing_names(extender.filter({"Pod": pod, "NodeNames": ["n1"]})) == ["n1"]
    assert extender.bind(bind_args(pod, "n1")) == {"Error": ""}
    assert binder.binds == [("team-a/late", "n1", ("GPU-n1-0",))]
    # A waiting pod (no admission) never costs a list.
    waiting = queued("waits", "uid-w", **{QUEUE_REASON_ANNOTATION: REASON})
    before = extender.on_demand.refreshes
    assert passing_names(extender.filter({"Pod": waiting, "NodeNames": ["n1"]})) == []
    assert extender.on_demand.refreshes == before


def test_an_admission_onto_the_gpu_of_a_pod_deleted_after_its_bind_is_not_held_by_its_reservation(
    ext: tuple[Extender, Binder],
) -> None:
    extender, binder = ext
    # A pod outside any queue binds to GPU 0 of n1 and is deleted before n1's annotation ever lists it;
    # the controller, reading that annotation, admits a queued pod onto GPU 0.
    gone = v1_pod("short", uid="uid-short")
    binder.add(gone)
    assert passing(extender.filter({"Pod": gone, "Nodes": node_list(NODES["items"][0])})) == ["n1"]
    assert extender.bind(bind_args(gone, "n1")) == {"Error": ""}
    assert binder.binds[-1] == ("team-a/short", "n1", ("GPU-n1-0",))
    pod = admit(queued("next", "uid-next"), "n1", ("GPU-n1-0",))
    binder.add(pod)
    # While the short pod exists, its reservation holds the GPU: the plan does not fit.
    assert "no longer fits" in plan_refused(extender, extender.filter({"Pod": pod, "Nodes": NODES}), "n1")
    assert extender.reservations.get("uid-short") is not None
    del binder.pods["team-a/short"]
    assert passing(extender.filter({"Pod": pod, "Nodes": NODES})) == ["n1"]
    assert extender.reservations.get("uid-short") is None
    assert extender.bind(bind_args(pod, "n1")) == {"Error": ""}
    assert binder.binds[-1] == ("team-a/next", "n1", ("GPU-n1-0",))


def passing_names(result: dict[str, Any]) -> list[str]:
    return list(result.get("NodeNames") or [])


def test_pods_outside_any_queue_are_unaffected_even_with_marks(ext: tuple[Extender, Binder]) -> None:
    extender, _ = ext
    plain = v1_pod("plain", uid="uid-plain")
    marked = v1_pod(
        "marked",
        uid="uid-marked",
        annotations={QUEUE_REASON_ANNOTATION: REASON, QUEUE_ADMITTED_ANNOTATION: '{"uid": "uid-marked"}'},
    )
    for pod in (plain, marked):
        result = extender.filter({"Pod": pod, "Nodes": NODES})
        assert passing(result) == ["n1", "n2", "n3"] and result["FailedNodes"] == {}
    # a queue label on a pod that asks for no GPU: not the controller's, scheduled as any pod
    cpu = queued("cpu-only", "uid-cpu")
    cpu["spec"]["containers"][0]["resources"] = {"requests": {"cpu": "1"}}
    assert passing(extender.filter({"Pod": cpu, "Nodes": NODES})) == ["n1", "n2", "n3"]


# ----- the reason, and the namespaces -----------------------------------------------------------------------


@pytest.mark.parametrize(
    "text",
    [
        "x" * 100_000,
        "queued\n\n0/3 nodes are available: 3 Insufficient cpu\r\x1b[31m red \x00",
        "queued in team-a\u202e gnp.exe\u200b",
        " \t\n ",
    ],
)
def test_an_odd_or_long_reason_is_bounded_and_one_line(ext: tuple[Extender, Binder], text: str) -> None:
    extender, _ = ext
    pod = queued("train-0", "uid-0", **{QUEUE_REASON_ANNOTATION: text})
    (shown,) = held(extender, extender.filter({"Pod": pod, "Nodes": NODES}))
    assert 0 < len(shown) <= MAX_REASON
    assert shown.isprintable() and shown == shown.strip() and "  " not in shown
    assert "\u202e" not in shown and "\x1b" not in shown
    if not text.strip():
        assert shown == WAITING_REASON
    assert clean_reason(None) == clean_reason(7) == WAITING_REASON
    assert clean_reason(REASON) == REASON


def test_a_percent_in_the_reason_survives_kube_schedulers_format_string(ext: tuple[Extender, Binder]) -> None:
    # kube-scheduler 1.20 builds the error with fmt.Errorf(Error): the pod's owner writes '%d %s %%' into
    # the reason; the event must not be garbled (nor the text lose what it said)
    extender, _ = ext
    pod = queued("train-0", "uid-0", **{QUEUE_REASON_ANNOTATION: "queued: 90% of quota %d %s %%"})
    (shown,) = held(extender, extender.filter({"Pod": pod, "Nodes": NODES}))
    if extender.config.queue_hold == HOLD_ERROR:
        assert shown == "queued: 90\uff05 of quota \uff05d \uff05s \uff05\uff05" and "%" not in shown
    else:  # failed-node reasons are not format strings
        assert shown == "queued: 90% of quota %d %s %%"


def test_the_hold_mode_flag(tmp_path: Path) -> None:
    def hold(*flags: str) -> str:
        return build_extender(parser().parse_args(["extender", *flags]))[0].config.queue_hold

    assert hold() == HOLD_ERROR == ExtenderConfig().queue_hold  # the default: safe on every version
    assert hold("--queue-hold", "unschedulable") == HOLD_UNSCHEDULABLE
    assert hold("--queue-hold", "error") == HOLD_ERROR
    with pytest.raises(SystemExit):
        parser().parse_args(["extender", "--queue-hold", "ignore"])
    with pytest.raises(InvalidRequest, match="queue hold must be one of error, unschedulable"):
        ExtenderConfig(queue_hold="ignore")


QUEUES = """
queues:
  - name: team-a
    guarantee: {gpu: 4}
namespaces:
  ml: team-a
"""


def test_namespaces_of_the_queue_configuration_are_held_and_reread(tmp_path: Path) -> None:
    path = tmp_path / "queues.yaml"
    path.write_text(QUEUES)
    clock = [0.0]
    namespaces = QueueNamespaces(path, check_every_s=10, clock=lambda: clock[0])
    extender = Extender(queue_namespaces=namespaces.get)
    extender.refresh_nodes(NODES["items"])
    pod = queued("train-0", "uid-0", queue=None)
    pod["metadata"]["namespace"] = "ml"
    assert passing(extender.filter({"Pod": pod, "Nodes": NODES})) == []
    # a bad file is refused; the map read before stays
    path.write_text(QUEUES + "  ml-2: no-such-queue\n")
    clock[0] = 11.0
    assert namespaces.get() == {"ml": "team-a"}
    # a good change is taken, after the check interval
    path.write_text(QUEUES.replace("ml: team-a", "other: team-a"))
    clock[0] = 15.0
    assert namespaces.get() == {"ml": "team-a"}
    clock[0] = 22.0
    assert passing(extender.filter({"Pod": pod, "Nodes": NODES})) == ["n1", "n2", "n3"]
    # a bad file at start is one QueueConfigError
    path.write_text("queues: 7\n")
    with pytest.raises(QueueConfigError):
        QueueNamespaces(path)


def test_the_cli_flag_reads_the_controllers_file(tmp_path: Path) -> None:
    path = tmp_path / "queues.yaml"
    path.write_text(QUEUES)
    extender, _ = build_extender(parser().parse_args(["extender", "--queue-config", str(path)]))
    assert extender.queue_namespaces() == {"ml": "team-a"}
    assert build_extender(parser().parse_args(["extender"]))[0].queue_namespaces() == {}
    path.write_text("queues:\n  - name: a\nnamespaces: {ml: nowhere}\n")
    with pytest.raises(QueueConfigError, match="namespaces"):
        build_extender(parser().parse_args(["extender", "--queue-config", str(path)]))


# ----- over HTTP, with the API server stand-in -----------------------------------------------------------------


@pytest.fixture
def api() -> Iterator[FakeApiServer]:
    server = FakeApiServer()
    yield server
    server.close()


def test_over_http_a_waiting_pod_is_held_and_the_admitted_one_bound_to_its_plan(api: FakeApiServer) -> None:
    extender = Extender(config=ExtenderConfig(policy="bestfit"), binder=KubeApi(api.url))
    server, client = start(extender)
    try:
        pod = queued("train-0", "uid-0", **{QUEUE_REASON_ANNOTATION: REASON})
        api.add_pod(pod)
        status, result = client.post("filter", {"Pod": pod, "Nodes": NODES})
        assert status == 200 and result["Nodes"]["items"] == [] and result["Error"] == REASON  # mode error
        status, result = client.post("bind", bind_args(pod, "n2"))
        assert status == 200 and result["Error"] and not [c for c in api.calls if c[0] != "GET"]
        admit(pod, "n2", ("GPU-n2-1",))  # the controller's write; kube-scheduler retries the pod
        status, result = client.post("filter", {"Pod": pod, "Nodes": NODES})
        assert [n["metadata"]["name"] for n in result["Nodes"]["items"]] == ["n2"]
        status, result = client.post("bind", bind_args(pod, "n2"))
        assert (status, result) == (200, {"Error": ""})
        patches = [body for method, _, body in api.calls if method == "PATCH"]
        assert patches == [{"metadata": {"annotations": {"gpunode.io/gpu-assigned": "GPU-n2-1"}}}]
        bindings = [
            body for method, path, body in api.calls if method == "POST" and path.endswith("/binding")
        ]
        assert [b["target"]["name"] for b in bindings] == ["n2"]
    finally:
        server.stop()
