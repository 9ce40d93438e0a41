"""HealthTracker: the verdict each kind of evidence supports, and when it clears (explicit clock, no I/O)."""

from __future__ import annotations

from dataclasses import dataclass, replace

import pytest

from gpunode.config.health import HealthConfig, XidPolicy
from gpunode.node.devices.base import DeviceEvent, EventKind, Gpu, GpuProbe, MigDevice
from gpunode.node.health.evidence import HealthTracker

G0, G1 = "GPU-0000", "GPU-1111"
M0, M1 = "MIG-0000-a", "MIG-0000-b"

CONFIG = HealthConfig(
    recovery_window_s=10.0,
    xid=XidPolicy(count_threshold=3, count_window_s=60.0),
    sbe_threshold=100,
    sbe_window_s=3600.0,
)


def gpus() -> tuple[Gpu, ...]:
    migs = tuple(
        MigDevice(
            uuid=u,
            parent_uuid=G0,
            index=i,
            profile="3g.40gb",
            gi_id=i + 1,
            ci_id=0,
            slices=3,
            memory_total_bytes=40 << 30,
        )
        for i, u in enumerate((M0, M1))
    )
    return (
        Gpu(index=0, uuid=G0, model="A100", memory_total_bytes=80 << 30, pci_bus_id="0:1", numa_node=0, minor=0, mig_enabled=True, mig_devices=migs),
        Gpu(index=1, uuid=G1, model="A100", memory_total_bytes=80 << 30, pci_bus_id="0:2", numa_node=0, minor=1),
    )  # fmt: skip


def tracker(config: HealthConfig = CONFIG) -> HealthTracker:
    t = HealthTracker(config)
    t.set_topology(gpus())
    return t


def ok(uuid: str, **kw: object) -> GpuProbe:
    return replace(GpuProbe(uuid=uuid, reachable=True, ecc_sbe_volatile=0, ecc_dbe_volatile=0), **kw)  # type: ignore[arg-type]


def xid(code: int, gpu: str | None = G1, mig: str | None = None) -> DeviceEvent:
    return DeviceEvent(EventKind.XID, gpu, mig_uuid=mig, xid=code)


@dataclass(frozen=True)
class Case:
    events: tuple[DeviceEvent, ...]
    unhealthy: set[str]
    kind: str = ""


CASES = {
    "ignored-xid-13": Case((xid(13),), set()),
    "ignored-xid-31-45-68": Case((xid(31), xid(45), xid(68), xid(43)), set()),
    "fatal-xid-79": Case((xid(79),), {G1}, "xid"),
    "fatal-xid-48": Case((xid(48),), {G1}, "xid"),
    "fatal-xid-109-reviewed-out-of-ignored": Case((xid(109),), {G1}, "xid"),
    "counted-below-threshold": Case((xid(150), xid(151)), set()),
    "counted-at-threshold": Case((xid(150), xid(151), xid(63)), {G1}, "xid"),
    "instance-fatal-94-on-mig-marks-the-instance": Case((xid(94, G0, M0),), {M0}, "xid"),
    "instance-fatal-94-without-mig-marks-the-gpu": Case((xid(94),), {G1}, "xid"),
    "fatal-xid-on-mig-marks-the-whole-gpu": Case((xid(95, G0, M1),), {G0}, "xid"),
    "counted-on-mig-marks-the-instance": Case((xid(150, G0, M1),) * 3, {M1}, "xid"),
    "event-without-gpu-marks-every-gpu": Case((xid(79, None),), {G0, G1}, "xid"),
    "mig-only-event-is-attributed-to-its-parent": Case((xid(94, None, M1),), {M1}, "xid"),
    "unknown-mig-instance-judges-its-gpu": Case((xid(94, G0, "MIG-unknown"),), {G0}, "xid"),
    "dbe-event-is-fatal": Case((DeviceEvent(EventKind.ECC_DBE, G1),), {G1}, "ecc_dbe"),
    "sbe-below-threshold": Case((DeviceEvent(EventKind.ECC_SBE, G1, count=99),), set()),
    "sbe-at-threshold": Case((DeviceEvent(EventKind.ECC_SBE, G1, count=60), DeviceEvent(EventKind.ECC_SBE, G1, count=40)), {G1}, "ecc_sbe"),
    "gpu-lost": Case((DeviceEvent(EventKind.GPU_LOST, G1),), {G1}, "gpu_lost"),
    "hot-plug-events-are-not-health": Case((DeviceEvent(EventKind.GPU_REMOVED, G1), DeviceEvent(EventKind.GPU_ADDED, G1)), set()),
}  # fmt: skip


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_events_mark_exactly_the_right_targets(case: Case) -> None:
    t = tracker()
    for i, event in enumerate(case.events):
        t.record_event(event, now=float(i))
    verdicts = t.evaluate(now=float(len(case.events)))
    assert set(verdicts) == case.unhealthy
    assert {v.kind for v in verdicts.values()} <= {case.kind}


