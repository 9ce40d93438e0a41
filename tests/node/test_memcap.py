"""gpunode.node.memcap: creating, validating, listing, reading, reclaiming and
removing memory-cap regions, and the container spec Allocate hands out."""

from __future__ import annotations

import logging
import mmap
import os
import re
import stat
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from gpunode._memcap import ffi, lib
from hypothesis import given, settings
from hypothesis import strategies as st

from gpunode.errors import MemcapError
from gpunode.node import memcap

GIB = 1 << 30
UUID = "GPU-5a2f0c1e-1111-2222-3333-444455556666"
REPO = Path(__file__).resolve().parents[2]
HEADER = REPO / "native" / "include" / "gpunode_memcap.h"
USED_BYTES_OFFSET = 64  # struct gpunode_memcap_usage.used_bytes[0]


def make(root: Path, key: str = "ctr", limit: int = 4 * GIB, **kw: object) -> memcap.Region:
    args: dict[str, object] = {"gpu_uuid": UUID, "limit_bytes": limit, "device_total_bytes": 80 * GIB}
    args.update(kw)
    return memcap.create_region(root, key, **args)  # type: ignore[arg-type]


def test_create_region_writes_both_files_with_their_modes(tmp_path: Path) -> None:
    region = make(tmp_path)
    assert region.path == tmp_path / "ctr"
    assert (region.gpu_uuid, region.limit_bytes, region.device_total_bytes) == (UUID, 4 * GIB, 80 * GIB)
    assert stat.S_IMODE(region.limit_path.stat().st_mode) == 0o444
    assert stat.S_IMODE(region.usage_path.stat().st_mode) == 0o666
    assert stat.S_IMODE(region.path.stat().st_mode) == 0o700  # only root reaches a region on the host
    assert memcap.load_region(region.path) == region
    usage = memcap.read_usage(region)
    assert (usage.key, usage.gpu_uuid, usage.limit_bytes, usage.used_bytes, usage.per_process) == (
        "ctr",
        UUID,
        4 * GIB,
        0,
        (),
    )


def test_create_region_is_idempotent_for_the_same_cap(tmp_path: Path) -> None:
    first = make(tmp_path)
    again = make(tmp_path)
    assert again == first  # same generation: the files were not rewritten


@pytest.mark.parametrize(
    "change",
    [
        pytest.param({"limit": 2 * GIB}, id="other-limit"),
        pytest.param({"gpu_uuid": "GPU-00000000-0000-0000-0000-000000000001"}, id="other-gpu"),
        pytest.param({"fail_open": True}, id="other-failure-mode"),
    ],
)
def test_create_region_refuses_to_change_an_existing_cap(tmp_path: Path, change: dict[str, object]) -> None:
    make(tmp_path)
    with pytest.raises(MemcapError, match="already exists with a different cap") as info:
        make(tmp_path, **change)  # type: ignore[arg-type]
    assert "remove_region" in info.value.hint


