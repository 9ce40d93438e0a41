"""The agent's cross-check of each pod's compute share against what the driver says each process used.

Whatever the interposer reports lives in the container's usage file, which the
container can write: it may zero its busy counters, write itself a huge budget,
unmap the file, or launch work through a path the hooks do not see. So every
gpunode.computeShare.interval the agent also asks the driver (the backend's
process_utilization: nvmlDeviceGetProcessUtilization on a real GPU) which
processes used each GPU that holds capped containers, and how much, and gives
each process to a pod:

1. by the host's /proc/<pid>/cgroup (trusted: the kubelet's cgroup path names
   the pod's UID, which the pod watch gives);
2. else by the region whose per-process slots claim the pid (tenant-writable,
   so used only where the cgroup cannot say, and never against it);
3. else the GPU time is unattributed: someone on the GPU runs outside every pod
   the agent knows (gpunode_gpu_compute_unattributed_share{gpu}).

Capped MIG devices are not checked: NVML gives no per-process utilisation there
(and a MIG device's compute is its own slices, isolated by the hardware).

Per pod and GPU it then has two figures, the share the driver saw and the share
the pod's regions report, both exported as metrics, and feeds them to
memcap.compute.ShareWatch. A pod above its hard share by the driver's figures,
or reporting less than the driver saw, for gpunode.computeShare.flagAfter in a
row gets one Warning Event (ComputeShareExceeded) on the pod; with
gpunode.computeShare.evict, a pod above its hard share is also evicted (policy/v1
Eviction, as health remediation evicts). A new run after the pod came back
within its share gets a new Event.

Nothing here ever ends the agent: a backend or API failure is logged once per
streak and tried again at the next interval.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from gpunode.config.sharing import ComputeShareCheck
from gpunode.errors import EvictionBlocked, GpunodeError, KubeNotFound
from gpunode.infra.kube import KubeClient, ObjectRef
from gpunode.node.allocation.shares import ComputeShares
from gpunode.node.memcap.checkpoint import CapRecord
from gpunode.node.memcap.compute import ComputeMode, ShareWatch, read_compute

log = logging.getLogger(__name__)

EVENT_REASON = "ComputeShareExceeded"
MAX_CGROUP_BYTES = 64 * 1024
_POD_UID = re.compile(r"pod([0-9a-f]{8}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{12})")


@dataclass(frozen=True)
class PodCompute:
    """One pod's compute on one GPU over the last window: its share, and what the driver and its regions say."""

    pod: str  # namespace/name
    gpu_uuid: str
    share_milli: int
    mode: ComputeMode
    driver_share: float  # the GPU time its processes got by the driver, over the window's wall time
    reported_share: float  # the same from its regions' busy counters
    flagged: bool


def pod_uid_of_cgroup(text: str) -> str | None:
    """The pod UID the kubelet's cgroup path names in a /proc/<pid>/cgroup text (systemd's _ as -)."""
    m = _POD_UID.search(text)
    return m.group(1).replace("_", "-") if m else None


