"""Fatal XIDs hold their GPU until a reset: the tracker's holds (explicit clock) and the files that keep them.

No assertion here depends on timing: time is an explicit number, and the state is asserted after the fact.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import pytest

from gpunode.config.health import HealthConfig, XidPolicy
from gpunode.errors import HealthStateError
from gpunode.node.devices.base import DeviceEvent, EventKind, Gpu, GpuProbe
from gpunode.node.health.evidence import HealthTracker, HeldFault
from gpunode.node.health.holds import ClearRequest, HoldStore, request_clear

G0, G1 = "GPU-0000", "GPU-1111"
WINDOW = 1.0
CONFIG = HealthConfig(recovery_window_s=WINDOW, xid=XidPolicy(count_threshold=3, count_window_s=2.0))


def tracker() -> HealthTracker:
    t = HealthTracker(CONFIG)
    t.set_topology(
        Gpu(
            index=i,
            uuid=u,
            model="H100",
            memory_total_bytes=80 << 30,
            pci_bus_id=f"0:{i}",
            numa_node=0,
            minor=i,
        )
        for i, u in enumerate((G0, G1))
    )
    return t


def probe(uuid: str = G1, *, energy: float = 1000.0, sbe: int = 0, dbe: int = 0) -> GpuProbe:
    return GpuProbe(uuid=uuid, reachable=True, ecc_sbe_volatile=sbe, ecc_dbe_volatile=dbe, energy_j=energy)


def xid(code: int, gpu: str = G1) -> DeviceEvent:
    return DeviceEvent(EventKind.XID, gpu, xid=code)


def run_probes(t: HealthTracker, start: float, windows: int, *, energy: float = 1000.0) -> float:
    """Passing probes, ten per recovery window, for `windows` windows; returns the time after the last one."""
    now = start
    for _ in range(windows * 10):
        now += WINDOW / 10
        energy += 50.0  # the energy count grows as the GPU runs
        t.record_probe(probe(energy=energy), now)
    return now


def test_xid_79_is_held_past_many_recovery_windows() -> None:
    t = tracker()
    t.record_probe(probe(energy=1000.0), now=0.0)
    t.record_event(xid(79), now=1.0)
    now = run_probes(t, 1.0, windows=20, energy=1000.0)
    verdict = t.evaluate(now)
    assert set(verdict) == {G1}
    assert verdict[G1].xid == 79 and "needs a GPU reset" in verdict[G1].reason
    assert set(t.holds()) == {G1}


@pytest.mark.parametrize("code", [48, 62, 74, 79, 95, 109, 119, 140])
def test_every_fatal_xid_holds(code: int) -> None:
    t = tracker()
    t.record_event(xid(code), now=0.0)
    assert set(t.evaluate(run_probes(t, 0.0, windows=5))) == {G1}


@pytest.mark.parametrize(
    ("before", "after", "counter"),
    [
        ({"energy": 5000.0}, {"energy": 12.0}, "energy_j"),
        ({"energy": 5000.0, "sbe": 40}, {"energy": 9000.0, "sbe": 0}, "ecc_sbe_volatile"),
        ({"energy": 5000.0, "dbe": 2}, {"energy": 9000.0, "dbe": 0}, "ecc_dbe_volatile"),
    ],
)
def test_a_reset_seen_in_the_counters_releases_the_hold(
    before: dict[str, float], after: dict[str, float], counter: str
) -> None:
    t = tracker()
    t.record_probe(probe(**before), now=0.0)  # type: ignore[arg-type]
    t.record_event(xid(79), now=0.5)
    t.record_probe(probe(**before), now=1.0)  # type: ignore[arg-type]
    assert set(t.evaluate(5.0)) == {G1}
    t.record_probe(probe(**after), now=10.0)  # type: ignore[arg-type]
    assert t.released and t.released[0][0] == G1 and counter in t.released[0][1]
    assert t.holds() == {}
    # The recovery window counts from the reset.
    t.record_probe(probe(**after), now=10.5)  # type: ignore[arg-type]
    assert set(t.evaluate(10.5)) == {G1}
    t.record_probe(probe(**after), now=11.0)  # type: ignore[arg-type]
    assert t.evaluate(11.0) == {}


def test_growing_counters_are_no_reset() -> None:
    t = tracker()
    t.record_event(xid(79), now=0.0)  # before any probe: the first probe after the fault is the baseline
    now = run_probes(t, 0.0, windows=10, energy=100.0)
    assert set(t.evaluate(now)) == {G1} and t.released == []


def test_a_reset_of_another_gpu_releases_nothing() -> None:
    t = tracker()
    t.record_probe(probe(G0, energy=900.0), now=0.0)
    t.record_probe(probe(G1, energy=900.0), now=0.0)
    t.record_event(xid(79, G1), now=0.1)
    t.record_probe(probe(G0, energy=1.0), now=1.0)  # G0 was reset, not G1
    t.record_probe(probe(G1, energy=950.0), now=1.0)
    assert set(t.evaluate(50.0)) == {G1}


def test_an_unreachable_gpu_stays_held_and_its_reset_releases_it() -> None:
    t = tracker()
    t.record_probe(probe(energy=7000.0), now=0.0)
    t.record_event(xid(79), now=1.0)
    t.record_probe(GpuProbe(uuid=G1, reachable=False, detail="lost"), now=2.0)
    assert set(t.evaluate(30.0)) == {G1}
    t.record_probe(probe(energy=3.0), now=31.0)  # answers again, counters restarted
    t.record_probe(probe(energy=60.0), now=32.5)
    assert t.evaluate(32.5) == {}


def test_operator_clear_releases_the_hold_at_once() -> None:
    t = tracker()
    t.record_event(xid(79), now=0.0)
    now = run_probes(t, 0.0, windows=3)
    assert t.clear(G1) == [G1]
    assert t.evaluate(now) == {} and t.holds() == {}
    assert t.clear(G1) == []  # nothing left to clear


def test_a_problem_the_probes_still_see_marks_again_after_a_clear() -> None:
    t = tracker()
    t.record_probe(probe(dbe=1), now=0.0)
    assert t.clear(G1) == [G1]
    t.record_probe(probe(dbe=1), now=1.0)
    assert set(t.evaluate(1.0)) == {G1}


def test_counted_xids_still_recover_by_window() -> None:
    t = tracker()
    for i in range(3):
        t.record_event(xid(150), now=0.1 * i)
    assert set(t.evaluate(0.3)) == {G1}
    now = run_probes(t, 0.3, windows=4)  # the count window (2 s) and a recovery window pass
    assert t.evaluate(now) == {} and t.holds() == {}


def test_holds_round_trip_through_restore() -> None:
    t = tracker()
    t.record_probe(probe(energy=4000.0), now=0.0)
    t.record_event(xid(79), now=1.0)
    saved = list(t.holds().values())
    assert saved == [HeldFault(G1, G1, None, "xid", saved[0].reason, 79, saved[0].baseline)]
    assert saved[0].baseline and saved[0].baseline["energy_j"] == 4000.0

    again = tracker()  # a new agent process
    again.restore(saved, now=100.0)
    assert set(again.evaluate(100.0)) == {G1}  # unhealthy before any probe
    now = run_probes(again, 100.0, windows=5, energy=4100.0)
    assert set(again.evaluate(now)) == {G1}
    again.record_probe(probe(energy=20.0), now=now + 0.1)  # reset while the agent was down, or now
    assert again.holds() == {}


# -- the files --------------------------------------------------------------------------------------


def held(uuid: str = G1) -> HeldFault:
    return HeldFault(
        uuid,
        uuid,
        None,
        "xid",
        "XID 79 (GPU has fallen off the bus): needs a GPU reset",
        79,
        {"energy_j": 5.0},
    )


def test_store_round_trip_in_the_same_boot(tmp_path: Path) -> None:
    HoldStore(tmp_path, boot_id="boot-a").save([held(G1), held(G0)])
    assert HoldStore(tmp_path, boot_id="boot-a").load() == [held(G0), held(G1)]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary file left


def test_a_reboot_releases_the_saved_holds(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    HoldStore(tmp_path, boot_id="boot-a").save([held()])
    with caplog.at_level(logging.WARNING):
        assert HoldStore(tmp_path, boot_id="boot-b").load() == []
    assert "rebooted" in caplog.text and G1 in caplog.text


@pytest.mark.parametrize(
    "content",
    [
        "",
        "{",
        "[]",
        '{"version": 9, "holds": []}',
        '{"version": 1, "boot_id": "b", "holds": [{"target_uuid": 1}]}',
    ],
)
def test_a_damaged_holds_file_is_reported_not_fatal(
    tmp_path: Path, content: str, caplog: pytest.LogCaptureFixture
) -> None:
    (tmp_path / "holds.json").write_text(content)
    with caplog.at_level(logging.ERROR):
        assert HoldStore(tmp_path, boot_id="b").load() == []
    assert "cannot read the held faults" in caplog.text


def test_an_unwritable_directory_is_a_health_state_error(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    with pytest.raises(HealthStateError):
        HoldStore(tmp_path / "file" / "health", boot_id="b").save([held()])


def take(store: HoldStore) -> list[ClearRequest]:
    taken: list[ClearRequest] = []
    store.take_clears(taken.append)
    return taken


def test_a_clear_request_is_taken_once(tmp_path: Path) -> None:
    path = request_clear(tmp_path, G1, by="alice", reason="reseated the card")
    assert path.exists()
    store = HoldStore(tmp_path, boot_id="b")
    (request,) = take(store)
    assert (request.uuid, request.by, request.reason) == (G1, "alice", "reseated the card")
    assert not path.exists() and take(store) == []


@pytest.mark.parametrize(
    "uuid", ["../../etc/passwd", "GPU-../x", "", "gpu-1", "GPU-1/../../x", "MIG-" + "a" * 200]
)
def test_request_clear_refuses_what_is_not_a_device_uuid(tmp_path: Path, uuid: str) -> None:
    with pytest.raises(HealthStateError):
        request_clear(tmp_path, uuid, by="alice", reason="x")
    assert not (tmp_path / "clear").exists() or list((tmp_path / "clear").iterdir()) == []


def test_request_clear_needs_who_and_why(tmp_path: Path) -> None:
    with pytest.raises(HealthStateError):
        request_clear(tmp_path, G1, by="alice", reason="  ")


def test_hostile_clear_files_are_ignored_and_removed(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    clear = tmp_path / "clear"
    clear.mkdir()
    secret = tmp_path / "secret.json"
    secret.write_text(json.dumps({"uuid": G1, "by": "x", "reason": "y", "at": 1.0}))
    (clear / f"{G1}.json").symlink_to(secret)  # a link to a file that would parse
    os.mkfifo(clear / f"{G0}.json")  # a FIFO: reading it must not block
    (clear / "GPU-2222.json").write_text(
        json.dumps({"uuid": G0, "by": "x", "reason": "y", "at": 1.0})
    )  # name/UUID
    (clear / "GPU-3333.json").write_text(json.dumps({"uuid": "GPU-3333", "by": "", "reason": "y", "at": 1.0}))
    (clear / "GPU-4444.json").write_text("x" * 20000)
    (clear / "GPU-5555.json").write_text("[1, 2]")
    with caplog.at_level(logging.WARNING):
        assert take(HoldStore(tmp_path, boot_id="b")) == []
    assert list(clear.iterdir()) == []
    assert secret.exists()  # the link is removed, never what it points to
    assert caplog.text.count("ignoring the clear request") == 6


def test_a_clear_file_still_being_written_is_left_alone(tmp_path: Path) -> None:
    clear = tmp_path / "clear"
    clear.mkdir()
    (clear / f".{G1}.123.tmp").write_text("{")
    assert take(HoldStore(tmp_path, boot_id="b")) == []
    assert (clear / f".{G1}.123.tmp").exists()