def test_concurrent_creates_of_one_key_agree(tmp_path: Path) -> None:
    results: list[memcap.Region] = []
    errors: list[BaseException] = []

    def create() -> None:
        try:
            results.append(make(tmp_path, "raced"))
        except BaseException as exc:  # collected for the assertion below
            errors.append(exc)

    threads = [threading.Thread(target=create) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert len({r.generation for r in results}) == 1
    assert [p.name for p in tmp_path.iterdir()] == ["raced"]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        pytest.param({"key": ""}, "invalid region key", id="empty-key"),
        pytest.param({"key": ".hidden"}, "invalid region key", id="dot-key"),
        pytest.param({"key": "a/b"}, "invalid region key", id="slash-key"),
        pytest.param({"key": ".."}, "invalid region key", id="dotdot-key"),
        pytest.param({"key": "x" * 129}, "invalid region key", id="long-key"),
        pytest.param({"limit": 0}, "must be positive", id="zero-limit"),
        pytest.param({"limit": -1}, "must be positive", id="negative-limit"),
        pytest.param({"limit": True}, "integer number of bytes", id="bool-limit"),
        pytest.param({"limit": 1.5}, "integer number of bytes", id="float-limit"),
        pytest.param({"limit": "4Gi"}, "integer number of bytes", id="string-limit"),
        pytest.param({"device_total_bytes": 0}, "must be positive", id="zero-device"),
        pytest.param({"gpu_uuid": ""}, "invalid GPU UUID", id="empty-uuid"),
        pytest.param({"gpu_uuid": "GPU-1 2"}, "whitespace", id="uuid-with-space"),
        pytest.param({"gpu_uuid": "G" * 96}, "invalid GPU UUID", id="uuid-too-long"),
        pytest.param({"gpu_uuid": "GPU-\x00"}, "invalid GPU UUID", id="uuid-with-nul"),
        pytest.param({"fail_open": 1}, "fail_open must be a bool", id="int-fail-open"),
    ],
)
def test_bad_values_are_refused_with_a_hint(tmp_path: Path, kwargs: dict[str, object], message: str) -> None:
    key = str(kwargs.pop("key", "ctr"))
    with pytest.raises(MemcapError, match=message) as info:
        make(tmp_path, key, **kwargs)  # type: ignore[arg-type]
    assert info.value.hint
    assert not (tmp_path / "ctr").exists()


def test_limit_above_the_device_is_clamped(tmp_path: Path) -> None:
    region = make(tmp_path, limit=100 * GIB)
    assert region.limit_bytes == 80 * GIB
    assert memcap.load_region(region.path).limit_bytes == 80 * GIB


def test_multi_gpu_region_keeps_each_cap(tmp_path: Path) -> None:
    caps = [memcap.DeviceCap(f"GPU-{i}", (i + 1) * GIB, 16 * GIB) for i in range(3)]
    region = memcap.create_multi_gpu_region(tmp_path, "multi", devices=caps)
    assert region.devices == tuple(caps)
    usage = memcap.read_usage(region)
    assert [d.limit_bytes for d in usage.devices] == [GIB, 2 * GIB, 3 * GIB]
    assert usage.limit_bytes == 6 * GIB


@pytest.mark.parametrize(
    ("devices", "message"),
    [
        pytest.param([], "caps 1 to 8 devices", id="none"),
        pytest.param([memcap.DeviceCap(f"GPU-{i}", GIB, GIB) for i in range(9)], "caps 1 to 8", id="nine"),
        pytest.param([memcap.DeviceCap("GPU-a", GIB, GIB)] * 2, "same GPU twice", id="duplicate"),
    ],
)
def test_multi_gpu_region_refuses_bad_device_lists(
    tmp_path: Path, devices: list[memcap.DeviceCap], message: str
) -> None:
    with pytest.raises(MemcapError, match=message):
        memcap.create_multi_gpu_region(tmp_path, "multi", devices=devices)


