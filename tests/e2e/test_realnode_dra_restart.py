"""Agent and kubelet restarts DURING NodePrepareResources, on the real kubelet 1.36 (containerd 2 with CDI).

The node, the agent and kube-scheduler are test_realnode_dra's (its DraNode and dra_node fixture, one
node for this module). The agent is caught genuinely mid-prepare from outside, with no hook in it: the
test runs it a slice at a time (SIGCONT; a millisecond, or only as long as the test takes to turn around
once a prepare is under way; SIGSTOP, every thread stopped) and reads
what is on disk while it is stopped, until a new claim's record says `preparing` in the state wanted
(a region made and no CDI spec yet, say). What it then sees is what a crash at that instant leaves.
A stop that lands after the prepare has finished is retried with another pod, a bounded number of
times.

- the agent SIGKILLed mid-prepare and started again: it rolls the claim back, the kubelet's retry
  prepares it once (one region, one CDI spec, one record, the container under its cap), nothing else
  is made, and deleting the pod removes all of it;
- the kubelet restarted while the agent is stopped mid-prepare, then the agent continued: the prepare
  in flight completes, the new kubelet's call is answered from its record (the same region and spec),
  the pod runs, and nothing is left after it;
- a burst of pods with the agent SIGKILLed and started again twice in it: every pod runs, one region
  and one CDI spec per claim, the node's ResourceSlices keep their names and devices.

A kill while the agent stages the claim's region, or writes its record, leaves the staged directory
`.tmp-claim-<uid>-*` (or the file `.<uid>.json.<pid>.tmp`) under `<stateDir>/dra`; the restarted agent
removes it before it serves (two parameters of the first test).

What counts as the claim's files: its record `<stateDir>/dra/claims/<uid>.json`, its region
`<stateDir>/dra/memcap/claim-<uid>`, its spec `<cdiDir>/<driver>-<uid>.json`, and any temporary file or
directory naming its UID in those three directories (a staged region `.tmp-claim-<uid>-*`, a staged
record or spec `.<name>.<pid>.tmp`, a region being removed `.trash-claim-<uid>-*`).
"""

from __future__ import annotations

import json
import os
import re
import signal
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import pytest

from gpunode.contract import dra as names
from gpunode.node import memcap
from gpunode.node.dra.checkpoint import PREPARED, PREPARING
from tests.e2e.api import Api, eventually
from tests.e2e.controlplane import KUBE_MINOR
from tests.e2e.objects import get_pod
from tests.e2e.procs import Proc
from tests.e2e.test_realnode_dra import (  # helpers and the fixture only: no test is collected twice
    DRIVER,
    GIB,
    NAMESPACE,
    RESOURCE,
    WAIT_S,
    DraNode,
    _claim_pod,
    _complete_pool,
    _delete_and_wait,
    _report,
    _slices_of_driver,
    _template,
    dra_node,
)

__all__ = ["dra_node"]  # the module-scoped fixture, used by the tests below

# DRA mode needs Kubernetes 1.36+ (see tests/e2e/test_dra_slices.py).
pytestmark = pytest.mark.skipif(
    KUBE_MINOR < 36, reason=f"DRA mode needs Kubernetes 1.36+ (this is 1.{KUBE_MINOR})"
)

TEMPLATE, CAP = "gpu-1gi-restart", "1Gi"
BURST = 6  # pods created at once in the burst test
CATCH_ATTEMPTS = 4  # pods tried before giving up on stopping the agent mid-prepare
RUN_SLICE_S = 0.001  # how long the agent runs between two stops until a prepare is under way
STOP_WAIT_S = 10.0  # a thread in an uninterruptible write stops when the write is done
UID_RE = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")


class NotCaught(RuntimeError):
    """The agent could not be stopped in the state wanted (not a verdict on the product)."""


# -- the claims' files ---------------------------------------------------------------------------


@dataclass(frozen=True)
class ClaimFiles:
    """What the node holds for one claim UID."""

    state: str | None  # its record's state; None without a record
    region: bool
    spec: bool
    temps: tuple[str, ...] = ()  # temporary files and directories naming the claim


DONE = ClaimFiles(PREPARED, region=True, spec=True)  # a capped claim prepared, nothing else


def _names(directory: Path) -> list[str]:
    try:
        return os.listdir(directory)
    except FileNotFoundError:
        return []


def _record_state(path: Path) -> str | None:
    try:
        return str(json.loads(path.read_text())["state"])
    except FileNotFoundError:  # removed between the listing and the read (the agent is running)
        return None


