"""Idle-first preemption in the controller: the node agent's idle flag read from pods, and the heap frozen."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator
from typing import Any

import pytest

from gpunode.cluster.queuectl.core import Actions, QueueCore
from gpunode.cluster.queuectl.jobs import group_jobs, queued_pod
from gpunode.contract.names import GPU_IDLE_ANNOTATION
from tests.cluster.queuectl.helpers import CONFIG_YAML, config, node, pod

IDLE_FIRST = CONFIG_YAML.replace("minRuntime: 0s}", "minRuntime: 0s, idleFirst: true}")
T990 = "1970-01-01T00:16:30Z"  # 990 s after the epoch, the tests' clock


@pytest.fixture(autouse=True)
def _unfreeze() -> Iterator[None]:
    yield
    gc.unfreeze()


def _pod(name: str, uid: str, idle: str | None = None, **kw: Any) -> dict[str, Any]:
    p = pod(name, **kw)
    p["metadata"]["uid"] = uid
    if idle is not None:
        p["metadata"]["annotations"] = {GPU_IDLE_ANNOTATION: idle}
    return p


def _apply(core: QueueCore, now: float) -> Actions:
    """One reconcile, its annotations written back onto the pods (as the API server would)."""
    actions = core.reconcile(now)
    for a in actions.annotate:
        notes = core.pods[a.pod.key]["metadata"].setdefault("annotations", {})
        for k, v in a.annotations.items():
            if v is None:
                notes.pop(k, None)
            else:
                notes[k] = v
    return actions


def _victims(text: str, idle: str | None) -> list[tuple[str, str]]:
    """team-a runs a0 (within its guarantee) and a1 (borrowed), 4 GPUs each from 1000; then b0 reclaims.

    `idle`: the gpunode.io/gpu-idle-since value the node agent (or the tenant) wrote on a1.
    """
    core = QueueCore(config(text))
    core.node_changed(node("n1", 8))
    core.pod_changed(_pod("a0", "u0", gpus=4))
    core.pod_changed(_pod("a1", "u1", gpus=4, created="2026-01-01T00:00:01Z"))
    assert _apply(core, 1000.0).admitted_jobs == ["ml/a0", "ml/a1"]
    if idle is not None:
        core.pods["ml/a1"]["metadata"]["annotations"][GPU_IDLE_ANNOTATION] = idle
    core.pod_changed(_pod("b0", "ub", queue="team-b", gpus=4))
    return _apply(core, 1010.0).preempted_jobs


def test_an_idle_borrowed_job_is_the_victim_with_idle_first() -> None:
    # equal lost work: by name a0 would go; a1 is flagged idle and borrowed, so it goes first
    assert _victims(IDLE_FIRST, T990) == [("ml/a1", "idle")]


def test_without_idle_first_or_without_a_readable_flag_the_old_order_holds() -> None:
    assert _victims(CONFIG_YAML, T990) == [("ml/a0", "reclaim")]
    assert _victims(IDLE_FIRST, None) == [("ml/a0", "reclaim")]
    for forged in ("yesterday", "", '{"since": 1}', "9" * 5000):  # a tenant's malformed value: ignored
        assert _victims(IDLE_FIRST, forged) == [("ml/a0", "reclaim")]


def test_a_job_is_idle_only_when_every_pod_is_flagged_and_since_the_latest() -> None:
    cfg = config()
    flags = {"g0": "1970-01-01T00:10:00Z", "g1": "1970-01-01T00:15:00Z"}

    def since(**idle: str | None) -> float | None:
        pods = [_pod(n, n, idle.get(n), gpus=1, gang="g", size=2) for n in ("g0", "g1")]
        queued = [q for p in pods if (q := queued_pod(p, cfg))]
        return group_jobs(queued)["ml/g"].idle_since

    assert since(**flags) == 900.0
    assert since(g0=flags["g0"]) is None  # one member still busy
    assert since(g0=flags["g0"], g1="not a time") is None


def test_a_rebuild_freezes_the_heap_and_lets_the_previous_scheduler_go() -> None:
    core = QueueCore(config())
    core.node_changed(node("n1", 8))
    core.pod_changed(_pod("a0", "u0", gpus=4))
    _apply(core, 1000.0)
    assert core.rebuilds == 1 and gc.get_freeze_count() > 0
    old = weakref.ref(core.sched)
    core.set_config(config())  # the next reconcile rebuilds
    _apply(core, 1001.0)
    assert core.rebuilds == 2 and core.sched is not None
    assert old() is None  # collected, not kept in the frozen generation