def test_list_remove_and_gc(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    for key in ("b", "a", "c"):
        make(tmp_path, key)
    corrupt = make(tmp_path, "corrupt")
    corrupt.limit_path.chmod(0o644)
    corrupt.limit_path.write_bytes(b"\0" * corrupt.limit_path.stat().st_size)
    (tmp_path / "not-a-region.txt").write_text("x")
    with caplog.at_level(logging.WARNING, logger="gpunode.node.memcap"):
        assert [r.key for r in memcap.list_regions(tmp_path)] == ["a", "b", "c"]
    assert "corrupt" in caplog.text and "bad magic" in caplog.text

    assert memcap.remove_region(tmp_path, "a") is True
    assert memcap.remove_region(tmp_path, "a") is False
    fresh_temp = tmp_path / ".tmp-x-fresh"
    stale_temp = tmp_path / ".tmp-y-stale"
    fresh_temp.mkdir()
    stale_temp.mkdir()
    old = time.time() - memcap.STALE_TEMP_AGE_S - 60
    os.utime(stale_temp, (old, old))

    assert memcap.gc_regions(tmp_path, keep=["c", "unknown"]) == ("b", "corrupt")
    assert sorted(p.name for p in tmp_path.iterdir()) == [".tmp-x-fresh", "c", "not-a-region.txt"]
    assert memcap.list_regions(tmp_path / "missing") == ()


def test_remove_region_refuses_a_path_as_key(tmp_path: Path) -> None:
    with pytest.raises(MemcapError, match="invalid region key"):
        memcap.remove_region(tmp_path, "../etc")


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        pytest.param(lambda r: r.limit_path.unlink(), "no region", id="limit-missing"),
        pytest.param(lambda r: r.usage_path.unlink(), "No such file", id="usage-missing"),
        pytest.param(lambda r: os.truncate(r.usage_path, 10), "wrong size", id="usage-truncated"),
    ],
)
def test_reading_a_broken_region_says_why(tmp_path: Path, damage: object, message: str) -> None:
    region = make(tmp_path)
    damage(region)  # type: ignore[operator]
    with pytest.raises(MemcapError, match=message) as info:
        memcap.read_usage(region)
    assert info.value.hint


def test_container_spec_mounts_and_environment(tmp_path: Path) -> None:
    region = make(tmp_path)
    library = tmp_path / "libgpunode-preload.so"
    spec = memcap.container_spec(region, preload_lib=library, visible_device=UUID)
    assert spec.envs == {
        "LD_PRELOAD": "/var/run/gpunode/lib/libgpunode-preload.so",
        "GPUNODE_MEMCAP_REGION": "/var/run/gpunode/memcap",
        "NVIDIA_VISIBLE_DEVICES": UUID,
        "GPUNODE_MEMCAP_LIMIT_BYTES": str(4 * GIB),
    }
    assert spec.mounts == (
        memcap.MountSpec("/var/run/gpunode/lib/libgpunode-preload.so", str(library), True),
        memcap.MountSpec("/var/run/gpunode/memcap/limit", str(region.limit_path), True),
        memcap.MountSpec("/var/run/gpunode/memcap/usage", str(region.usage_path), False),
    )
    assert spec.envs["GPUNODE_MEMCAP_REGION"] == memcap.default_region_dir()


def test_container_spec_with_ld_so_preload(tmp_path: Path) -> None:
    region = make(tmp_path)
    spec = memcap.container_spec(region, preload_lib=Path("/lib.so"), visible_device="0", ld_so_preload=True)
    preload_file = region.path / "ld.so.preload"
    assert preload_file.read_text() == "/var/run/gpunode/lib/libgpunode-preload.so\n"
    assert spec.mounts[-1] == memcap.MountSpec("/etc/ld.so.preload", str(preload_file), True)
    assert spec.envs["LD_PRELOAD"] == "/var/run/gpunode/lib/libgpunode-preload.so"
    assert memcap.load_region(region.path) == region  # the extra file does not disturb the region


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        pytest.param({"visible_device": ""}, "visible_device is empty", id="no-device"),
    ],
)
def test_container_spec_refuses_bad_arguments(tmp_path: Path, kwargs: dict[str, str], message: str) -> None:
    args = {"visible_device": UUID, **kwargs}
    with pytest.raises(MemcapError, match=message):
        memcap.container_spec(make(tmp_path), preload_lib=Path("/lib.so"), **args)  # type: ignore[arg-type]


def test_preload_library_is_installed_with_the_package() -> None:
    path = memcap.preload_library_path()
    assert path.name == "libgpunode-preload.so" and path.is_file()
    assert path.read_bytes()[:4] == b"\x7fELF"