def on_disk(dn: DraNode) -> dict[str, ClaimFiles]:
    """Every claim UID the node holds a file of, and what it holds (consistent while the agent is stopped)."""
    states: dict[str, str | None] = {}
    regions: set[str] = set()
    specs: set[str] = set()
    temps: dict[str, list[str]] = {}
    places = (
        ("dra/claims", dn.state / "dra" / "claims"),
        ("dra/memcap", dn.state / "dra" / "memcap"),
        ("cdi", dn.node.cdi_dir),
    )
    for where, directory in places:
        for name in _names(directory):
            match = UID_RE.search(name)
            if match is None:
                continue
            uid = match.group(0)
            if where == "dra/claims" and name == f"{uid}.json":
                states[uid] = _record_state(directory / name)
            elif where == "dra/memcap" and name == names.claim_region_key(uid):
                regions.add(uid)
            elif where == "cdi" and name == f"{DRIVER}-{uid}.json":
                specs.add(uid)
            else:
                temps.setdefault(uid, []).append(f"{where}/{name}")
    return {
        uid: ClaimFiles(states.get(uid), uid in regions, uid in specs, tuple(sorted(temps.get(uid, ()))))
        for uid in {*states, *regions, *specs, *temps}
    }


def new_claims(dn: DraNode, known: set[str]) -> dict[str, ClaimFiles]:
    return {u: f for u, f in on_disk(dn).items() if u not in known}


def region_generation(dn: DraNode, uid: str) -> int:
    return memcap.load_region(dn.state / "dra" / "memcap" / names.claim_region_key(uid)).generation


def spec_identity(dn: DraNode, uid: str) -> tuple[int, int]:
    st = (dn.node.cdi_dir / f"{DRIVER}-{uid}.json").stat()
    return st.st_ino, st.st_mtime_ns


# -- the agent's process -------------------------------------------------------------------------


def _pid(agent: Proc) -> int:
    assert agent.popen is not None, "the agent was never started"
    return agent.popen.pid


def _all_stopped(pid: int) -> bool:
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
    except FileNotFoundError:  # exited: sigstop says so
        return False
    for task in tasks:
        try:
            stat = (task / "stat").read_text()
        except FileNotFoundError:  # a thread that ended
            continue
        if stat[stat.rindex(")") + 2] not in "Tt":
            return False
    return True


def sigstop(agent: Proc) -> None:
    """Stop the agent and wait until every thread of it is stopped (a write in flight is then done)."""
    pid = _pid(agent)
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + STOP_WAIT_S
    while not _all_stopped(pid):
        if not agent.running():
            raise NotCaught(f"the agent exited while being stopped:\n{agent.tail()}")
        if time.monotonic() > deadline:
            raise NotCaught(f"the agent's threads did not all stop within {STOP_WAIT_S:.0f}s")
        time.sleep(0.0002)


def sigcont(agent: Proc) -> None:
    if agent.running():
        os.kill(_pid(agent), signal.SIGCONT)


def kill_and_restart(dn: DraNode) -> int:
    """SIGKILL the agent (stopped or not) and start it again; the new log's offset in the agent's log."""
    os.killpg(_pid(dn.agent), signal.SIGKILL)
    dn.agent.popen.wait(30)  # type: ignore[union-attr]
    offset = dn.agent.log.stat().st_size
    dn.restart_agent()  # (its stop() reaps what is already dead)
    return offset


def prepared_lines(dn: DraNode, uid: str) -> int:
    """How often the agent logged that it prepared the claim (each prepare that made its files logs once)."""
    text = dn.agent.log.read_text(errors="replace")
    return sum(1 for line in text.splitlines() if "DRA: prepared claim" in line and f"({uid})" in line)


def log_since(dn: DraNode, offset: int) -> str:
    with open(dn.agent.log, "rb") as f:
        f.seek(offset)
        return f.read().decode(errors="replace")


Want = Callable[[dict[str, ClaimFiles]], str | None]


def stop_mid_prepare(dn: DraNode, known: set[str], want: Want, *, claims: int) -> str | None:
    """Run the agent a slice at a time until `want` names a new claim in the snapshot taken while it is
    stopped; that claim's UID, the agent left stopped. None (the agent running) when all `claims` new claims
    were prepared first."""
    agent = dn.agent
    deadline = time.monotonic() + WAIT_S
    while True:
        sigstop(agent)
        fresh = new_claims(dn, known)
        uid = want(fresh)
        if uid is not None:
            return uid
        sigcont(agent)
        if sum(f.state == PREPARED for f in fresh.values()) >= claims:
            return None
        if time.monotonic() > deadline:
            raise NotCaught(
                f"in {WAIT_S:.0f}s no new claim was caught in the state wanted nor prepared (the node holds {fresh})"
            )
        # once a prepare is under way, the agent runs only while this process turns around (a finer step)
        if not any(f.state == PREPARING or f.temps for f in fresh.values()):
            time.sleep(RUN_SLICE_S)


