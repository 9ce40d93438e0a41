"""The hot-plug watch: polling over the simulated backend, and the udev path fed by a monitor stand-in."""

from __future__ import annotations

import asyncio
import functools
import logging
import os
from collections.abc import Callable, Coroutine, Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest

from gpunode.errors import BackendError
from gpunode.node.devices.base import Gpu
from gpunode.node.devices.simnode.backend import SimBackend
from gpunode.node.devices.watch import TopologyWatch, is_nvidia_pci_event, open_udev_monitor, watch_topology

WAIT_S = 10.0  # an upper bound for things that happen in milliseconds; never a measured time


def in_loop(test: Callable[..., Coroutine[Any, Any, None]]) -> Callable[..., None]:
    """Run an async test in a fresh event loop (keeps the fixtures pytest sees)."""

    @functools.wraps(test)
    def run(*args: Any, **kwargs: Any) -> None:
        asyncio.run(test(*args, **kwargs))

    return run


@dataclass
class UdevDevice:
    """What pyudev hands over for one event: action, sys_name, driver, properties, attributes."""

    action: str
    properties: dict[str, str]
    sys_name: str = "0000:18:00.0"
    driver: str | None = None
    attributes: dict[str, bytes] = field(default_factory=dict)


def gpu_event(action: str = "add", pci_id: str = "10DE:2330", pci_class: str | None = "30200") -> UdevDevice:
    props = {"ACTION": action, "SUBSYSTEM": "pci", "PCI_ID": pci_id}
    if pci_class is not None:
        props["PCI_CLASS"] = pci_class
    return UdevDevice(action=action, properties=props)


class MonitorStandIn:
    """Behaves like a started pyudev.Monitor: a readable fd while events are queued, poll(timeout=0)."""

    def __init__(self) -> None:
        self._r, self._w = os.pipe()
        os.set_blocking(self._r, False)
        self.queue: list[Any] = []

    def fileno(self) -> int:
        return self._r

    def push(self, *devices: Any) -> None:
        self.queue.extend(devices)
        os.write(self._w, b"x" * len(devices))

    def poll(self, timeout: float | None = None) -> Any:
        assert timeout == 0
        if not self.queue:
            return None
        os.read(self._r, 1)
        return self.queue.pop(0)

    def close(self) -> None:
        os.close(self._r)
        os.close(self._w)


class Recorder:
    """An on_change handler that counts calls and lets a test wait for the n-th one."""

    def __init__(self, backend: SimBackend | None = None) -> None:
        self.calls = 0
        self.seen: list[frozenset[str]] = []
        self.backend = backend
        self._changed = asyncio.Condition()

    async def __call__(self) -> None:
        async with self._changed:
            self.calls += 1
            if self.backend is not None:
                self.seen.append(frozenset(g.uuid for g in self.backend.gpus()))
            self._changed.notify_all()

    async def wait_for(self, n: int) -> None:
        async with self._changed:
            await asyncio.wait_for(self._changed.wait_for(lambda: self.calls >= n), WAIT_S)


@pytest.fixture
def monitor() -> Iterator[MonitorStandIn]:
    m = MonitorStandIn()
    yield m
    m.close()


async def start(**kwargs: Any) -> asyncio.Task[None]:
    ready = asyncio.Event()
    task = asyncio.create_task(watch_topology(ready=ready, **kwargs))
    await asyncio.wait_for(ready.wait(), WAIT_S)
    return task


async def stop(task: asyncio.Task[None]) -> None:
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


# -- udev event filter ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("device", "relevant"),
    [
        (gpu_event("add"), True),
        (gpu_event("remove"), True),
        (gpu_event("unbind", pci_class=None), True),
        (gpu_event("add", pci_id="10de:20B2", pci_class="30000"), True),
        (gpu_event("add", pci_id="10DE:22A3", pci_class="68000"), False),  # an NVSwitch bridge
        (gpu_event("add", pci_id="10DE:10F1", pci_class="40300"), False),  # a GPU's HDMI audio function
        (gpu_event("add", pci_id="8086:1572", pci_class="20000"), False),  # an Intel NIC
        (UdevDevice("bind", {"DRIVER": "nvidia", "PCI_ID": "FFFF:0000"}), True),
        (UdevDevice("bind", {}, driver="nvidia"), True),
        (UdevDevice("add", {}, attributes={"vendor": b"0x10de"}), True),
        (UdevDevice("add", {}, attributes={"vendor": b"0x15b3"}), False),
        (UdevDevice("remove", {}), False),  # nothing says NVIDIA
    ],
    ids=[
        "h100-add", "h100-remove", "unbind-without-class", "lowercase-vendor-vga", "nvswitch-bridge",
        "hdmi-audio", "intel-nic", "bound-to-nvidia", "driver-attribute", "sysfs-vendor", "mellanox-sysfs",
        "anonymous",
    ],
)  # fmt: skip
def test_udev_events_are_filtered_to_nvidia_gpus(device: UdevDevice, relevant: bool) -> None:
    assert is_nvidia_pci_event(device) is relevant