def test_python_constants_match_the_header() -> None:
    text = HEADER.read_text()
    defines = dict(re.findall(r'#define (GPUNODE_MEMCAP_\w+) "([^"]*)"', text))
    assert defines["GPUNODE_MEMCAP_ENV_REGION"] == memcap.ENV_REGION
    assert defines["GPUNODE_MEMCAP_ENV_LOG_LEVEL"] == memcap.ENV_LOG_LEVEL
    assert 'FAIL_OPEN"' not in text and not hasattr(memcap, "ENV_FAIL_OPEN")  # fail-open: limit file only
    assert defines["GPUNODE_MEMCAP_LIMIT_FILE"] == memcap.LIMIT_FILE
    assert defines["GPUNODE_MEMCAP_USAGE_FILE"] == memcap.USAGE_FILE
    assert (
        defines["GPUNODE_MEMCAP_DEFAULT_DIR"]
        == f"{memcap.CONTAINER_DIR}/memcap"
        == memcap.default_region_dir()
    )


def test_built_module_matches_the_header() -> None:
    """gpunode._memcap was built from the current header (a stale build would disagree on the layout)."""
    text = HEADER.read_text()
    numbers = {k: int(v, 0) for k, v in re.findall(r"#define (GPUNODE_MEMCAP_\w+) (0x[0-9a-f]+|\d+)\n", text)}
    assert numbers["GPUNODE_MEMCAP_LAYOUT_VERSION"] == lib.GPUNODE_MEMCAP_LAYOUT_VERSION
    assert numbers["GPUNODE_MEMCAP_LIMIT_MAGIC"] == lib.GPUNODE_MEMCAP_LIMIT_MAGIC
    assert numbers["GPUNODE_MEMCAP_MAX_PROCS"] == lib.GPUNODE_MEMCAP_MAX_PROCS
    # header, usage counters, process slots, the compute block (layout version 2)
    assert lib.gpunode_memcap_usage_size() == 64 + 64 + 128 * numbers["GPUNODE_MEMCAP_MAX_PROCS"] + 64
    assert ffi.sizeof("struct gpunode_memcap_limit") == 40 + (96 + 16) * numbers["GPUNODE_MEMCAP_MAX_DEVICES"]


# ---- the reclaim protocol, driven through gpunode._memcap by stand-in processes ----

HOLDER = """
import os, sys, time
from gpunode._memcap import ffi, lib
region = lib.gpunode_memcap_region_new()
assert lib.gpunode_memcap_region_open(region, sys.argv[1].encode(), 1) == 0
slot = ffi.new("int *")
assert lib.gpunode_memcap_slot_claim(region, os.getpid(), 0, slot) == 0
assert lib.gpunode_memcap_reserve(region, slot[0], 0, int(sys.argv[2])) == 0
print("ready", flush=True)
time.sleep(600)
"""


def start_holder(region: memcap.Region, nbytes: int) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(region.path), str(nbytes)],
        env=env,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    return proc


def kill(proc: subprocess.Popen[str]) -> None:
    proc.kill()
    proc.wait(timeout=30)
    if proc.stdout:
        proc.stdout.close()


def test_reclaim_returns_only_dead_processes_usage(tmp_path: Path) -> None:
    region = make(tmp_path)
    alive, doomed = start_holder(region, GIB), start_holder(region, 2 * GIB)
    try:
        before = memcap.read_usage(region)
        assert before.used_bytes == 3 * GIB
        assert sorted((p.used_bytes, p.alive) for p in before.per_process) == [(GIB, True), (2 * GIB, True)]
        assert before.reclaimable_bytes == 0
        kill(doomed)
        dead = memcap.read_usage(region)
        assert sorted((p.used_bytes, p.alive) for p in dead.per_process) == [(GIB, True), (2 * GIB, False)]
        assert (dead.used_bytes, dead.reclaimable_bytes) == (3 * GIB, 2 * GIB)
        assert memcap.reclaim_dead(region) == 2 * GIB
        after = memcap.read_usage(region)
        assert after.used_bytes == GIB
        assert [(p.pid, p.alive) for p in after.per_process] == [(alive.pid, True)]
    finally:
        kill(alive)
    assert memcap.reclaim_dead(region) == GIB
    assert memcap.read_usage(region).used_bytes == 0