def region_without_spec(fresh: dict[str, ClaimFiles]) -> str | None:
    """A claim recorded `preparing` whose region is made and CDI spec is not, with no temporary file."""
    for uid, f in fresh.items():
        if f == ClaimFiles(PREPARING, region=True, spec=False):
            return uid
    return None


def region_staged(fresh: dict[str, ClaimFiles]) -> str | None:
    """A claim recorded `preparing` whose region the agent is staging (`.tmp-claim-<uid>-*`)."""
    for uid, f in fresh.items():
        if f.state == PREPARING and any(t.startswith("dra/memcap/.tmp-") for t in f.temps):
            return uid
    return None


def record_staged(fresh: dict[str, ClaimFiles]) -> str | None:
    """A claim recorded `preparing` whose `prepared` record the agent is staging (`.<uid>.json.<pid>.tmp`)."""
    for uid, f in fresh.items():
        if f.state == PREPARING and any(t.startswith("dra/claims/.") for t in f.temps):
            return uid
    return None


def any_preparing(fresh: dict[str, ClaimFiles]) -> str | None:
    for uid, f in fresh.items():
        if f.state == PREPARING:
            return uid
    return None


def preparing_without_temps(fresh: dict[str, ClaimFiles]) -> str | None:
    """A claim recorded `preparing` while no claim has a temporary file (what the burst kills)."""
    if any(f.temps for f in fresh.values()):
        return None
    return any_preparing(fresh)


# -- pods ----------------------------------------------------------------------------------------


def claim_uid(api: Api, pod: str) -> str:
    """The UID of the ResourceClaim made for the pod from its template."""

    def name() -> str | None:
        statuses = get_pod(api, NAMESPACE, pod)["status"].get("resourceClaimStatuses") or []
        return statuses[0].get("resourceClaimName") if statuses else None

    claim = eventually(name, timeout_s=WAIT_S, what=f"{pod}'s ResourceClaim")
    return str(api.get(f"{RESOURCE}/namespaces/{NAMESPACE}/resourceclaims/{claim}")["metadata"]["uid"])


def runs_under_its_cap(dn: DraNode, pod: str) -> None:
    report = _report(dn, pod)
    log = dn.node.container_log(NAMESPACE, pod, "main")
    # The GPU has 15 GiB: only the interposer and the claim's region, mounted from its CDI spec, stop it at 1 GiB.
    assert (report.allocated, report.total) == (GIB, GIB), log


@pytest.fixture
def admin(dra_node: DraNode) -> Iterator[Api]:
    api = dra_node.cp.api()
    _template(api, TEMPLATE, CAP)
    yield api
    sigcont(dra_node.agent)  # a failed test must not leave the agent stopped


def catch(dn: DraNode, admin: Api, prefix: str, known: set[str], want: Want, what: str) -> tuple[str, str]:
    """Create pods one at a time until the agent is stopped with `want`'s claim; (pod, claim UID)."""
    for attempt in range(1, CATCH_ATTEMPTS + 1):
        pod = f"{prefix}-{attempt}"
        _claim_pod(admin, pod, TEMPLATE)
        uid = stop_mid_prepare(dn, known, want, claims=1)
        if uid is not None:
            return pod, uid
        _delete_and_wait(admin, dn, pod)  # prepared before a stop landed: another pod
        eventually(lambda: new_claims(dn, known) == {}, timeout_s=WAIT_S, what=f"{pod}'s claim unprepared")
    raise NotCaught(
        f"the agent finished each of {CATCH_ATTEMPTS} prepares before it was stopped {what}; "
        "the stops do not land finely enough on this node"
    )


# -- the tests -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "want",
    [
        pytest.param(region_without_spec, id="region-made-spec-not"),
        pytest.param(region_staged, id="region-staged"),  # the restarted agent removes the staging directory
        pytest.param(record_staged, id="record-staged"),  # and the record's temporary file
    ],
)
def test_an_agent_killed_mid_prepare_is_prepared_once_by_the_kubelets_retry(
    dra_node: DraNode, admin: Api, want: Want
) -> None:
    dn = dra_node
    known = set(on_disk(dn))
    pod, uid = catch(dn, admin, "dra-killed", known, want, f"in {want.__name__}")
    try:
        caught = new_claims(dn, known)
        assert caught[uid].state == PREPARING, caught  # what is on disk says: mid-prepare
        offset = kill_and_restart(dn)
        # the restarted agent rolls the claim back before it serves; the kubelet's retry prepares it
        eventually(
            lambda: "rolled back" in log_since(dn, offset),
            timeout_s=WAIT_S,
            what="the restarted agent rolling back the claim left mid-prepare",
        )
        runs_under_its_cap(dn, pod)
        assert claim_uid(admin, pod) == uid
        running = new_claims(dn, known)
        assert set(running) == {uid}  # nothing made for any other claim
        assert replace(running[uid], temps=()) == DONE  # one region, one spec, one record
        assert prepared_lines(dn, uid) == 1  # the killed agent never finished it; the retry made it once
    finally:
        _delete_and_wait(admin, dn, pod)
    eventually(
        lambda: all(f == ClaimFiles(None, False, False, f.temps) for f in new_claims(dn, known).values()),
        timeout_s=WAIT_S,
        what="the claim unprepared: its record, region and spec gone",
    )
    # no temporary file of the claim while it ran, and none left after it
    assert (running[uid].temps, new_claims(dn, known)) == ((), {})