def test_a_real_pyudev_monitor_opens_or_fails_with_an_exception() -> None:
    try:
        monitor = open_udev_monitor()
    except Exception:
        return  # no udev here: watch_topology falls back to polling (tested below)
    assert monitor.fileno() >= 0


@in_loop
async def test_the_watch_runs_with_the_real_udev_monitor_or_without_udev() -> None:
    backend = SimBackend.from_profile("t4")
    recorder = Recorder(backend)
    task = await start(backend=backend, on_change=recorder, poll_interval_s=0.02, debounce_s=0.01)
    try:
        backend.remove_gpu(backend.gpus()[3].uuid)
        await recorder.wait_for(1)
        assert len(recorder.seen[-1]) == 3
    finally:
        await stop(task)


# -- polling -------------------------------------------------------------------------------------


@in_loop
async def test_polling_notices_removed_and_added_gpus_without_udev() -> None:
    backend = SimBackend.from_profile("t4")
    recorder = Recorder(backend)
    task = await start(backend=backend, on_change=recorder, poll_interval_s=0.02, use_udev=False)
    try:
        gone = backend.gpus()[1]
        backend.remove_gpu(gone.uuid)
        await recorder.wait_for(1)
        assert gone.uuid not in recorder.seen[0]
        new = backend.add_gpu()
        await recorder.wait_for(2)
        assert new.uuid in recorder.seen[1] and len(recorder.seen[1]) == 4
    finally:
        await stop(task)
    assert recorder.calls == 2


@in_loop
async def test_without_udev_the_watch_logs_once_and_polls(caplog: pytest.LogCaptureFixture) -> None:
    backend = SimBackend.from_profile("dgx-h100")
    calls: list[int] = []

    def no_udev() -> Any:
        raise OSError(93, "Protocol not supported")

    with caplog.at_level(logging.WARNING, logger="gpunode.node.devices.watch"):
        task = await start(
            backend=backend, on_change=lambda: calls.append(1), poll_interval_s=0.02, monitor_factory=no_udev
        )
        try:
            backend.remove_gpu(backend.gpus()[0].uuid)
            async with asyncio.timeout(WAIT_S):
                while not calls:
                    await asyncio.sleep(0.01)
        finally:
            await stop(task)
    warnings = [r.getMessage() for r in caplog.records if "udev" in r.getMessage()]
    assert len(warnings) == 1 and "polling every 0.02 s" in warnings[0]
    assert calls == [1]  # a plain function works as on_change too


class FlakyBackend:
    """A backend whose GPU listing fails once, as NVML can during a driver reload."""

    name = "flaky"

    def __init__(self, inner: SimBackend) -> None:
        self.inner = inner
        self.failures = 0

    def gpus(self) -> tuple[Gpu, ...]:
        if self.failures == 0:
            self.failures += 1
            raise BackendError("NVML call nvmlDeviceGetCount failed: Unknown Error")
        return self.inner.gpus()


@in_loop
async def test_a_failing_poll_is_logged_and_the_watch_goes_on(caplog: pytest.LogCaptureFixture) -> None:
    inner = SimBackend.from_profile("t4")
    backend = FlakyBackend(inner)
    recorder = Recorder()
    with caplog.at_level(logging.WARNING, logger="gpunode.node.devices.watch"):
        task = await start(backend=backend, on_change=recorder, poll_interval_s=0.02, use_udev=False)
        try:
            # The first listing failed: the first one that works rediscovers, whatever it finds.
            await recorder.wait_for(1)
            inner.remove_gpu(inner.gpus()[0].uuid)
            await recorder.wait_for(2)
        finally:
            await stop(task)
    assert any("listing the GPUs failed" in r.getMessage() for r in caplog.records)
    assert backend.failures == 1 and recorder.calls == 2


