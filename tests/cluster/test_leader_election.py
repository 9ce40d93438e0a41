"""Leader election on a Lease (gpunode.infra.kube.lease) against the API server stand-in.

Each step is driven with a clock of the test's own, so that expiry is decided by the test and not by
how fast a loaded machine runs; the loop itself is run with real time and generous waits.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest

from gpunode.errors import ConfigError, KubeConflict
from gpunode.infra.kube import ElectionConfig, KubeClient, LeaderElector, LeaseLock, LeaseRecord
from tests.fakes.apiserver import ApiServerStandIn

NS, NAME = "gpu-system", "gpunode-extender"


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def api() -> Iterator[ApiServerStandIn]:
    with ApiServerStandIn() as server:
        yield server


def elector(api: ApiServerStandIn, identity: str, clock: Clock, **timing: float) -> LeaderElector:
    config = ElectionConfig(namespace=NS, name=NAME, identity=identity, **timing)
    return LeaderElector(LeaseLock(KubeClient.for_host(api.url), NS, NAME), config, clock=clock)


def spec(api: ApiServerStandIn) -> dict[str, object]:
    lease = api.lease(NS, NAME)
    assert lease is not None
    return dict(lease["spec"])


def test_first_candidate_creates_the_lease_and_the_second_waits(api: ApiServerStandIn) -> None:
    async def main() -> None:
        a_clock, b_clock = Clock(), Clock()
        a, b = elector(api, "a", a_clock), elector(api, "b", b_clock)
        assert await a.try_acquire_or_renew() and a.is_leader()
        first = spec(api)
        assert (first["holderIdentity"], first["leaseDurationSeconds"], first["leaseTransitions"]) == (
            "a",
            15,
            0,
        )
        assert first["acquireTime"] == first["renewTime"]
        assert not await b.try_acquire_or_renew() and not b.is_leader() and b.leader == "a"
        # b's clock passes the lease duration, but a renewed meanwhile: b saw the record change.
        b_clock.now += 14
        a_clock.now += 2
        assert await a.try_acquire_or_renew()
        b_clock.now += 14
        assert not await b.try_acquire_or_renew()
        renewed = spec(api)
        assert renewed["acquireTime"] == first["acquireTime"] and renewed["renewTime"] != first["renewTime"]
        assert renewed["leaseTransitions"] == 0

    asyncio.run(main())


def test_a_lease_not_renewed_for_its_duration_is_taken_over(api: ApiServerStandIn) -> None:
    async def main() -> None:
        a_clock, b_clock = Clock(), Clock()
        a, b = elector(api, "a", a_clock), elector(api, "b", b_clock)
        assert await a.try_acquire_or_renew()
        assert not await b.try_acquire_or_renew()
        b_clock.now += 15.01  # nothing changed on the Lease for its whole duration, as b measures it
        assert await b.try_acquire_or_renew() and b.is_leader()
        taken = spec(api)
        assert (taken["holderIdentity"], taken["leaseTransitions"]) == ("b", 1)
        # a, whose own deadline has passed, finds b holding the Lease and stays out.
        a_clock.now += 10.01
        assert not a.is_leader()
        assert not await a.try_acquire_or_renew() and not a.is_leader() and a.leader == "b"
        assert spec(api)["holderIdentity"] == "b"

    asyncio.run(main())


def test_a_leader_stops_leading_at_its_renew_deadline_without_asking_anyone(api: ApiServerStandIn) -> None:
    async def main() -> None:
        clock = Clock()
        a = elector(api, "a", clock)
        assert await a.try_acquire_or_renew()
        clock.now += 9.9
        assert a.is_leader() and not a.is_leader(margin_s=0.2)
        assert a.takeover_in() == pytest.approx(5.1)  # others wait 15 s from the renewal sent at 0
        api.stop()  # the API server goes away: no renewal can succeed
        clock.now += 0.2
        assert not a.is_leader() and a.takeover_in() == 0.0

    asyncio.run(main())


def test_of_two_candidates_writing_the_same_version_one_gets_a_conflict(api: ApiServerStandIn) -> None:
    async def main() -> None:
        a_clock, b_clock, c_clock = Clock(), Clock(), Clock()
        a, b, c = elector(api, "a", a_clock), elector(api, "b", b_clock), elector(api, "c", c_clock)
        assert await a.try_acquire_or_renew()
        stale = await b.lock.get()
        assert stale is not None
        assert not await b.try_acquire_or_renew() and not await c.try_acquire_or_renew()
        b_clock.now += 16
        c_clock.now += 16
        assert await c.try_acquire_or_renew()  # c writes first
        # b writes the version it read before c's write: the API server answers 409.
        with pytest.raises(KubeConflict):
            await b.lock.update(LeaseRecord("b", 15, "x", "x", stale.transitions + 1, stale.resource_version))

        class Stale(LeaseLock):
            async def get(self) -> LeaseRecord | None:
                return stale

        late = LeaderElector(Stale(b.lock.client, NS, NAME), b.config, clock=b_clock)
        late._observed, late._observed_at = stale, b_clock.now - 16
        assert not await late.try_acquire_or_renew() and not late.is_leader()
        assert spec(api)["holderIdentity"] == "c"

    asyncio.run(main())


def test_release_lets_a_standby_take_over_at_once(api: ApiServerStandIn) -> None:
    async def main() -> None:
        a, b = elector(api, "a", Clock()), elector(api, "b", Clock())
        assert await a.try_acquire_or_renew()
        assert not await b.try_acquire_or_renew()
        assert await a.release() and not a.is_leader()
        released = spec(api)
        assert (released["holderIdentity"], released["leaseDurationSeconds"]) == ("", 1)
        assert await b.try_acquire_or_renew()  # no waiting: nobody holds it
        assert spec(api)["leaseTransitions"] == 1
        assert not await a.release()  # not held by a: nothing written
        assert spec(api)["holderIdentity"] == "b"

    asyncio.run(main())


def test_the_loop_leads_steps_down_when_the_api_server_is_gone_and_leads_again(api: ApiServerStandIn) -> None:
    events: list[str] = []

    async def main() -> None:
        config = ElectionConfig(
            namespace=NS, name=NAME, identity="a", lease_duration_s=3, renew_deadline_s=2, retry_period_s=0.2
        )
        started, stopped = asyncio.Event(), asyncio.Event()

        async def on_started() -> None:
            events.append("started")
            started.set()

        def on_stopped() -> None:
            events.append("stopped")
            stopped.set()

        a = LeaderElector(
            LeaseLock(KubeClient.for_host(api.url), NS, NAME),
            config,
            on_started=on_started,
            on_stopped=on_stopped,
        )
        task = asyncio.create_task(a.run())
        await asyncio.wait_for(started.wait(), 30)
        assert a.is_leader()
        api.stop()
        await asyncio.wait_for(stopped.wait(), 30)
        assert not a.is_leader()
        started.clear()
        api.start()
        await asyncio.wait_for(started.wait(), 30)  # still the holder: it renews and leads again
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        assert not a.is_leader()

    asyncio.run(main())
    assert events == ["started", "stopped", "started", "stopped"]
    assert spec(api)["holderIdentity"] == ""  # cancelled: released


@pytest.mark.parametrize(
    "timing",
    [
        {"lease_duration_s": 10, "renew_deadline_s": 10},
        {"lease_duration_s": 15, "renew_deadline_s": 2, "retry_period_s": 2},
        {"retry_period_s": 0},
    ],
)
def test_timing_that_cannot_work_is_a_config_error(timing: dict[str, float]) -> None:
    with pytest.raises(ConfigError) as exc:
        ElectionConfig(namespace=NS, name=NAME, identity="a", **timing)
    assert "lease duration > renew deadline > 1.2 x retry period" in (exc.value.hint or "")