def test_a_kubelet_restarted_while_the_agent_is_stopped_mid_prepare_gets_the_claim_prepared_once(
    dra_node: DraNode, admin: Api
) -> None:
    dn = dra_node
    known = set(on_disk(dn))
    pod, uid = catch(dn, admin, "dra-kubelet-restart", known, any_preparing, "in any preparing state")
    try:
        caught = new_claims(dn, known)
        assert caught[uid].state == PREPARING, caught  # what is on disk says: mid-prepare
        offset = dn.agent.log.stat().st_size
        dn.node.restart_kubelet()  # the kubelet's call in flight is gone with it; the agent is still stopped
        sigcont(dn.agent)  # the prepare in flight completes
        eventually(
            lambda: new_claims(dn, known).get(uid) == DONE,
            timeout_s=WAIT_S,
            what="the prepare in flight completing",
        )
        made = (region_generation(dn, uid), spec_identity(dn, uid))
        runs_under_its_cap(dn, pod)  # the new kubelet registered the driver again and asked again
        assert new_claims(dn, known) == {uid: DONE}
        # the new kubelet's call was answered from the record: the same region and spec, made once
        assert (region_generation(dn, uid), spec_identity(dn, uid)) == made
        assert prepared_lines(dn, uid) == 1
        assert "the kubelet registered driver" in log_since(dn, offset)  # by the new kubelet
    finally:
        _delete_and_wait(admin, dn, pod)
    eventually(lambda: new_claims(dn, known) == {}, timeout_s=WAIT_S, what="the claim unprepared")


def test_a_burst_of_pods_through_two_agent_kills_prepares_each_claim_once(
    dra_node: DraNode, admin: Api
) -> None:
    dn = dra_node
    slices = eventually(lambda: _complete_pool(admin), timeout_s=WAIT_S, what="the node's whole pool")
    before = _slices_of_driver(admin)
    assert sorted(d for devices in before.values() for d in devices) == slices
    known = set(on_disk(dn))
    pods = [f"dra-burst-{n}" for n in range(BURST)]
    for pod in pods:
        _claim_pod(admin, pod, TEMPLATE)
    try:
        for kill in (1, 2):
            uid = stop_mid_prepare(dn, known, preparing_without_temps, claims=BURST)
            if uid is None:
                raise NotCaught(f"all {BURST} claims were prepared before kill {kill} landed")
            fresh = new_claims(dn, known)
            assert fresh[uid].state == PREPARING and sum(f.state == PREPARED for f in fresh.values()) < BURST
            offset = kill_and_restart(dn)
            eventually(
                lambda o=offset: "rolled back" in log_since(dn, o),
                timeout_s=WAIT_S,
                what=f"the agent restarted after kill {kill} rolling back its claims left mid-prepare",
            )
        for pod in pods:
            runs_under_its_cap(dn, pod)
        uids = {claim_uid(admin, pod) for pod in pods}
        assert len(uids) == BURST
        assert new_claims(dn, known) == dict.fromkeys(uids, DONE)  # N regions, N specs, no temp file
        # no claim prepared twice; a kill that lands between a prepare's record and its log line (both
        # kills stop the agent in the middle of a burst) loses the line, not the claim, whose files are
        # checked just above
        lines = {u: prepared_lines(dn, u) for u in uids}
        assert all(n <= 1 for n in lines.values()), lines
        # the restarted agents found their pool unchanged: the same slices, with the same devices
        eventually(
            lambda: _complete_pool(admin) == slices, timeout_s=WAIT_S, what="the node's whole pool again"
        )
        assert _slices_of_driver(admin) == before
    finally:
        for pod in pods:
            admin.delete(f"/api/v1/namespaces/{NAMESPACE}/pods/{pod}")
        for pod in pods:
            _delete_and_wait(admin, dn, pod)
    eventually(lambda: new_claims(dn, known) == {}, timeout_s=WAIT_S, what=f"the {BURST} claims unprepared")