def test_counted_xids_outside_the_window_do_not_add_up() -> None:
    t = tracker()
    t.record_event(xid(150), now=0.0)
    t.record_event(xid(150), now=30.0)
    t.record_event(xid(150), now=61.0)  # the first one is out of the 60 s window
    assert t.evaluate(now=61.0) == {}
    t.record_event(xid(150), now=62.0)
    assert set(t.evaluate(now=62.0)) == {G1}


def test_count_threshold_zero_never_marks() -> None:
    t = tracker(replace(CONFIG, xid=XidPolicy(count_threshold=0)))
    for i in range(50):
        t.record_event(xid(150), now=float(i))
    assert t.evaluate(now=50.0) == {}


def test_dbe_not_fatal_when_configured() -> None:
    t = tracker(replace(CONFIG, dbe_fatal=False))
    t.record_event(DeviceEvent(EventKind.ECC_DBE, G1), now=0.0)
    t.record_probe(ok(G1, ecc_dbe_volatile=1), now=1.0)
    assert t.evaluate(now=1.0) == {}


@pytest.mark.parametrize(
    ("probe", "unhealthy"),
    [
        pytest.param(ok(G1), False, id="passing"),
        pytest.param(GpuProbe(uuid=G1, reachable=False, detail="lost"), True, id="unreachable"),
        pytest.param(ok(G1, ecc_dbe_volatile=2), True, id="dbe-counter"),
        pytest.param(ok(G1, row_remap_failure=True), True, id="row-remap-failure"),
        pytest.param(ok(G1, row_remap_pending=True), True, id="row-remap-pending"),
        pytest.param(ok(G1, retired_pages_pending=True), True, id="retired-pages-pending"),
        pytest.param(ok(G1, row_remap_pending=False, row_remap_failure=False), False, id="remapper-fine"),
    ],
)
def test_probe_results(probe: GpuProbe, unhealthy: bool) -> None:
    t = tracker()
    t.record_probe(probe, now=0.0)
    assert (G1 in t.evaluate(now=0.0)) is unhealthy


def test_pending_repairs_can_be_reported_only() -> None:
    t = tracker(replace(CONFIG, pending_repair_unhealthy=False))
    t.record_probe(ok(G1, row_remap_pending=True, retired_pages_pending=True), now=0.0)
    assert t.evaluate(now=0.0) == {}


def test_probe_failure_is_a_fault() -> None:
    t = tracker()
    t.record_probe_failure(G1, "no answer within 5 s", now=0.0)
    (verdict,) = t.evaluate(now=0.0).values()
    assert verdict.target_uuid == G1 and "no answer" in verdict.reason


def test_sbe_counter_growth_counts_like_events() -> None:
    t = tracker()
    t.record_probe(ok(G1, ecc_sbe_volatile=1000), now=0.0)  # old errors: no baseline yet, not counted
    t.record_probe(ok(G1, ecc_sbe_volatile=1050), now=10.0)
    assert t.evaluate(now=10.0) == {}
    t.record_probe(ok(G1, ecc_sbe_volatile=1100), now=20.0)
    assert set(t.evaluate(now=20.0)) == {G1}


def test_sbe_events_and_counter_are_not_added_twice() -> None:
    t = tracker()
    t.record_probe(ok(G1, ecc_sbe_volatile=0), now=0.0)
    t.record_event(DeviceEvent(EventKind.ECC_SBE, G1, count=60), now=1.0)
    t.record_probe(ok(G1, ecc_sbe_volatile=60), now=2.0)  # the same 60 errors, seen by the counter
    assert t.sbe_in_window(G1, now=2.0) == 60
    assert t.evaluate(now=2.0) == {}


