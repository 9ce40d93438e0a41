"""Idle GPUs: flag the pods whose GPUs stay below a utilisation threshold for a configured time.

Every `gpunode.idle.interval` the watch asks the kubelet (pod-resources List)
which container holds which device, maps each device ID through the inventory to
the GPU or MIG device behind it, and samples those GPUs through the backend. A
pod's utilisation is the highest of its GPUs' (a pod is idle only when all of
them are): the GPU's utilisation for a whole GPU (its graphics-engine activity
when the driver gives no utilisation), the MIG device's graphics-engine activity
for a MIG device. A replica or memory unit of a shared GPU (time-sliced,
fractional) is measured as the whole GPU (or MIG device): the backends report
utilisation per GPU, not per process, so a pod on a shared GPU is flagged only
when the GPU as a whole, all its pods together, is idle. A sample that could not
be read counts as neither idle nor busy: it restarts a pod's idle run that has
not yet been flagged, and keeps a flag that has been raised.

When a pod has been below `utilisationBelow` for `for`, the watch (1) sets the
gauges gpunode_pod_gpu_idle{namespace,pod} to 1 and
gpunode_pod_gpu_idle_seconds to the time so far, (2) annotates the pod with
gpunode.io/gpu-idle-since (RFC 3339, when the idle run began) and (3) posts one
Warning Event GPUIdle on the pod naming its GPUs, the threshold and the time.
When the pod uses its GPUs again, the annotation is removed and the next idle
run gets its own Event. The annotation also carries the state across agent
restarts: a pod seen for the first time is read once, and an annotation already
on it resumes its idle run without a second Event.

The watch never ends the agent: an API or kubelet failure is logged once per
streak (gpunode_idle_api_errors_total counts them) and the work is tried again
at the next interval; after one failed API call a round makes no more calls. A
pod the kubelet no longer lists is forgotten, and at most MAX_TRACKED_PODS are
followed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime

from lightkube.resources.core_v1 import Pod
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from gpunode.config.idle import IdleConfig
from gpunode.contract.names import GPU_IDLE_ANNOTATION
from gpunode.contract.reader import format_seconds
from gpunode.errors import BackendError, DeviceNotFound, GpunodeError, KubeError, KubeNotFound
from gpunode.infra.kube import KubeClient, ObjectRef
from gpunode.node.devices.base import Backend, GpuSample
from gpunode.node.inventory import Inventory
from gpunode.node.kubelet.podresources import ContainerDevices

log = logging.getLogger(__name__)

EVENT_REASON = "GPUIdle"
MAX_TRACKED_PODS = 1024  # far above the pods one node runs (110 by default)
SHARED_KINDS = ("replica", "memory")
API_BACK = "the API server answers the idle-GPU watch again"

PodKey = tuple[str, str]  # (namespace, name)


@dataclass(frozen=True)
class Target:
    """One GPU or MIG device a pod uses, and whether other pods may share it."""

    gpu_uuid: str
    mig_uuid: str | None
    shared: bool
    name: str = field(compare=False)  # for messages: "GPU 1 (GPU-...)", "MIG device MIG-... of GPU 1"


@dataclass
class PodIdle:
    """What the watch knows of one pod: its idle run, and what it has written about it."""

    targets: tuple[Target, ...]
    since_mono: float | None = None  # when the current idle run began (monotonic), None while busy
    since_wall: float | None = None  # the same, in seconds since the epoch (for the annotation)
    flagged: bool = False  # idle for longer than `for`
    checked: bool = False  # the pod's annotation has been read from the API server (or written)
    on_pod: str | None = None  # the annotation's value on the pod, as far as the watch knows
    event_posted: bool = False  # the Event of the current idle run has been posted
    gone: bool = False  # the API server does not know the pod: nothing is written about it
    uid: str = ""


def rfc3339(seconds: float) -> str:
    """Seconds since the epoch as an RFC 3339 UTC time, e.g. 2026-11-24T12:42:08Z."""
    return datetime.fromtimestamp(seconds, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def parse_rfc3339(text: str) -> float | None:
    """An RFC 3339 time as seconds since the epoch; None when it is not one."""
    try:
        moment = datetime.fromisoformat(text.strip()[:64])
    except ValueError:
        return None
    return moment.timestamp() if moment.tzinfo is not None else None


def pods_of(containers: Iterable[ContainerDevices], inventory: Inventory) -> dict[PodKey, tuple[Target, ...]]:
    """The GPUs each pod holds, from the kubelet's list: only devices this agent advertises."""
    ours = set(inventory.resources())
    index = {g.uuid: g.index for g in inventory.gpus}
    out: dict[PodKey, dict[Target, None]] = {}
    for c in containers:
        if c.resource_name not in ours:
            continue
        for device_id in c.device_ids:
            d = inventory.by_id(device_id)
            if d is None:
                continue
            gpu = f"GPU {index[d.gpu_uuid]} ({d.gpu_uuid})" if d.gpu_uuid in index else f"GPU {d.gpu_uuid}"
            name = f"MIG device {d.mig_uuid} of {gpu}" if d.mig_uuid else gpu
            target = Target(d.gpu_uuid, d.mig_uuid, d.kind in SHARED_KINDS, name=name)
            out.setdefault((c.namespace, c.pod), {})[target] = None
    return {key: tuple(targets) for key, targets in out.items()}


