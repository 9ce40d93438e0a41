"""The fair-share usage memory outlives the controller process: saved to a ConfigMap, loaded by the next.

Against the API server stand-in: a leader charges usage and saves it; a new controller (a new
QueueCore and Scheduler, as a restarted process or a standby has) loads it and goes on from the
original decayed to its time, with the fair shares that follow. Hostile ConfigMaps (anyone with
ConfigMap write access in the namespace can edit it) are sent as bytes and refused with one warning
line and a counted outcome, the controller then working with no usage. SIGTERM saves.

The controllers run on a fake clock, so figures can be compared exactly; every wait is on a
condition with a generous limit.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from gpunode.cluster.queuectl.controller import QueueController
from gpunode.cluster.queuectl.core import QueueCore
from gpunode.cluster.queuectl.usage import DATA_KEY, decode
from gpunode.cluster.queuectl.usagestore import UsageStore
from gpunode.contract.names import NODE_STATE_ANNOTATION, QUEUE_ADMITTED_ANNOTATION
from gpunode.infra.kube import KubeClient
from tests.cluster.queuectl.helpers import config, node_annotation, pod
from tests.fakes.apiserver import ApiServerStandIn

WAIT_S = 60.0
NS, CM = "gpunode", "gpunode-queue-usage"
PATH = f"/api/v1/namespaces/{NS}/configmaps"
HALF_LIFE = 7200.0
T0 = 1_800_000_000.0
# No guarantees: above them the shares follow weight and usage, so usage moves them.
USAGE_YAML = """
queues:
  - {name: team-a, weight: 1}
  - {name: team-b, weight: 1}