def test_sbe_counter_reset_starts_a_new_baseline() -> None:
    t = tracker()
    t.record_probe(ok(G1, ecc_sbe_volatile=90), now=0.0)
    t.record_probe(ok(G1, ecc_sbe_volatile=5), now=1.0)  # reset: back to a small number
    assert t.sbe_in_window(G1, now=1.0) == 0


def test_recovery_needs_passing_probes_for_the_whole_window() -> None:
    t = tracker()
    t.record_probe(ok(G1), now=0.0)
    t.record_event(xid(94), now=1.0)  # instance-fatal, on a GPU without MIG: the GPU, until the window
    t.record_probe(ok(G1), now=2.0)
    assert set(t.evaluate(now=10.9)) == {G1}  # probes pass, but the window counts from the fault
    t.record_probe(ok(G1), now=11.0)
    assert t.evaluate(now=11.0) == {}


def test_no_recovery_without_a_probe_after_the_fault() -> None:
    t = tracker()
    t.record_probe(ok(G1), now=0.0)
    t.record_event(xid(94), now=1.0)
    assert set(t.evaluate(now=100.0)) == {G1}


def test_a_failing_probe_restarts_the_recovery_window() -> None:
    t = tracker()
    t.record_event(DeviceEvent(EventKind.GPU_LOST, G1), now=0.0)
    t.record_probe(GpuProbe(uuid=G1, reachable=False), now=1.0)
    t.record_probe(ok(G1), now=2.0)
    t.record_probe(GpuProbe(uuid=G1, reachable=False), now=8.0)
    t.record_probe(ok(G1), now=9.0)
    assert set(t.evaluate(now=15.0)) == {G1}  # passing since 9 only
    t.record_probe(ok(G1), now=19.0)
    assert t.evaluate(now=19.0) == {}


def test_a_probe_problem_holds_until_it_is_gone() -> None:
    t = tracker(replace(CONFIG, recovery_window_s=0.0))
    t.record_probe(ok(G1, ecc_dbe_volatile=1), now=0.0)
    t.record_probe(ok(G1, ecc_dbe_volatile=1), now=100.0)
    assert set(t.evaluate(now=100.0)) == {G1}
    t.record_probe(ok(G1), now=101.0)  # after a reset the volatile counter is 0
    assert t.evaluate(now=101.0) == {}


def test_counted_fault_holds_while_the_count_is_over_threshold() -> None:
    t = tracker(replace(CONFIG, recovery_window_s=1.0))
    for i in range(3):
        t.record_event(xid(150, G0, M0), now=float(i))
    t.record_probe(ok(G0), now=5.0)
    assert set(t.evaluate(now=5.0)) == {M0}  # three within the last 60 s
    t.record_probe(ok(G0), now=59.0)
    assert set(t.evaluate(now=59.0)) == {M0}  # the 60 s window still holds all three
    t.record_probe(ok(G0), now=61.0)
    assert t.evaluate(now=61.0) == {}  # the first two are out of the window


def test_mig_instance_recovers_with_its_gpu_probes() -> None:
    t = tracker()
    t.record_event(xid(94, G0, M0), now=0.0)
    t.record_probe(ok(G0), now=1.0)
    assert set(t.evaluate(now=10.5)) == {M0}
    assert t.evaluate(now=11.0) == {}


def test_first_fault_names_the_episode() -> None:
    t = tracker()
    t.record_event(xid(79), now=0.0)
    t.record_event(DeviceEvent(EventKind.ECC_DBE, G1), now=1.0)
    (verdict,) = t.evaluate(now=1.0).values()
    assert verdict.xid == 79 and verdict.reason.startswith("XID 79 (GPU has fallen off the bus)")


def test_forget_drops_evidence_of_gone_gpus() -> None:
    t = tracker()
    t.record_event(xid(79, G0), now=0.0)
    t.record_event(xid(94, G0, M0), now=0.0)
    t.forget([G0])
    assert t.evaluate(now=1.0) == {}
