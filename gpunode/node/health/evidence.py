"""Health as a level recomputed from evidence, per physical GPU and per MIG instance.

HealthTracker is pure bookkeeping with an explicit clock: events (XID, ECC,
lost GPU) and probe results go in, `evaluate(now)` says which GPUs and MIG
instances are unhealthy and why. A fault marks its target (the GPU, or one MIG
instance for faults confined to it) at once; the target becomes healthy again
once nothing is wrong any more (no failing probe, no threshold exceeded within
its window) and the GPU's probes have passed without a break for the recovery
window since the last fault.

A fatal XID also puts a hold on its GPU: no time window clears it, only
evidence that the GPU was reset. The hold remembers the counters that restart
at a reset (the volatile ECC counts and the energy since the driver loaded, as
the probes read them); once a probe reads one of them lower than before, the
GPU was reset and the hold is released (the recovery window then counts from
the reset). An operator's clear releases it too (`clear`), and so does a
reboot or a replaced GPU, which the monitor handles (a new boot id, a new
UUID). It does no I/O, takes no lock and never talks to the device plugin:
gpunode.node.health.monitor drives it and persists the holds.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from gpunode.config.health import HealthConfig
from gpunode.contract.xids import COUNTED, FATAL, IGNORED, INSTANCE_FATAL, describe_xid
from gpunode.node.devices.base import DeviceEvent, EventKind, Gpu, GpuProbe
from gpunode.node.health.model import ECC_DBE, ECC_SBE, GPU_LOST, PROBE, XID


@dataclass(frozen=True)
class Verdict:
    """Why one GPU or MIG instance is unhealthy."""

    target_uuid: str
    gpu_uuid: str
    mig_uuid: str | None
    kind: str
    reason: str
    xid: int | None = None


# The probe readings that only grow while a GPU is up and start again from zero at a GPU reset.
RESET_COUNTERS = ("ecc_sbe_volatile", "ecc_dbe_volatile", "energy_j")


def reset_counters(probe: GpuProbe) -> dict[str, float]:
    """The RESET_COUNTERS a reachable probe read (those the GPU reports)."""
    values = {name: getattr(probe, name) for name in RESET_COUNTERS}
    return {name: float(v) for name, v in values.items() if v is not None}


@dataclass
class Hold:
    """A fatal fault that only a reset clears: the reset counters its GPU read last (None: not read yet)."""

    baseline: dict[str, float] | None = None


@dataclass(frozen=True)
class HeldFault:
    """A held target as it is persisted across agent restarts."""

    target_uuid: str
    gpu_uuid: str
    mig_uuid: str | None
    kind: str
    reason: str
    xid: int | None
    baseline: dict[str, float] | None


@dataclass
class _Target:
    uuid: str
    gpu_uuid: str
    mig_uuid: str | None
    fault_at: float | None = None  # last time a fault was seen; None: healthy
    kind: str = ""
    reason: str = ""
    xid: int | None = None
    counted: deque[tuple[float, int]] = field(default_factory=deque)  # (time, XID code)
    hold: Hold | None = None  # set by a fatal XID: only a reset (or an operator) releases it


@dataclass
class _GpuEvidence:
    uuid: str
    problem: tuple[str, str] | None = None  # (kind, reason) of the failing last probe; None: it passed
    passing_since: float | None = None  # first pass of the current unbroken run of passing probes
    last_pass_at: float | None = None
    sbe_events: deque[tuple[float, int]] = field(default_factory=deque)  # (time, errors)
    sbe_samples: deque[tuple[float, int]] = field(default_factory=deque)  # (time, volatile counter)
    counters: dict[str, float] | None = None  # the reset counters of the last reachable probe


class HealthTracker:
    """The evidence about every GPU and MIG instance of a node, and the verdict it supports."""

    def __init__(self, config: HealthConfig) -> None:
        self.config = config
        self._targets: dict[str, _Target] = {}
        self._gpus: dict[str, _GpuEvidence] = {}
        self._mig_parent: dict[str, str] = {}
        self._known_gpus: tuple[str, ...] = ()
        self.released: list[tuple[str, str]] = []  # (target, why) holds released by a reset, for the monitor

    # -- topology -----------------------------------------------------------------------------

    def set_topology(self, gpus: Iterable[Gpu]) -> None:
        """The GPUs (and their MIG devices) the node has now: for MIG attribution and GPU-less events."""
        gpus = tuple(gpus)
        self._known_gpus = tuple(g.uuid for g in gpus)
        self._mig_parent = {m.uuid: g.uuid for g in gpus for m in g.mig_devices}

    def _gpu(self, uuid: str) -> _GpuEvidence:
        ev = self._gpus.get(uuid)
        if ev is None:
            ev = self._gpus[uuid] = _GpuEvidence(uuid)
        return ev

    def _target(self, gpu_uuid: str, mig_uuid: str | None) -> _Target:
        uuid = mig_uuid or gpu_uuid
        t = self._targets.get(uuid)
        if t is None:
            t = self._targets[uuid] = _Target(uuid, gpu_uuid, mig_uuid)
        return t

    def _fault(self, t: _Target, kind: str, reason: str, now: float, xid: int | None = None) -> None:
        if t.fault_at is None:  # the first fault of an episode names it
            t.kind, t.reason, t.xid = kind, reason, xid
        t.fault_at = now if t.fault_at is None else max(t.fault_at, now)

    # -- evidence -----------------------------------------------------------------------------

    def record_event(self, event: DeviceEvent, now: float) -> None:
        """Take one device event seen at `now` (s): mark its target by the XID and ECC rules, or count it.

        An event naming no GPU (and no known MIG device) counts against every known GPU; hot-plug events
        (GPU added or removed) are not health evidence and are ignored.
        """
        if event.kind in (EventKind.GPU_ADDED, EventKind.GPU_REMOVED):
            return  # topology, not health: the agent re-advertises and lists vanished GPUs as unhealthy
        mig = event.mig_uuid
        if event.gpu_uuid is not None:
            gpus: tuple[str, ...] = (event.gpu_uuid,)
        elif mig is not None and mig in self._mig_parent:
            gpus = (self._mig_parent[mig],)
        else:
            # The driver could not say which GPU: every GPU is suspect.
            gpus, mig = self._known_gpus, None
        if mig is not None and mig not in self._mig_parent:
            mig = None  # an instance we do not know of: judge its GPU
        for gpu in gpus:
            self._record_on(gpu, mig, event, now)

    def _record_on(self, gpu: str, mig: str | None, event: DeviceEvent, now: float) -> None:
        cfg = self.config
        if event.kind == EventKind.XID and event.xid is not None:
            code = event.xid
            policy = cfg.xid.classify(code)
            if policy == IGNORED:
                return
            if policy == FATAL:
                t = self._target(gpu, None)
                self._fault(t, XID, f"{describe_xid(code)}: needs a GPU reset", now, code)
                if t.hold is None:
                    ev = self._gpus.get(gpu)
                    t.hold = Hold(dict(ev.counters) if ev is not None and ev.counters else None)
            elif policy == INSTANCE_FATAL:
                self._fault(self._target(gpu, mig), XID, f"{describe_xid(code)}", now, code)
            elif policy == COUNTED:
                t = self._target(gpu, mig)
                t.counted.append((now, code))
                n = self._counted_in_window(t, now)
                if cfg.xid.count_threshold and n >= cfg.xid.count_threshold:
                    window = cfg.xid.count_window_s
                    self._fault(t, XID, f"{n} XIDs within {window:g} s, last {describe_xid(code)}", now, code)
        elif event.kind == EventKind.ECC_DBE:
            if cfg.dbe_fatal:
                self._fault(
                    self._target(gpu, None),
                    ECC_DBE,
                    f"{event.count} uncorrectable (double-bit) ECC error(s)",
                    now,
                )
        elif event.kind == EventKind.ECC_SBE:
            ev = self._gpu(gpu)
            ev.sbe_events.append((now, max(event.count, 0)))
            self._check_sbe(gpu, now)
        elif event.kind == EventKind.GPU_LOST:
            self._fault(
                self._target(gpu, None),
                GPU_LOST,
                "GPU is lost: it fell off the bus or stopped answering",
                now,
            )

    def record_probe(self, probe: GpuProbe, now: float) -> None:
        """A probe that answered (reachable or not)."""
        cfg = self.config
        ev = self._gpu(probe.uuid)
        problem: tuple[str, str] | None = None
        if not probe.reachable:
            problem = (GPU_LOST, f"probe: {probe.detail or 'the GPU does not answer'}")
        elif probe.row_remap_failure:
            problem = (PROBE, "row remapping failed: the GPU has no spare rows left (replace it)")
        elif cfg.dbe_fatal and (probe.ecc_dbe_volatile or 0) > 0:
            problem = (ECC_DBE, f"{probe.ecc_dbe_volatile} uncorrectable ECC error(s) since the last reset")
        elif cfg.pending_repair_unhealthy and probe.row_remap_pending:
            problem = (PROBE, "row remapping pending: the GPU needs a reset")
        elif cfg.pending_repair_unhealthy and probe.retired_pages_pending:
            problem = (PROBE, "retired pages pending: the GPU needs a reset")
        if probe.reachable and probe.ecc_sbe_volatile is not None:
            samples = ev.sbe_samples
            if samples and probe.ecc_sbe_volatile < samples[-1][1]:
                # The counter went back: the GPU was reset, the errors before it no longer count.
                samples.clear()
                ev.sbe_events.clear()
            samples.append((now, probe.ecc_sbe_volatile))
        if probe.reachable:
            counters = reset_counters(probe)
            if counters:
                ev.counters = counters
                self._check_reset(probe.uuid, counters, now)
        self._set_probe_outcome(ev, problem, now)
        self._check_sbe(probe.uuid, now)

    def record_probe_failure(self, gpu_uuid: str, detail: str, now: float) -> None:
        """A probe that raised or did not answer in time."""
        self._set_probe_outcome(self._gpu(gpu_uuid), (PROBE, f"probe: {detail}"), now)

    def _set_probe_outcome(self, ev: _GpuEvidence, problem: tuple[str, str] | None, now: float) -> None:
        ev.problem = problem
        if problem is None:
            if ev.passing_since is None:
                ev.passing_since = now
            ev.last_pass_at = now
        else:
            ev.passing_since = None
            self._fault(self._target(ev.uuid, None), problem[0], problem[1], now)

    def _check_reset(self, gpu_uuid: str, counters: dict[str, float], now: float) -> None:
        """Release the holds on a GPU whose reset counters went back; else move their baseline on."""
        for t in self._targets.values():
            if t.gpu_uuid != gpu_uuid or t.hold is None:
                continue
            base = t.hold.baseline or {}
            back = [k for k, v in counters.items() if k in base and v < base[k]]
            if back:
                t.hold = None
                t.fault_at = now  # the recovery window counts from the reset
                what = ", ".join(f"{k} {base[k]:g} -> {counters[k]:g}" for k in back)
                self.released.append((t.uuid, f"the GPU was reset (counters restarted: {what})"))
            else:
                t.hold.baseline = {**base, **counters}

    # -- holds --------------------------------------------------------------------------------

    def clear(self, uuid: str) -> list[str]:
        """An operator's clear of a GPU (and its MIG instances) or of one MIG instance: its faults, holds and
        counts are forgotten. Returns the targets that were unhealthy; a problem the probes still see marks
        the target again at the next probe."""
        cleared = []
        for t in self._targets.values():
            if uuid not in (t.uuid, t.gpu_uuid):
                continue
            if t.fault_at is not None:
                cleared.append(t.uuid)
            t.fault_at, t.kind, t.reason, t.xid, t.hold = None, "", "", None, None
            t.counted.clear()
        ev = self._gpus.get(uuid)
        if ev is not None:
            ev.sbe_events.clear()
            while len(ev.sbe_samples) > 1:
                ev.sbe_samples.popleft()
        return cleared

    def holds(self) -> dict[str, HeldFault]:
        """Every target held now, by UUID (what the monitor persists)."""
        return {
            t.uuid: HeldFault(
                t.uuid, t.gpu_uuid, t.mig_uuid, t.kind, t.reason, t.xid, dict(t.hold.baseline or {}) or None
            )
            for t in self._targets.values()
            if t.hold is not None and t.fault_at is not None
        }

    def restore(self, held: Iterable[HeldFault], now: float) -> None:
        """Put back holds persisted by an earlier run of the agent (same boot): the targets are unhealthy
        again at once and stay so until a probe shows the reset, or an operator clears them."""
        for h in held:
            t = self._target(h.gpu_uuid, h.mig_uuid)
            self._fault(t, h.kind, h.reason, now, h.xid)
            if t.hold is None:
                t.hold = Hold(dict(h.baseline) if h.baseline else None)

    # -- windows ------------------------------------------------------------------------------

    def _counted_in_window(self, t: _Target, now: float) -> int:
        start = now - self.config.xid.count_window_s
        while t.counted and t.counted[0][0] <= start:
            t.counted.popleft()
        return len(t.counted)

    def sbe_in_window(self, gpu_uuid: str, now: float) -> int:
        """Corrected ECC errors seen within the window: events or counter growth, whichever says more."""
        ev = self._gpus.get(gpu_uuid)
        if ev is None:
            return 0
        start = now - self.config.sbe_window_s
        while ev.sbe_events and ev.sbe_events[0][0] <= start:
            ev.sbe_events.popleft()
        # Keep one sample at or before the window's start as the baseline.
        while len(ev.sbe_samples) >= 2 and ev.sbe_samples[1][0] <= start:
            ev.sbe_samples.popleft()
        from_events = sum(n for _, n in ev.sbe_events)
        from_counter = ev.sbe_samples[-1][1] - ev.sbe_samples[0][1] if ev.sbe_samples else 0
        return max(from_events, from_counter)

    def _check_sbe(self, gpu_uuid: str, now: float) -> None:
        threshold = self.config.sbe_threshold
        if not threshold:
            return
        n = self.sbe_in_window(gpu_uuid, now)
        if n >= threshold:
            window = self.config.sbe_window_s
            self._fault(
                self._target(gpu_uuid, None),
                ECC_SBE,
                f"{n} corrected (single-bit) ECC errors within {window:g} s",
                now,
            )

    # -- the verdict ----------------------------------------------------------------------------

    def _ongoing(self, t: _Target, now: float) -> bool:
        """Is something still wrong right now (as opposed to a past fault awaiting recovery)?"""
        cfg = self.config
        ev = self._gpus.get(t.gpu_uuid)
        if t.mig_uuid is None and ev is not None:
            if ev.problem is not None:
                return True
            if cfg.sbe_threshold and self.sbe_in_window(t.gpu_uuid, now) >= cfg.sbe_threshold:
                return True
        threshold = cfg.xid.count_threshold
        return bool(threshold) and self._counted_in_window(t, now) >= threshold

    def _recovered(self, t: _Target, now: float) -> bool:
        assert t.fault_at is not None
        if t.hold is not None or self._ongoing(t, now):
            return False
        ev = self._gpus.get(t.gpu_uuid)
        if ev is None or ev.passing_since is None or ev.last_pass_at is None or ev.last_pass_at < t.fault_at:
            return False  # no passing probe since the fault
        return now - max(ev.passing_since, t.fault_at) >= self.config.recovery_window_s

    def evaluate(self, now: float) -> dict[str, Verdict]:
        """Every GPU/MIG UUID unhealthy now; targets whose recovery window has passed are cleared."""
        out: dict[str, Verdict] = {}
        for t in self._targets.values():
            if t.fault_at is None:
                continue
            if self._recovered(t, now):
                t.fault_at, t.kind, t.reason, t.xid = None, "", "", None
                continue
            out[t.uuid] = Verdict(t.uuid, t.gpu_uuid, t.mig_uuid, t.kind, t.reason, t.xid)
        return out

    def forget(self, gpu_uuids: Iterable[str]) -> None:
        """Drop all evidence about GPUs that left the node (and their MIG instances)."""
        gone = set(gpu_uuids)
        for uuid in [u for u, t in self._targets.items() if t.gpu_uuid in gone]:
            del self._targets[uuid]
        for uuid in gone:
            self._gpus.pop(uuid, None)