def _leak_into_total(region: memcap.Region, nbytes: int) -> None:
    """What a process killed between reserving and recording leaves: usage no slot accounts for."""
    with region.usage_path.open("r+b") as f, mmap.mmap(f.fileno(), 0) as m:
        (current,) = struct.unpack_from("<Q", m, USED_BYTES_OFFSET)
        struct.pack_into("<Q", m, USED_BYTES_OFFSET, current + nbytes)


def test_unaccounted_usage_is_zeroed_only_when_no_process_is_left(tmp_path: Path) -> None:
    region = make(tmp_path)
    holder = start_holder(region, GIB)
    try:
        _leak_into_total(region, 123)
        assert memcap.reclaim_dead(region) == 0  # a live process: the extra bytes may be in flight
        assert memcap.read_usage(region).used_bytes == GIB + 123
    finally:
        kill(holder)
    assert memcap.reclaim_dead(region) == GIB + 123
    assert memcap.read_usage(region).used_bytes == 0


def test_reserve_and_release_keep_the_region_consistent(tmp_path: Path) -> None:
    """A model check of the C accounting: any sequence of reserves and releases
    by two processes keeps the total equal to the sum of the slots and never
    above the cap; a reserve is refused exactly when it would pass the cap."""
    limit = 1000
    region_path = make(tmp_path, limit=limit, device_total_bytes=limit).path
    ops = st.lists(st.tuples(st.sampled_from(["reserve", "release"]), st.integers(0, 1), st.integers(0, 400)))

    @settings(max_examples=150, deadline=None)
    @given(ops)
    def check(sequence: list[tuple[str, int, int]]) -> None:
        # One handle (one open file description, so one lock owner) per simulated process.
        handles = [lib.gpunode_memcap_region_new() for _ in range(2)]
        try:
            slots = []
            for handle in handles:
                assert (
                    lib.gpunode_memcap_region_open(handle, os.fsencode(region_path), 1)
                    == lib.GPUNODE_MEMCAP_OK
                )
                slot = ffi.new("int *")
                assert lib.gpunode_memcap_slot_claim(handle, os.getpid(), 0, slot) == lib.GPUNODE_MEMCAP_OK
                slots.append(slot[0])
            assert slots[0] != slots[1]
            held = [0, 0]
            for op, who, nbytes in sequence:
                handle, slot_index = handles[who], slots[who]
                if op == "reserve":
                    status = lib.gpunode_memcap_reserve(handle, slot_index, 0, nbytes)
                    fits = sum(held) + nbytes <= limit
                    assert status == (lib.GPUNODE_MEMCAP_OK if fits else lib.GPUNODE_MEMCAP_ERR_OVER_LIMIT)
                    held[who] += nbytes if fits else 0
                else:
                    status = lib.gpunode_memcap_release(handle, slot_index, 0, nbytes)
                    ok = nbytes <= held[who]
                    assert status == (lib.GPUNODE_MEMCAP_OK if ok else lib.GPUNODE_MEMCAP_ERR_ARGUMENT)
                    held[who] -= nbytes if ok else 0
                report = ffi.new("struct gpunode_memcap_report *")
                assert lib.gpunode_memcap_report(handles[0], report) == lib.GPUNODE_MEMCAP_OK
                assert report.used_bytes[0] == sum(held) <= limit
                assert sorted(
                    report.processes[i].used_bytes[0] for i in range(report.process_count)
                ) == sorted(held)
            for handle, slot_index in zip(handles, slots, strict=True):
                assert lib.gpunode_memcap_slot_release(handle, slot_index) == lib.GPUNODE_MEMCAP_OK
        finally:
            for handle in handles:
                lib.gpunode_memcap_region_free(handle)
        assert memcap.read_usage(region_path).used_bytes == 0

    check()