class ShareCheck:
    """Cross-checks every capped pod's compute share against the driver's per-process figures (see module)."""

    def __init__(
        self,
        *,
        backend: Any,
        shares: ComputeShares,
        config: ComputeShareCheck,
        pod_uids: Callable[[], Mapping[str, str]],
        api: Callable[[], KubeClient] | None,
        node_name: str,
        mode_of: Callable[[CapRecord], ComputeMode],
        proc_root: Path = Path("/proc"),
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.backend = backend
        self.shares = shares
        self.config = config
        self._pod_uids = pod_uids
        self._api_factory = api
        self._api: KubeClient | None = None
        self.node_name = node_name
        self._mode_of = mode_of
        self.proc_root = Path(proc_root)
        self._clock = clock
        self.watches: dict[tuple[str, str], ShareWatch] = {}
        self.view: dict[tuple[str, str], PodCompute] = {}
        self.unattributed: dict[str, float] = {}  # GPU -> share of its time no known pod accounts for
        self.posted: set[tuple[str, str]] = set()  # (pod, GPU) whose current run has its Event
        self.evicted: set[str] = set()
        self._busy: dict[str, int] = {}  # region key -> its busy counter at the last window
        self._since_us: dict[str, int] = {}  # GPU -> the newest driver sample seen
        self._last: float | None = None
        self._failing: dict[str, str] = {}

    # -- one window ----------------------------------------------------------------------------

    async def tick(self) -> None:
        """Measure one window and act on the pods flagged."""
        now = self._clock()
        window = None if self._last is None else now - self._last
        self._last = now
        await asyncio.to_thread(self._measure, window)
        for key, watch in list(self.watches.items()):
            if not watch.flagged:
                if watch.over_s == 0 and watch.under_s == 0:
                    self.posted.discard(key)  # back within its share: a new run gets a new Event
                continue
            over = watch.over_s >= watch.flag_after_s
            if key not in self.posted or (self.config.evict and over and key[0] not in self.evicted):
                await self._flag(key, watch)

    def _measure(self, window_s: float | None) -> None:
        records = self.shares.checkpoint.records()
        planned = self.shares.planned
        owners = self.shares.owners
        uid_to_pod = {uid: pod for pod, uid in self._pod_uids().items()}
        by_gpu: dict[str, list[str]] = {}
        for key, p in planned.items():
            if p.pod and not p.gpu_uuid.startswith("MIG-"):  # NVML has no per-process utilisation on MIG
                by_gpu.setdefault(p.gpu_uuid, []).append(key)
        reported: dict[str, int] = {}
        claims: dict[int, str] = {}  # pid -> region key that claims it (tenant-writable)
        for keys in by_gpu.values():
            for key in keys:
                try:
                    report = read_compute(self.shares.regions_root / key)
                except GpunodeError:
                    continue  # damaged or unmapped: it reports nothing, the driver still sees its work
                before = self._busy.get(key)
                self._busy[key] = report.busy_ns
                if before is not None:
                    reported[key] = max(0, report.busy_ns - before)  # a zeroed counter reports nothing
                for proc in report.per_process:
                    if proc.alive and proc.pid > 0:
                        claims.setdefault(proc.pid, key)
        for gone in [k for k in self._busy if k not in planned]:
            del self._busy[gone]
        if window_s is None or window_s <= 0:
            for gpu in by_gpu:
                self._driver(gpu)  # the samples so far are the baseline
            return
        seen: set[tuple[str, str]] = set()
        for gpu, keys in by_gpu.items():
            samples = self._driver(gpu)
            if samples is None:
                continue
            driver: dict[str, float] = {}
            unattributed = 0.0
            for pid, used in samples.items():
                pod = self._pod_of_pid(pid, uid_to_pod)
                if pod is None and pid in claims:
                    pod = owners.get(claims[pid])
                if pod is None:
                    unattributed += used
                else:
                    driver[pod] = driver.get(pod, 0.0) + used
            self.unattributed[gpu] = unattributed
            pods: dict[str, list[str]] = {}
            for key in keys:
                pods.setdefault(planned[key].pod, []).append(key)
            for pod, mine in pods.items():
                share = sum(planned[k].share_milli for k in mine)
                modes = {self._mode_of(records[k]) for k in mine if k in records}
                mode = (
                    ComputeMode.HARD
                    if ComputeMode.HARD in modes
                    else next(iter(modes), ComputeMode.WORK_CONSERVING)
                )
                watch = self.watches.get((pod, gpu))
                if watch is None:
                    watch = self.watches[(pod, gpu)] = ShareWatch(
                        share, mode, flag_after_s=self.config.flag_after_s, tolerance=self.config.tolerance
                    )
                watch.share_milli, watch.mode = share, mode
                wall_ns = window_s * 1e9
                check = watch.observe(
                    window_s, int(driver.get(pod, 0.0) * wall_ns), sum(reported.get(k, 0) for k in mine)
                )
                self.view[(pod, gpu)] = PodCompute(
                    pod, gpu, share, mode, check.driver_share, check.reported_share, watch.flagged
                )
                seen.add((pod, gpu))
        for ended in [k for k in self.watches if k not in seen]:
            del self.watches[ended]
            self.view.pop(ended, None)
            self.posted.discard(ended)
        for gpu in [g for g in self.unattributed if g not in by_gpu]:
            del self.unattributed[gpu]

    def _driver(self, gpu: str) -> dict[int, float] | None:
        """Each process's share of the GPU since the last window, by the driver (None: it cannot say)."""
        read = getattr(self.backend, "process_utilization", None)
        if read is None:
            return None
        try:
            samples = read(gpu, self._since_us.get(gpu, 0))
        except GpunodeError as exc:
            self._fail(f"driver:{gpu}", f"cannot read the per-process utilisation of GPU {gpu}: {exc}")
            return None
        self._failing.pop(f"driver:{gpu}", None)
        per: dict[int, list[int]] = {}
        for s in samples:
            per.setdefault(s.pid, []).append(s.sm_percent)
            self._since_us[gpu] = max(self._since_us.get(gpu, 0), s.timestamp_us)
        return {pid: sum(v) / len(v) / 100.0 for pid, v in per.items()}

    def _pod_of_pid(self, pid: int, uid_to_pod: Mapping[str, str]) -> str | None:
        """The pod the host's /proc/<pid>/cgroup puts the process in, when it is one the watch knows."""
        try:
            with (self.proc_root / str(pid) / "cgroup").open("rb") as f:
                text = f.read(MAX_CGROUP_BYTES).decode(errors="replace")
        except OSError:
            return None
        uid = pod_uid_of_cgroup(text)
        return uid_to_pod.get(uid) if uid else None

    # -- flagging ------------------------------------------------------------------------------

    async def _flag(self, key: tuple[str, str], watch: ShareWatch) -> None:
        pod, gpu = key
        namespace, _, name = pod.partition("/")
        view = self.view.get(key)
        figures = (
            f" (driver {view.driver_share:.0%}, reported {view.reported_share:.0%} of GPU {gpu})"
            if view
            else ""
        )
        message = f"pod {pod}: {watch.reason()}{figures}"
        if key not in self.posted:
            log.warning("compute share: %s", message)
        if self._api_factory is None:
            self.posted.add(key)
            return
        uid = self._pod_uids().get(pod)
        try:
            api = self._client()
            if key not in self.posted:
                await api.post_event(
                    ObjectRef("Pod", name, namespace, uid=uid or ""), reason=EVENT_REASON, message=message,
                    host=self.node_name, action="Flagged",
                )  # fmt: skip
                self.posted.add(key)
            self._failing.pop("api", None)
            over = watch.over_s >= watch.flag_after_s
            if self.config.evict and over and pod not in self.evicted:
                await api.evict_pod(namespace, name, uid=uid)
                self.evicted.add(pod)
                log.warning("compute share: pod %s evicted (gpunode.computeShare.evict)", pod)
        except KubeNotFound:
            self.posted.add(key)
        except EvictionBlocked as exc:
            self._fail(f"evict:{pod}", f"the eviction of pod {pod} is blocked: {exc}")
        except GpunodeError as exc:
            self._fail("api", f"cannot post the compute-share Event of pod {pod}: {exc}")

    def _client(self) -> KubeClient:
        if self._api is None:
            assert self._api_factory is not None
            self._api = self._api_factory()
        return self._api

    def _fail(self, what: str, line: str) -> None:
        if self._failing.get(what) != line:
            self._failing[what] = line
            log.warning("compute share: %s (tried again every %.1f s)", line, self.config.interval_s)

    # -- running -------------------------------------------------------------------------------

    async def run(self) -> None:
        """One window every gpunode.computeShare.interval, until cancelled."""
        try:
            while True:
                await self.tick()
                await asyncio.sleep(self.config.interval_s)
        finally:
            if self._api is not None:
                await self._api.close()

    def collector(self) -> Collector:
        """Per pod and GPU: the share, the driver's and the reported share, flagged; per GPU: unattributed."""
        return _ShareCollector(self)


class _ShareCollector(Collector):
    def __init__(self, check: ShareCheck) -> None:
        self._check = check

    def collect(self) -> Iterator[GaugeMetricFamily]:
        labels = ["namespace", "pod", "gpu"]
        driver = GaugeMetricFamily(
            "gpunode_pod_compute_share_driver",
            "The pod's share of the GPU over the last window by the driver's per-process figures (0..1).",
            labels=labels,
        )
        reported = GaugeMetricFamily(
            "gpunode_pod_compute_share_reported",
            "The pod's share of the GPU over the last window as its interposer reported it (0..1; the "
            "container can write this figure, the driver's it cannot).",
            labels=labels,
        )
        flagged = GaugeMetricFamily(
            "gpunode_pod_compute_share_flagged",
            "1 while the pod has been above its hard share, or reported less than the driver saw, for "
            "gpunode.computeShare.flagAfter.",
            labels=labels,
        )
        for (pod, gpu), v in sorted(self._check.view.items()):
            namespace, _, name = pod.partition("/")
            driver.add_metric([namespace, name, gpu], v.driver_share)
            reported.add_metric([namespace, name, gpu], v.reported_share)
            flagged.add_metric([namespace, name, gpu], 1.0 if v.flagged else 0.0)
        unattributed = GaugeMetricFamily(
            "gpunode_gpu_compute_unattributed_share",
            "The share of the GPU over the last window that the driver saw processes use which no pod "
            "on the node accounts for.",
            labels=["gpu"],
        )
        for gpu, share in sorted(self._check.unattributed.items()):
            unattributed.add_metric([gpu], share)
        yield from (driver, reported, flagged, unattributed)