def utilisation(sample: GpuSample | None, target: Target) -> float | None:
    """The target's utilisation (ratio 0..1) in the sample of its GPU; None when it cannot be told."""
    if sample is None:
        return None
    if target.mig_uuid is None:
        return sample.gpu_util if sample.gpu_util is not None else sample.gr_engine_active
    mig = next((m for m in sample.mig if m.uuid == target.mig_uuid), None)
    return mig.gr_engine_active if mig is not None else None


def pod_utilisation(samples: Mapping[str, GpuSample | None], targets: Sequence[Target]) -> float | None:
    """The highest utilisation among the pod's GPUs; None when any of them cannot be told."""
    values = [utilisation(samples.get(t.gpu_uuid), t) for t in targets]
    if not values or any(v is None for v in values):
        return None
    return max(v for v in values if v is not None)


class IdleWatch:
    """Flags the pods whose GPUs stay idle (see the module's docstring). run() until cancelled."""

    def __init__(
        self,
        *,
        config: IdleConfig,
        backend: Backend,
        inventory: Callable[[], Inventory],
        list_containers: Callable[[], Awaitable[Sequence[ContainerDevices]]],
        client_factory: Callable[[], KubeClient],
        node_name: str = "",
        monotonic: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self.config = config
        self._backend = backend
        self._inventory = inventory
        self._list = list_containers
        self._client_factory = client_factory
        self._client: KubeClient | None = None
        self.node_name = node_name
        self._monotonic = monotonic
        self._wall = wall
        self.pods: dict[PodKey, PodIdle] = {}
        self.api_errors = 0
        self.rounds = 0  # rounds completed
        self._failing: dict[str, str] = {}  # "kubelet" / "api" -> the error that began the streak
        self._capped = False  # more pods than MAX_TRACKED_PODS hold GPUs (said once)
        self._view: tuple[tuple[str, str, bool, float], ...] = ()  # what a scrape shows

    # -- the loop --------------------------------------------------------------------------------

    async def run(self) -> None:
        """Look every interval until cancelled; nothing that goes wrong here ends the agent."""
        loop = asyncio.get_running_loop()
        log.info(
            "idle GPUs: pods below %g%% utilisation for %s are flagged (sampled every %s)",
            self.config.below_percent,
            format_seconds(self.config.for_s),
            format_seconds(self.config.interval_s),
        )
        try:
            while True:
                started = loop.time()
                try:
                    await self.round()
                except GpunodeError as exc:
                    log.warning("idle GPUs: this round failed, trying again: %s", exc)
                except Exception:
                    log.exception("idle GPUs: this round failed unexpectedly, trying again")
                await asyncio.sleep(max(0.0, self.config.interval_s - (loop.time() - started)))
        finally:
            if self._client is not None:
                with contextlib.suppress(Exception):
                    await self._client.close()

    async def round(self) -> None:
        """One look: list the holders, sample their GPUs, update each pod, write what changed."""
        try:
            containers = await self._list()
        except KubeError as exc:
            self._fail("kubelet", exc, "the kubelet's pod-resources list failed, so no pod is judged")
            return
        self._ok("kubelet", "the kubelet's pod-resources list answers again")
        held = pods_of(containers, self._inventory())
        over = len(held) > MAX_TRACKED_PODS
        if over:
            if not self._capped:
                log.warning(
                    "idle GPUs: %d pods hold GPUs; following the first %d", len(held), MAX_TRACKED_PODS
                )
            held = dict(sorted(held.items())[:MAX_TRACKED_PODS])
        self._capped = over
        for key in [k for k in self.pods if k not in held]:
            del self.pods[key]  # the kubelet no longer lists it: forgotten
        for key, targets in held.items():
            st = self.pods.get(key)
            if st is None or st.targets != targets:  # new, or the same name holding other GPUs
                self.pods[key] = PodIdle(targets)
        samples = await asyncio.to_thread(self._sample, {t.gpu_uuid for ts in held.values() for t in ts})
        api_ok = await self._read_annotations()
        now_m, now_w = self._monotonic(), self._wall()
        for key, st in self.pods.items():
            self._judge(key, st, pod_utilisation(samples, st.targets), now_m, now_w)
        if api_ok:
            await self._write()
        self._view = tuple(
            (ns, pod, st.flagged, now_m - st.since_mono if st.since_mono is not None else 0.0)
            for (ns, pod), st in sorted(self.pods.items())
        )
        self.rounds += 1

    def _sample(self, uuids: Iterable[str]) -> dict[str, GpuSample | None]:
        out: dict[str, GpuSample | None] = {}
        for uuid in sorted(uuids):
            try:
                out[uuid] = self._backend.sample(uuid)
            except (BackendError, DeviceNotFound) as exc:  # a lost GPU included: not judged this round
                log.debug("idle GPUs: cannot sample %s: %s", uuid, exc)
                out[uuid] = None
        return out

    def _judge(self, key: PodKey, st: PodIdle, util: float | None, now_m: float, now_w: float) -> None:
        """Carry one pod's idle run forward with this round's utilisation (None: not known)."""
        if util is None:
            if not st.flagged:
                st.since_mono = st.since_wall = None
            return
        if util >= self.config.below_ratio:
            if st.flagged:
                log.info("idle GPUs: %s/%s uses its GPUs again (%.0f%%)", *key, util * 100)
            st.since_mono = st.since_wall = None
            st.flagged = st.event_posted = False
            return
        if st.since_mono is None:
            st.since_mono, st.since_wall = now_m, now_w
        if not st.flagged and now_m - st.since_mono >= self.config.for_s:
            st.flagged = True
            log.info("idle GPUs: %s", self.message(key, st))

    def message(self, key: PodKey, st: PodIdle) -> str:
        """The Event's message: the GPUs, the threshold, how long and since when."""
        gpus = ", ".join(t.name for t in st.targets)
        since = rfc3339(st.since_wall) if st.since_wall is not None else "unknown"
        text = (
            f"pod {key[0]}/{key[1]}: utilisation of {gpus} below {self.config.below_percent:g}% for "
            f"{format_seconds(self.config.for_s)} or more (since {since})"
        )
        if any(t.shared for t in st.targets):
            text += "; a shared GPU is measured as a whole, all its pods together"
        return text

    # -- the API server --------------------------------------------------------------------------

    def _api(self) -> KubeClient:
        if self._client is None:
            self._client = self._client_factory()
        return self._client

    async def _read_annotations(self) -> bool:
        """Read the annotation of each pod seen for the first time; False once a call fails."""
        for (namespace, name), st in self.pods.items():
            if st.checked or st.gone:
                continue
            try:
                pod = await self._api().get(Pod, name, namespace=namespace)
            except KubeNotFound:
                st.gone = True
                continue
            except KubeError as exc:
                self._fail("api", exc, "the idle state of pods cannot be read or written")
                return False
            self._ok("api", API_BACK)
            meta = pod.metadata
            st.uid = (meta.uid if meta else None) or ""
            value = ((meta.annotations if meta else None) or {}).get(GPU_IDLE_ANNOTATION)
            st.checked, st.on_pod = True, value
            since = parse_rfc3339(value) if value is not None else None
            if since is not None:  # flagged before this agent started: the run goes on, its Event is posted
                now_m, now_w = self._monotonic(), self._wall()
                st.since_wall, st.since_mono = since, now_m - max(0.0, now_w - since)
                st.flagged = st.event_posted = True
        return True

    async def _write(self) -> None:
        """Bring each pod's annotation and Event in line with its state; stop at the first failure."""
        for key, st in self.pods.items():
            if st.gone:
                continue
            wanted = rfc3339(st.since_wall) if st.flagged and st.since_wall is not None else None
            try:
                if st.on_pod != wanted:
                    await self._api().patch_pod_annotations(*key, {GPU_IDLE_ANNOTATION: wanted})
                    st.on_pod, st.checked = wanted, True
                    self._ok("api", API_BACK)
                if st.flagged and not st.event_posted:
                    await self._api().post_event(
                        ObjectRef("Pod", key[1], key[0], uid=st.uid),
                        reason=EVENT_REASON,
                        message=self.message(key, st),
                        host=self.node_name,
                        action="Flagged",
                    )
                    st.event_posted = True
                    self._ok("api", API_BACK)
            except KubeNotFound:
                st.gone = True
            except KubeError as exc:
                self._fail("api", exc, "the idle state of pods cannot be read or written")
                return

    # -- saying things once ----------------------------------------------------------------------

    def _fail(self, what: str, exc: GpunodeError, consequence: str) -> None:
        if what == "api":
            self.api_errors += 1
        if what not in self._failing:
            self._failing[what] = str(exc)
            log.warning(
                "idle GPUs: %s (hint: %s); %s, trying again every %s",
                exc,
                exc.hint,
                consequence,
                format_seconds(self.config.interval_s),
            )

    def _ok(self, what: str, text: str) -> None:
        if self._failing.pop(what, None) is not None:
            log.info("idle GPUs: %s", text)

    # -- metrics ---------------------------------------------------------------------------------

    def collector(self) -> Collector:
        """gpunode_pod_gpu_idle, gpunode_pod_gpu_idle_seconds and gpunode_idle_api_errors_total."""
        return _IdleCollector(self)

    def view(self) -> tuple[tuple[str, str, bool, float], ...]:
        """(namespace, pod, flagged, seconds below the threshold) per followed pod, as of the last round."""
        return self._view


class _IdleCollector(Collector):
    def __init__(self, watch: IdleWatch) -> None:
        self._watch = watch

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        flagged = GaugeMetricFamily(
            "gpunode_pod_gpu_idle",
            "1 while the pod's GPUs have stayed below gpunode.idle.utilisationBelow for gpunode.idle.for "
            "(the pod carries gpunode.io/gpu-idle-since), else 0; one series per pod holding GPUs.",
            labels=["namespace", "pod"],
        )
        seconds = GaugeMetricFamily(
            "gpunode_pod_gpu_idle_seconds",
            "How long the pod's GPUs have been below gpunode.idle.utilisationBelow, in seconds (0 while busy).",
            labels=["namespace", "pod"],
        )
        for namespace, pod, is_flagged, idle_s in self._watch.view():
            flagged.add_metric([namespace, pod], 1.0 if is_flagged else 0.0)
            seconds.add_metric([namespace, pod], round(idle_s, 3))
        errors = CounterMetricFamily(
            "gpunode_idle_api_errors",
            "Failed API server calls of the idle-GPU watch (each is tried again at the next interval).",
        )
        errors.add_metric([], self._watch.api_errors)
        yield flagged
        yield seconds
        yield errors