fairShare: {halfLife: 2h, window: 24h, k: 1.0}
preemption: {notice: 1h, minRuntime: 0s, reclaim: false, priority: false}
"""
REFUSED = "queue usage not loaded"


class Clock:
    """A settable wall clock shared by the controllers of a test."""

    def __init__(self, t: float = T0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def api() -> Iterator[ApiServerStandIn]:
    with ApiServerStandIn() as server:
        server.add_node("n1", annotations={NODE_STATE_ANNOTATION: node_annotation("n1", 8)})
        yield server


def controller(api: ApiServerStandIn, clock: Clock, *, save_s: float = 3600.0, **kw: Any) -> QueueController:
    client = KubeClient.for_host(api.url)
    return QueueController(
        client,
        QueueCore(config(kw.pop("text", USAGE_YAML))),
        resync_s=0.5,
        settle_s=0.05,
        clock=clock,
        identity=kw.pop("identity", "q-0"),
        usage=UsageStore(client, NS, CM),
        usage_save_s=save_s,
        **kw,
    )


async def until(predicate: Callable[[], bool], what: str) -> None:
    async with asyncio.timeout(WAIT_S):
        while not predicate():
            await asyncio.sleep(0.02)
    assert predicate(), what


def admitted(api: ApiServerStandIn, name: str) -> bool:
    return bool((api.pod("ml", name)["metadata"].get("annotations") or {}).get(QUEUE_ADMITTED_ANNOTATION))


def stored(api: ApiServerStandIn) -> dict[str, Any] | None:
    """The state the controller last saved to the ConfigMap (decoded JSON), or None (put_configmap's
    bodies, without the controller's label, are not counted)."""
    got = [
        r
        for r in api.requests()
        if r.path.startswith(PATH)
        and r.method in ("PUT", "POST")
        and "labels" in ((r.body or {}).get("metadata") or {})
    ]
    if not got:
        return None
    body = got[-1].body
    assert isinstance(body, dict)
    return dict(json.loads(body["data"][DATA_KEY]))


def put_configmap(api: ApiServerStandIn, data: dict[str, Any]) -> None:
    """Create the ConfigMap as a tenant with ConfigMap write access would: raw JSON bytes on the wire."""
    import urllib.request

    body = json.dumps({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": CM}, "data": data})
    req = urllib.request.Request(
        f"{api.url}{PATH}", data=body.encode(), method="POST", headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=10) as resp:
        assert resp.status == 201


def loads(ctl: QueueController, outcome: str) -> float:
    return (
        ctl.metrics.registry.get_sample_value("gpunode_queue_usage_loads_total", {"outcome": outcome}) or 0.0
    )


def usage_of(ctl: QueueController) -> dict[str, dict[str, float]]:
    sched = ctl.core.sched
    assert sched is not None
    got = sched.usage_memory()
    assert got is not None
    return got[0]


async def run_until_stopped(ctl: QueueController, body: Callable[[], Any]) -> None:
    task = asyncio.create_task(ctl.run())
    try:
        await body()
    finally:
        task.cancel()  # what SIGTERM does in `gpunode queue`
        await asyncio.gather(task, return_exceptions=True)
        await ctl.client.close()


def a_leader_that_charged_an_hour(api: ApiServerStandIn, clock: Clock) -> QueueController:
    """team-a holds 4 GPUs for an hour under a first controller, which then stops (and saves)."""
    ctl = controller(api, clock)

    async def body() -> None:
        api.put_pod(pod("a0", queue="team-a", gpus=4))
        await until(lambda: admitted(api, "a0"), "a0 admitted")
        clock.t += 3600.0
        ctl._changed.set()
        await until(lambda: ctl.core._now == clock.t, "a reconcile an hour later")

    asyncio.run(run_until_stopped(ctl, body))
    return ctl


def test_a_new_controller_goes_on_from_the_saved_usage_decayed_to_its_time(api: ApiServerStandIn) -> None:
    clock = Clock()
    first = a_leader_that_charged_an_hour(api, clock)
    saved = stored(api)
    assert saved is not None and saved["at"] == T0 + 3600.0 and saved["savedBy"] == "q-0"
    assert saved["halfLifeSeconds"] == HALF_LIFE and set(saved["usage"]) == {"team-a"}
    # 4 GPUs for an hour, decayed: 4000 milli-GPU x the integral of 2**(-age/half-life) over an hour.
    expected = 4000 * HALF_LIFE / math.log(2) * (1 - 2 ** (-3600 / HALF_LIFE))
    assert saved["usage"]["team-a"]["gpu"] == pytest.approx(expected, rel=1e-9)
    clock.t += 1800.0  # the new process starts half an hour later
    assert first.core.sched is not None
    original = first.core.sched._ledger.usage(clock.t)  # type: ignore[union-attr]  # nothing charged since
    second = controller(api, clock, identity="q-1")

    async def body() -> None:
        api.put_pod(pod("b0", queue="team-b", gpus=8))  # waits: team-a holds half the node
        await until(lambda: second.reconciles >= 1 and "ml/b0" in second.core.last_jobs, "a cycle")

    asyncio.run(run_until_stopped(second, body))
    assert loads(second, "loaded") == 1 and loads(second, "refused") == 0
    got = usage_of(second)
    assert set(got) == set(original) == {"team-a"}
    for resource, value in original["team-a"].items():
        assert got["team-a"][resource] == pytest.approx(value, rel=1e-9), resource
    assert got["team-a"]["gpu"] == pytest.approx(expected * 2 ** (-1800 / HALF_LIFE), rel=1e-9)
    # With that memory team-a's share above guarantees is gone to team-b; without it they split 4:4.
    assert second.core.sched is not None
    shares = second.core.sched.shares
    assert (shares["team-a"]["gpu"], shares["team-b"]["gpu"]) == (0, 8000)
    text = second.metrics.render().decode()
    assert f'gpunode_queue_usage_gpu_seconds{{queue="team-a"}} {got["team-a"]["gpu"] / 1000}' in text
    # And it saved on stopping, going on from there: nothing was lost on the way.
    again = stored(api)
    assert again is not None and again["savedBy"] == "q-1" and again["at"] == clock.t
    assert again["usage"]["team-a"]["gpu"] == pytest.approx(got["team-a"]["gpu"], rel=1e-9)


def test_without_the_saved_usage_the_shares_are_by_weight(api: ApiServerStandIn) -> None:
    """The check above can fail: a controller that finds no ConfigMap splits the GPUs 4:4."""
    clock = Clock()
    ctl = controller(api, clock)

    async def body() -> None:
        api.put_pod(pod("a0", queue="team-a", gpus=4))
        api.put_pod(pod("b0", queue="team-b", gpus=8))
        await until(lambda: admitted(api, "a0") and "ml/b0" in ctl.core.last_jobs, "a0 admitted")
        ctl._changed.set()
        await until(lambda: ctl.reconciles >= 2, "another cycle")

    asyncio.run(run_until_stopped(ctl, body))
    assert loads(ctl, "absent") == 1
    assert ctl.core.sched is not None
    assert (ctl.core.sched.shares["team-a"]["gpu"], ctl.core.sched.shares["team-b"]["gpu"]) == (4000, 4000)


def good(at: float = T0, **over: Any) -> dict[str, Any]:
    doc: dict[str, Any] = {
        "version": 1,
        "at": at,
        "halfLifeSeconds": HALF_LIFE,
        "windowSeconds": 86400.0,
        "usage": {"team-a": {"gpu": 123456.5}},
    }
    doc.update(over)
    return doc


def text(doc: Any) -> str:
    return json.dumps(doc)


HOSTILE: dict[str, Callable[[], dict[str, str]]] = {
    "huge value": lambda: {DATA_KEY: text(good(usage={"team-a": {"gpu": 1e300}}))},
    "negative value": lambda: {DATA_KEY: text(good(usage={"team-a": {"gpu": -5.0}}))},
    "NaN": lambda: {DATA_KEY: text(good()).replace("123456.5", "NaN")},
    "infinity": lambda: {DATA_KEY: text(good()).replace("123456.5", "Infinity")},
    "out of float range": lambda: {DATA_KEY: text(good()).replace("123456.5", "1e999")},
    "string value": lambda: {DATA_KEY: text(good(usage={"team-a": {"gpu": "lots"}}))},
    "usage as a list": lambda: {DATA_KEY: text(good(usage=[["team-a", 1]]))},
    "time as text": lambda: {DATA_KEY: text(good(at="yesterday"))},
    "unknown field": lambda: {DATA_KEY: text(good(extra=1))},
    "other version": lambda: {DATA_KEY: text(good(version=2))},
    "negative half-life": lambda: {DATA_KEY: text(good(halfLifeSeconds=-1.0))},
    "a 1 MiB blob": lambda: {DATA_KEY: "x" * (1 << 20)},
    "a 300 KiB state": lambda: {
        DATA_KEY: text(good(usage={"team-a": {"gpu": 1.0}, "pad": {"x" * 300_000: 1.0}}))
    },
    "a 1 MiB valid-looking state": lambda: {
        DATA_KEY: text(good(usage={f"q{i:06d}": {"gpu": 1.0} for i in range(60000)}))
    },
    "too many unknown queues": lambda: {
        DATA_KEY: text(good(usage={f"q{i}": {"gpu": 1.0} for i in range(5000)}))
    },
    "a time in the future": lambda: {DATA_KEY: text(good(at=T0 + 3600.0))},
    "not JSON": lambda: {DATA_KEY: "{version: 1"},
    "no usage.json": lambda: {"other": "x"},
    "a log line in a name": lambda: {DATA_KEY: text(good(usage={"a\nERROR forged": {"gpu": -1.0}}))},
    "negative losses": lambda: {
        DATA_KEY: text(good(losses={"lostGpuSeconds": -1.0, "deliveredGpuSeconds": 10.0}))
    },
    "losses of unknown shape": lambda: {DATA_KEY: text(good(losses={"lostGpuSeconds": 0.0, "spare": 1}))},
}


@pytest.mark.parametrize("attack", sorted(HOSTILE))
def test_a_hostile_configmap_is_refused_with_one_line_and_the_controller_starts_without_usage(
    api: ApiServerStandIn, attack: str, caplog: pytest.LogCaptureFixture
) -> None:
    put_configmap(api, HOSTILE[attack]())
    clock = Clock()
    ctl = controller(api, clock, save_s=0.2)

    async def body() -> None:
        api.put_pod(pod("a0", queue="team-a", gpus=1))
        await until(lambda: admitted(api, "a0"), "a0 admitted all the same")
        await until(lambda: stored(api) is not None, "a save replacing it")

    with caplog.at_level(logging.INFO, logger="gpunode.cluster.queuectl"):
        asyncio.run(run_until_stopped(ctl, body))
    assert loads(ctl, "refused") == 1 and loads(ctl, "loaded") == 0
    lines = [r for r in caplog.records if REFUSED in r.getMessage()]
    assert len(lines) == 1 and lines[0].levelno == logging.WARNING, [r.getMessage() for r in lines]
    assert "\n" not in lines[0].getMessage() and "hint:" in lines[0].getMessage()
    assert usage_of(ctl) == {}  # a frozen clock charges nothing: all there is came from the ConfigMap
    saved = stored(api)
    assert saved is not None and saved["at"] == clock.t
    decode(json.dumps(saved), clock.t, "check")  # what replaced it is a state this controller reads


def test_queues_no_longer_configured_are_dropped_and_the_rest_loaded(
    api: ApiServerStandIn, caplog: pytest.LogCaptureFixture
) -> None:
    put_configmap(api, {DATA_KEY: text(good(usage={"team-a": {"gpu": 1.0e6}, "gone": {"gpu": 5.0e6}}))})
    ctl = controller(api, Clock())

    async def body() -> None:
        await until(lambda: ctl.reconciles >= 1, "a cycle")

    with caplog.at_level(logging.INFO, logger="gpunode.cluster.queuectl"):
        asyncio.run(run_until_stopped(ctl, body))
    assert loads(ctl, "loaded") == 1
    assert usage_of(ctl) == {"team-a": {"gpu": pytest.approx(1.0e6)}}
    assert any("dropped 1 queue(s)" in r.getMessage() and "'gone'" in r.getMessage() for r in caplog.records)


def test_a_time_within_clock_skew_is_taken_as_now_and_never_inflates_the_figures(
    api: ApiServerStandIn,
) -> None:
    put_configmap(api, {DATA_KEY: text(good(at=T0 + 30.0))})
    ctl = controller(api, Clock())

    async def body() -> None:
        await until(lambda: ctl.reconciles >= 1, "a cycle")

    asyncio.run(run_until_stopped(ctl, body))
    assert loads(ctl, "loaded") == 1
    assert usage_of(ctl) == {"team-a": {"gpu": pytest.approx(123456.5, rel=1e-12)}}  # not scaled up


def test_usage_saved_with_another_half_life_is_discarded_not_refused(
    api: ApiServerStandIn, caplog: pytest.LogCaptureFixture
) -> None:
    put_configmap(api, {DATA_KEY: text(good(halfLifeSeconds=3600.0))})
    ctl = controller(api, Clock())

    async def body() -> None:
        await until(lambda: ctl.reconciles >= 1, "a cycle")

    with caplog.at_level(logging.INFO, logger="gpunode.cluster.queuectl"):
        asyncio.run(run_until_stopped(ctl, body))
    assert loads(ctl, "discarded") == 1 and loads(ctl, "refused") == 0
    assert usage_of(ctl) == {}
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_a_failed_read_saves_nothing_until_a_read_succeeds(api: ApiServerStandIn) -> None:
    """A saved state is never overwritten by a leader that could not read it."""
    put_configmap(api, {DATA_KEY: text(good())})
    api.fail("GET", rf"{PATH}/{CM}$", 403, times=3)
    clock = Clock()
    ctl = controller(api, clock, save_s=0.1)

    async def body() -> None:
        await until(lambda: loads(ctl, "error") >= 3, "three failed reads")
        assert stored(api) is None  # nothing written meanwhile
        await until(lambda: loads(ctl, "loaded") == 1, "the fourth read")
        await until(lambda: stored(api) is not None, "a save")

    asyncio.run(run_until_stopped(ctl, body))
    assert usage_of(ctl) == {"team-a": {"gpu": pytest.approx(123456.5)}}
    saved = stored(api)
    assert saved is not None and saved["usage"]["team-a"]["gpu"] == pytest.approx(123456.5)


def test_sigterm_saves_the_usage(api: ApiServerStandIn, tmp_path: Path) -> None:
    """`gpunode queue` killed with SIGTERM (a rollout, a drain) saves before it exits; the save period
    is an hour here, so the ConfigMap can only come from that last save."""
    cfg = tmp_path / "queues.yaml"
    cfg.write_text(USAGE_YAML)
    api.put_pod(pod("a0", queue="team-a", gpus=2))
    proc = subprocess.Popen(
        [sys.executable, "-m", "gpunode.cli", "queue", "--config", str(cfg), "--kube-api", api.url,
         "--metrics-listen", "", "--usage-namespace", NS, "--usage-configmap", CM, "--usage-save", "1h",
         "--resync", "1s"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env={**os.environ, "POD_NAMESPACE": ""},
    )  # fmt: skip
    try:
        api.wait_for(lambda: admitted(api, "a0"), timeout=WAIT_S, what="a0 admitted")
        api.wait_for(lambda: len(api.requests("GET", rf"{PATH}/{CM}$")) >= 1, timeout=WAIT_S, what="load")
        assert stored(api) is None
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=WAIT_S)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, out
    saved = stored(api)
    assert saved is not None and saved["usage"]["team-a"]["gpu"] > 0, out
    assert b"Traceback" not in out


def test_seeded_usage_decays_with_the_half_life_and_is_forgotten_after_the_window() -> None:
    from gpunode.cluster.queueing.fairshare import UsageLedger

    ledger = UsageLedger(half_life_s=100.0, window_s=1000.0)
    ledger.charge("b", {"gpu": 1000}, 5000.0, 5010.0)
    ledger.seed("a", {"gpu": 800.0}, 5000.0)
    assert ledger.usage(5000.0 + 100.0)["a"] == {"gpu": pytest.approx(400.0, rel=1e-12)}
    assert ledger.usage(5000.0 + 300.0)["a"] == {"gpu": pytest.approx(100.0, rel=1e-12)}
    assert "a" not in ledger.usage(5000.0 + 1000.0 + 1000.0 / 64 + 1.0)  # older than the window
    with pytest.raises(ValueError, match="finite, non-negative"):
        ledger.seed("a", {"gpu": math.nan}, 7000.0)


def budget_scheduler(at: float) -> Any:
    """A Scheduler of USAGE_YAML's queues with a loss budget of 1%, on 2 nodes of 8 GPUs, its clock at `at`."""
    from gpunode.cluster.queueing.config import parse_queue_config
    from tests.cluster.queueing.sched_helpers import scheduler

    cfg = parse_queue_config(
        {
            "queues": [{"name": "team-a"}, {"name": "team-b"}],
            "fairShare": {"halfLife": "2h", "window": "24h"},
            "preemption": {"shareReclaim": {"lossBudget": 0.01}},
        },
        "test.yaml",
    )
    sched = scheduler(cfg)
    sched.cycle(at)
    return sched


def test_the_loss_budget_is_saved_with_the_usage_and_goes_on_in_the_next_scheduler() -> None:
    from gpunode.cluster.queuectl.usage import encode, seed, snapshot
    from gpunode.cluster.queueing.lossbudget import HALF_LIFE_S

    old = budget_scheduler(T0)
    old.loss_budget.delivered(16.0, T0 - 3600.0, T0)
    old.loss_budget.lost(500.0, T0)
    state = decode(encode(snapshot(old, T0, "old")).decode(), T0 + 600.0, "cm")
    assert state.losses is not None and state.losses.lost == pytest.approx(500.0)
    new = budget_scheduler(T0 + 600.0)
    assert seed(new, state, new.config, "cm").outcome == "loaded"
    f = 2 ** (-600.0 / HALF_LIFE_S)  # decayed over the ten minutes between the save and the load
    assert new.loss_budget.state(T0 + 600.0) == (pytest.approx(500.0 * f), pytest.approx(16 * 3600.0 * f))
    # a configuration change rebuilds the Scheduler in-process: the spent budget carries over too
    rebuilt = budget_scheduler(T0 + 600.0)
    assert rebuilt.inherit_usage(new, T0 + 600.0)
    assert rebuilt.loss_budget.spent(T0 + 600.0) == pytest.approx(new.loss_budget.spent(T0 + 600.0))


def test_saved_losses_no_cluster_of_this_size_could_reach_are_refused() -> None:
    from gpunode.cluster.queuectl.usage import seed

    sched = budget_scheduler(T0)
    doc = good(
        losses={"lostGpuSeconds": 0.0, "deliveredGpuSeconds": 1e12}
    )  # 16 GPUs: about 5e6 at most, with the slack
    out = seed(sched, decode(text(doc), T0, "cm"), sched.config, "cm")
    assert out.outcome == "refused" and "GPU-seconds delivered or lost" in out.message
    assert sched.loss_budget.state(T0) == (0.0, 0.0)