@in_loop
async def test_a_failing_handler_does_not_stop_the_watch(caplog: pytest.LogCaptureFixture) -> None:
    backend = SimBackend.from_profile("t4")
    calls: list[int] = []

    async def broken() -> None:
        calls.append(1)
        raise RuntimeError("rediscovery blew up")

    task = await start(backend=backend, on_change=broken, poll_interval_s=0.02, use_udev=False)
    try:
        backend.remove_gpu(backend.gpus()[0].uuid)
        async with asyncio.timeout(WAIT_S):
            while len(calls) < 1:
                await asyncio.sleep(0.01)
        backend.remove_gpu(backend.gpus()[0].uuid)
        async with asyncio.timeout(WAIT_S):
            while len(calls) < 2:
                await asyncio.sleep(0.01)
    finally:
        await stop(task)
    assert any("hot-plug handler failed" in r.getMessage() for r in caplog.records)


# -- udev path -----------------------------------------------------------------------------------


@in_loop
async def test_a_burst_of_udev_events_is_debounced_into_one_change(monitor: MonitorStandIn) -> None:
    backend = SimBackend.from_profile("dgx-h100")
    recorder = Recorder()
    task = await start(
        backend=backend,
        on_change=recorder,
        poll_interval_s=3600,
        debounce_s=0.01,
        monitor_factory=lambda: monitor,
    )
    try:
        # A GPU leaving makes several events: unbind from the driver, then remove, on two functions.
        monitor.push(gpu_event("unbind"), gpu_event("remove"), gpu_event("remove", "10DE:22A3", "68000"))
        await recorder.wait_for(1)
        monitor.push(gpu_event("add"))
        await recorder.wait_for(2)
    finally:
        await stop(task)
    assert recorder.calls == 2
    assert monitor.queue == []


@in_loop
async def test_udev_events_of_other_devices_are_ignored(monitor: MonitorStandIn) -> None:
    backend = SimBackend.from_profile("dgx-h100")
    recorder = Recorder()
    task = await start(
        backend=backend,
        on_change=recorder,
        poll_interval_s=3600,
        debounce_s=0.01,
        monitor_factory=lambda: monitor,
    )
    try:
        monitor.push(gpu_event("add", "8086:1572", "20000"), gpu_event("add", "10DE:10F1", "40300"))
        monitor.push(gpu_event("bind"))  # the one that counts
        await recorder.wait_for(1)
    finally:
        await stop(task)
    assert recorder.calls == 1


@in_loop
async def test_polling_runs_alongside_udev_as_a_safety_net(monitor: MonitorStandIn) -> None:
    backend = SimBackend.from_profile("a100-mig")
    recorder = Recorder(backend)
    task = await start(
        backend=backend,
        on_change=recorder,
        poll_interval_s=0.02,
        debounce_s=0.01,
        monitor_factory=lambda: monitor,
    )
    try:
        gone = backend.gpus()[7]
        backend.remove_gpu(gone.uuid)  # no udev event comes, as in a container without udevd
        await recorder.wait_for(1)
        assert gone.uuid not in recorder.seen[0]
    finally:
        await stop(task)


@in_loop
async def test_the_handler_function_schedules_only_for_gpus() -> None:
    recorder = Recorder()
    watch = TopologyWatch(backend=SimBackend.from_profile("t4"), on_change=recorder, debounce_s=0.0)
    assert watch.handle_udev_device(gpu_event("add", "1AF4:1000", "20000")) is False
    assert not watch.due.is_set()
    assert watch.handle_udev_device(gpu_event("remove")) is True
    await asyncio.wait_for(watch.due.wait(), WAIT_S)
    watch.cancel_timer()


@in_loop
async def test_cancelling_the_watch_unregisters_the_monitor(monitor: MonitorStandIn) -> None:
    backend = SimBackend.from_profile("t4")
    recorder = Recorder()
    task = await start(
        backend=backend,
        on_change=recorder,
        poll_interval_s=3600,
        debounce_s=0.01,
        monitor_factory=lambda: monitor,
    )
    await stop(task)
    loop = asyncio.get_running_loop()
    assert loop.remove_reader(monitor.fileno()) is False  # nothing was left registered
