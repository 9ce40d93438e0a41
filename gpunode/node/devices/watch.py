"""GPU hot-plug watch: call `on_change` when GPUs appear on or leave the node.

Two sources feed it. A udev monitor on the PCI subsystem reports NVIDIA
devices (vendor 0x10de display controllers, or anything bound to the nvidia
driver) being added, removed, bound or unbound; a burst of such events is
debounced into one call. A poll of backend.gpus() every poll_interval_s calls
on_change when the set of GPU UUIDs differs from the last one seen; it runs
always, as a safety net for events udev never delivers (containers without
udevd, a driver bind that completes after the event). When no udev monitor
can be opened, that is logged once and polling alone carries on. After a
failed listing, the next successful one calls on_change, since a change in
between cannot be ruled out.

This module only notices changes; rediscovery and re-advertising belong to
on_change. It must not call NVML directly (the backend does).
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from gpunode.errors import GpunodeError
from gpunode.node.devices.base import Backend

log = logging.getLogger(__name__)

NVIDIA_VENDOR_ID = 0x10DE
NVIDIA_DRIVERS = frozenset({"nvidia", "nvidia-vgpu-vfio"})
DISPLAY_CLASS = 0x03  # PCI base class of VGA and 3D controllers


class UdevMonitor(Protocol):
    """The part of pyudev.Monitor the watch uses."""

    def fileno(self) -> int:
        """The monitor's netlink socket descriptor, watched for readability."""
        ...

    def poll(self, timeout: float | None = None) -> Any:
        """The next queued udev device event, or None when none comes within `timeout` s (0: no wait)."""
        ...


OnChange = Callable[[], Awaitable[None]] | Callable[[], None]


def open_udev_monitor() -> UdevMonitor:
    """A started pyudev monitor on the PCI subsystem; raises when udev cannot be reached."""
    import pyudev

    monitor = pyudev.Monitor.from_netlink(pyudev.Context())
    monitor.filter_by(subsystem="pci")
    monitor.start()
    return monitor


def is_nvidia_pci_event(device: Any) -> bool:
    """Whether a udev PCI event concerns an NVIDIA GPU (by PCI vendor and class, or by driver)."""
    props = getattr(device, "properties", None) or {}
    driver = getattr(device, "driver", None) or props.get("DRIVER")
    if driver in NVIDIA_DRIVERS:
        return True
    vendor = _vendor(device, props)
    if vendor != NVIDIA_VENDOR_ID:
        return False
    pci_class = props.get("PCI_CLASS")
    if pci_class is None:
        return True  # an NVIDIA device whose class udev did not give: let rediscovery decide
    try:
        return int(str(pci_class), 16) >> 16 == DISPLAY_CLASS
    except ValueError:
        return True


def _vendor(device: Any, props: Any) -> int | None:
    pci_id = props.get("PCI_ID")  # "10DE:2330"
    if pci_id:
        try:
            return int(str(pci_id).split(":", 1)[0], 16)
        except ValueError:
            return None
    attributes = getattr(device, "attributes", None)
    if attributes is None:
        return None
    try:  # the sysfs file is gone once a device is removed
        raw = attributes.get("vendor")
    except (OSError, KeyError, AttributeError):
        return None
    if raw is None:
        return None
    try:
        return int(raw.decode() if isinstance(raw, bytes) else str(raw), 16)
    except ValueError:
        return None


class TopologyWatch:
    """The state of one watch: the last UUID set seen and the pending debounced udev trigger."""

    def __init__(self, *, backend: Backend, on_change: OnChange, debounce_s: float) -> None:
        self.backend = backend
        self.on_change = on_change
        self.debounce_s = debounce_s
        self.known: frozenset[str] | None = None
        self.due = asyncio.Event()
        self._timer: asyncio.TimerHandle | None = None

    def handle_udev_device(self, device: Any) -> bool:
        """Take one udev event; an NVIDIA GPU event schedules on_change after the debounce delay."""
        if not is_nvidia_pci_event(device):
            return False
        log.info(
            "udev: %s %s (%s)",
            getattr(device, "action", None) or "event",
            getattr(device, "sys_name", None) or "?",
            (getattr(device, "properties", None) or {}).get("PCI_ID", "NVIDIA"),
        )
        if self._timer is not None:
            self._timer.cancel()
        self._timer = asyncio.get_running_loop().call_later(self.debounce_s, self.due.set)
        return True

    def drain(self, monitor: UdevMonitor) -> None:
        """Read every event the monitor has queued (called when its socket is readable)."""
        while True:
            try:
                device = monitor.poll(timeout=0)
            except Exception:  # a malformed event must not stop the watch
                log.exception("udev: reading an event failed")
                return
            if device is None:
                return
            self.handle_udev_device(device)

    async def snapshot(self) -> frozenset[str] | None:
        """The UUIDs of the GPUs listed now (read in a worker thread); None, logged, when listing fails."""
        try:
            gpus = await asyncio.to_thread(self.backend.gpus)
        except GpunodeError as e:
            log.warning("hot-plug poll: listing the GPUs failed: %s", e)
            return None
        return frozenset(g.uuid for g in gpus)

    async def fire(self, why: str) -> None:
        """Run on_change (awaiting it when async); its failure is logged and the watch goes on."""
        log.info("GPU topology changed (%s): rediscovering", why)
        try:
            result = self.on_change()
            if inspect.isawaitable(result):
                await result
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("the hot-plug handler failed; the watch goes on")

    def cancel_timer(self) -> None:
        """Drop a pending debounced udev trigger."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None


async def watch_topology(
    *,
    backend: Backend,
    on_change: OnChange,
    poll_interval_s: float = 30.0,
    use_udev: bool = True,
    debounce_s: float = 1.0,
    monitor_factory: Callable[[], UdevMonitor] = open_udev_monitor,
    ready: asyncio.Event | None = None,
) -> None:
    """Watch for GPUs appearing or leaving until cancelled; call on_change (sync or async) on each change."""
    watch = TopologyWatch(backend=backend, on_change=on_change, debounce_s=debounce_s)
    loop = asyncio.get_running_loop()
    monitor: UdevMonitor | None = None
    if use_udev:
        try:
            monitor = monitor_factory()
            loop.add_reader(monitor.fileno(), watch.drain, monitor)
        except Exception as e:
            monitor = None
            log.warning(
                "no udev monitor (%s: %s); watching for GPU hot-plug by polling every %g s",
                type(e).__name__,
                e,
                poll_interval_s,
            )
    watch.known = await watch.snapshot()
    if ready is not None:
        ready.set()
    next_poll = time.monotonic() + poll_interval_s
    try:
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(watch.due.wait(), timeout=max(0.0, next_poll - time.monotonic()))
            if watch.due.is_set():
                watch.due.clear()
                await watch.fire("udev")
                current = await watch.snapshot()
                watch.known = current if current is not None else watch.known
                continue
            next_poll = time.monotonic() + poll_interval_s
            current = await watch.snapshot()
            if current is None:
                watch.known = None
                continue
            if watch.known is None:
                # The last listing failed, so changes in between cannot be ruled out: rediscover.
                watch.known = current
                await watch.fire("poll: the GPUs could be listed again")
            elif current != watch.known:
                added, removed = len(current - watch.known), len(watch.known - current)
                watch.known = current
                await watch.fire(f"poll: {added} GPU(s) added, {removed} removed")
    finally:
        watch.cancel_timer()
        if monitor is not None:
            loop.remove_reader(monitor.fileno())
