"""NodePrepareResources and NodeUnprepareResources, one claim at a time: region, CDI spec, record.

Preparing a claim: its record is looked up first (a prepared claim is answered from it, creating
nothing); otherwise the ResourceClaim is read from the API server (its UID must be the one the
kubelet sent), planned (gpunode.node.dra.claims), recorded as `preparing`, its memory-cap region made
fresh (a cap per capped GPU: the memory its results consume; the whole GPU is not capped), its CDI
spec written, and the record marked `prepared` with the CDI device IDs. Unpreparing removes the
spec, the region and the record. Either is serialized per claim UID; a failure is a ClaimRefused
for that claim alone, and what a failed prepare made is removed before it answers.

Regions of claims live in their own root, `<stateDir>/dra/memcap`, apart from the device plugin's,
whose collector removes regions of containers the kubelet's pod-resources API does not list. A
prepared claim whose ResourceClaim is gone from the API server (a kubelet that lost its own record
would never unprepare it) is removed by collect_orphans, which the plugin runs every ORPHAN_CHECK_S.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, TypeVar

from gpunode.config.agent import Config
from gpunode.contract import dra as names
from gpunode.errors import ClaimRefused, DeviceNotFound, GpunodeError, KubeError, KubeNotFound, MemcapError
from gpunode.node import memcap
from gpunode.node.allocation.allocator import MIG_MINORS_FILE
from gpunode.node.allocation.allocator import _mig_minors as mig_minors
from gpunode.node.devices.base import Gpu, MigPartitioner
from gpunode.node.devices.simnode.mig import MIG_TABLES, TOTAL_COMPUTE_SLICES
from gpunode.node.dra import cdi
from gpunode.node.dra.checkpoint import PREPARED, PREPARING, ClaimCheckpoint, ClaimRecord
from gpunode.node.dra.claims import ClaimPlan, ClaimRef, check_uid, containers_with_other_caps, plan_claim
from gpunode.node.dra.devices import DeviceDirectory
from gpunode.node.dra.slices import mig_instance_slices, mig_table
from gpunode.node.memcap.checkpoint import remove_stale_temps
from gpunode.node.memcap.compute import DEFAULT_MODE, read_compute, set_compute_share, share_from_memory

log = logging.getLogger(__name__)

ClaimFetcher = Callable[[ClaimRef], Awaitable[dict[str, Any]]]
PodFetcher = Callable[[str, str], Awaitable[dict[str, Any]]]
MAX_PODS_CHECKED = 16  # pods of one claim whose containers are checked for a second cap
T = TypeVar("T")


@dataclass(frozen=True)
class Prepared:
    """What NodePrepareResources answers for one claim: per allocation result, its CDI device ID."""

    plan: ClaimPlan
    cdi_ids: tuple[str, ...]


async def _to_completion(fn: Callable[..., T], *args: Any) -> T:
    """fn(*args) in a thread, and if the caller is cancelled (the kubelet's call ended), still held until
    the thread is done: the claim's lock must not let a retry start while its files are being made."""
    work = asyncio.ensure_future(asyncio.to_thread(fn, *args))
    try:
        return await asyncio.shield(work)
    except asyncio.CancelledError:
        with contextlib.suppress(Exception):
            await work
        raise


@dataclass(frozen=True)
class MigOwners:
    """The MIG instances gpunode created for claims, from their records: MIG UUID -> claim UID, and
    (GPU UUID, profile, first memory slice) -> claim UID of the creations whose UUID is not recorded
    yet (an agent stopped between creating and recording)."""

    by_uuid: dict[str, str] = field(default_factory=dict)
    by_placement: dict[tuple[str, str, int], str] = field(default_factory=dict)

    def created(self) -> set[str]:
        """Every MIG UUID gpunode created."""
        return set(self.by_uuid)


def mig_owners(records: Sequence[ClaimRecord]) -> MigOwners:
    """Who created which MIG instance, from the claims' records."""
    owners = MigOwners()
    for record in records:
        for d in record.plan.devices:
            if not d.mig_created:
                continue
            if d.mig_uuid is not None:
                owners.by_uuid[d.mig_uuid] = record.plan.claim.uid
            elif d.mig_profile is not None and d.mig_start is not None:
                owners.by_placement[(d.gpu_uuid, d.mig_profile, d.mig_start)] = record.plan.claim.uid
    return owners


def created_migs(state_dir: Path) -> set[str]:
    """The MIG UUIDs gpunode created for claims (read from their records under state_dir): the slices
    publish placements around these, not around them as around an instance of the operator's."""
    checkpoint = ClaimCheckpoint(state_dir / "dra" / "claims")
    records = []
    for uid in checkpoint.uids():
        with contextlib.suppress(ValueError, OSError):
            if (record := checkpoint.load(uid)) is not None:
                records.append(record)
    return mig_owners(records).created()


def mig_device(
    gpu: Gpu,
    profile: str,
    start: int,
    *,
    dynamic: bool = False,
    owners: MigOwners | None = None,
    claim: str = "",
) -> str | None:
    """The UUID of the GPU's MIG device of `profile` whose memory slices start at `start`; None when
    `dynamic` and the placement is free (prepare creates it). ValueError naming what is in the way: an
    instance of another profile on its slices (one gpunode did not create, or one it created for
    another claim), one at the placement that another claim holds, or (static) no instance there."""
    if not gpu.mig_enabled:
        raise ValueError(f"GPU {gpu.uuid} is not in MIG mode")
    table = mig_table(gpu)
    if table is None:
        raise ValueError(f"GPU {gpu.uuid} ({gpu.model}) has no known MIG profile table")
    spec = MIG_TABLES[table].get(profile)
    if spec is None or start not in spec.starts:
        raise ValueError(f"{profile} at memory slice {start} is not a MIG placement of GPU {gpu.uuid}")
    owners = owners or MigOwners()
    cells = set(range(start, start + spec.memory_slices))
    compute = spec.compute_slices
    have = []
    for uuid, taken in sorted(mig_instance_slices(gpu, table).items(), key=lambda kv: kv[1].start):
        mig = gpu.mig_by_uuid(uuid)
        if mig is None:
            continue
        holder = owners.by_uuid.get(uuid) or owners.by_placement.get((gpu.uuid, mig.profile, taken.start))
        if holder == claim:
            holder = None  # this claim's own (an earlier attempt at it)
        if mig.profile == profile and taken.start == start:
            if holder is not None:
                raise ValueError(f"MIG device {uuid} at this placement was created for claim {holder}")
            return uuid
        if cells & set(taken):
            whose = f"created for claim {holder}" if holder else "which gpunode did not create"
            raise ValueError(
                f"MIG device {uuid} ({mig.profile} at memory slice {taken.start}), {whose}, takes its memory slices"
            )
        compute += mig.slices
        have.append(f"{mig.profile} at {taken.start}")
    if not dynamic:
        raise ValueError(
            f"GPU {gpu.uuid} has no such instance (its instances: {', '.join(have) or 'none'}) and "
            "gpunode.dra.mig.partitioning is static"
        )
    if compute > TOTAL_COMPUTE_SLICES:
        raise ValueError(
            f"GPU {gpu.uuid} has {TOTAL_COMPUTE_SLICES - compute + spec.compute_slices} compute slice(s) free, "
            f"{profile} needs {spec.compute_slices} (its instances: {', '.join(have)})"
        )
    return None


def compute_share(plan: ClaimPlan, caps: Sequence[memcap.DeviceCap]) -> int:
    """The claim's compute share in milli-GPU, written into its region: what it asked of its shared
    devices (consumedCapacity.compute, reserved by the scheduler), else proportional to its memory share.
    A region has one share for all its GPUs: the largest of theirs."""
    asked = [d.compute_milli for d in plan.devices if d.compute_milli is not None]
    if asked:
        return max(asked)
    return max(share_from_memory(c.limit_bytes, c.device_total_bytes) for c in caps)


def _creates(record: ClaimRecord) -> bool:
    """Whether gpunode created (or set out to create) a MIG instance for the claim."""
    return any(d.mig_created for d in record.plan.devices)


def region_key(uid: str) -> str:
    """The memory-cap region of a claim."""
    return names.claim_region_key(check_uid(uid))


@dataclass
class Preparer:
    """Prepares and unprepares claims for one driver on this node."""

    config: Config
    fetch_claim: ClaimFetcher
    directory: DeviceDirectory
    gpus: Callable[[], Sequence[Gpu]]
    preload_lib: Path | None = None  # the host copy of the interposer; None: the package's own
    with_device_nodes: bool = True  # False on the simulated backend, whose /dev/nvidia* do not exist
    mig_minors_file: Path = MIG_MINORS_FILE  # the driver's MIG capability minors
    fetch_pod: PodFetcher | None = None  # reads a pod (namespace, name): checks a container's caps
    mig: MigPartitioner | None = None  # creates and destroys MIG instances (dynamic partitioning)
    on_mig_change: Callable[[], None] | None = None  # told after a create or destroy (republish the slices)
    _locks: dict[str, tuple[asyncio.Lock, list[int]]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        root = self.config.state_dir / "dra"
        self.regions_root = root / "memcap"
        self.checkpoint = ClaimCheckpoint(root / "claims")
        self.driver = self.config.dra.driver_name
        self.cdi_dir = self.config.dra.cdi_dir

    @property
    def dynamic(self) -> bool:
        """Whether MIG instances are created at prepare (gpunode.dra.mig.partitioning, and a backend that can)."""
        return self.config.dra.mig_dynamic and self.mig is not None

    def records(self) -> list[ClaimRecord]:
        """Every claim's record that reads back."""
        out = []
        for uid in self.checkpoint.uids():
            with contextlib.suppress(ValueError):
                if (record := self.checkpoint.load(uid)) is not None:
                    out.append(record)
        return out

    # -- start-up ----------------------------------------------------------------------------

    def recover(self) -> tuple[int, int]:
        """At start: roll back claims the last agent left mid-prepare (their region, spec and record go;
        the kubelet prepares them again) and keep prepared ones. A claim left mid-prepare with MIG
        instances gpunode created for it keeps its record and its instances (only its spec and region
        go): the kubelet's retry adopts them, and collect_orphans destroys them if the claim is gone.
        Returns (rolled back, kept)."""
        memcap.secure_root(self.regions_root)
        # What a killed agent was staging: a region's directory, a record's or a region file's
        # temporary file. Nothing is being prepared yet, so every one is stale.
        staged = memcap.remove_staging(self.regions_root, older_than_s=0)
        staged += len(remove_stale_temps([self.checkpoint.root], region_roots=[self.regions_root]))
        if staged:
            log.info("DRA: removed %d file(s) a stopped agent left half-written", staged)
        rolled = kept = 0
        for uid in self.checkpoint.uids():
            try:
                record = self.checkpoint.load(uid)
            except ValueError as exc:
                log.warning("DRA: %s; removing the claim's spec and region", exc)
                record = None
            if record is not None and record.state == PREPARED:
                kept += 1
                continue
            try:
                if record is not None and _creates(record):
                    self._remove_files(uid)
                else:
                    self._remove(uid)
            except (OSError, GpunodeError) as exc:  # kept for the next start; the kubelet's retry fails alone
                log.error("DRA: cannot roll back claim %s left mid-prepare: %s", uid, exc)
                continue
            rolled += 1
        if rolled:
            log.info("DRA: rolled back %d claim(s) left mid-prepare; the kubelet prepares them again", rolled)
        return rolled, kept

    # -- prepare -----------------------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def _serial(self, uid: str) -> AsyncIterator[None]:
        """One prepare or unprepare of a claim at a time (the lock goes when nobody holds or awaits it)."""
        entry = self._locks.setdefault(uid, (asyncio.Lock(), [0]))
        entry[1][0] += 1
        try:
            async with entry[0]:
                yield
        finally:
            entry[1][0] -= 1
            if entry[1][0] == 0:
                self._locks.pop(uid, None)

    async def prepare(self, ref: ClaimRef) -> Prepared:
        """Prepare one claim (idempotent); ClaimRefused says why it cannot be."""
        check_uid(ref.uid)
        async with self._serial(ref.uid):
            return await self._prepare(ref)

    async def _prepare(self, ref: ClaimRef) -> Prepared:
        try:
            record = await asyncio.to_thread(self.checkpoint.load, ref.uid)
        except ValueError as exc:
            log.warning("DRA: %s; preparing the claim afresh", exc)
            record = None
        if record is not None and record.state == PREPARED and await asyncio.to_thread(self._intact, record):
            return Prepared(record.plan, record.cdi_ids)
        if record is not None:  # mid-prepare, or damaged since: start again (keeping its MIG instances)
            await asyncio.to_thread(self._remove_files, ref.uid)
        plan = await self._plan(ref)
        return await _to_completion(self._make, plan, record)

    async def _plan(self, ref: ClaimRef) -> ClaimPlan:
        try:
            claim = await self.fetch_claim(ref)
        except KubeNotFound:
            raise ClaimRefused(
                f"claim {ref}: the ResourceClaim does not exist", hint="it was deleted before the pod started"
            ) from None
        except KubeError as exc:
            raise ClaimRefused(f"claim {ref}: cannot read the ResourceClaim: {exc}", hint=exc.hint) from None
        known = {(d.pool, d.name): d for d in self.directory.all()}
        # Look up every device the allocation names first (reading the slices again on a miss).
        results = ((claim.get("status") or {}).get("allocation") or {}).get("devices", {}).get("results")
        for r in results if isinstance(results, list) else ():
            if isinstance(r, dict) and r.get("driver") == self.driver:
                pool, name = r.get("pool"), r.get("device")
                if isinstance(pool, str) and isinstance(name, str) and (pool, name) not in known:
                    try:
                        info = await self.directory.lookup(pool, name)
                    except KubeError as exc:
                        raise ClaimRefused(
                            f"claim {ref}: cannot read this node's ResourceSlices: {exc}"
                        ) from None
                    if info is not None:
                        known[(pool, name)] = info
        gpus = {g.uuid: g for g in self.gpus()}
        owners = await asyncio.to_thread(lambda: mig_owners(self.records()))
        dynamic = self.dynamic

        def memory(uuid: str) -> int | None:
            gpu = gpus.get(uuid)
            if gpu is None or not self.config.dra.serves(gpu.index, gpu.uuid):
                return None
            return gpu.memory_total_bytes

        plan = plan_claim(
            ref,
            claim,
            driver=self.driver,
            device=lambda pool, name: known.get((pool, name)),
            gpu_memory=memory,
            mig_device=lambda uuid, profile, start: mig_device(
                gpus[uuid], profile, start, dynamic=dynamic, owners=owners, claim=ref.uid
            ),
        )
        if any(d.memory_bytes is not None for d in plan.devices) and self.fetch_pod is not None:
            await self._one_cap_per_container(ref, claim)
        return plan

    async def _one_cap_per_container(self, ref: ClaimRef, claim: dict[str, Any]) -> None:
        """Refuse a capped claim that a container uses with another capped claim, or with the device
        plugin's memory units: each brings its region to the same path in the container, so only one cap
        would apply, silently. The pods are those the claim is reserved for; one that cannot be read is
        not checked (logged)."""
        reserved = ((claim.get("status") or {}).get("reservedFor")) or []
        pods = [r for r in reserved if isinstance(r, dict) and r.get("resource") == "pods"][:MAX_PODS_CHECKED]
        assert self.fetch_pod is not None
        for entry in pods:
            name = str(entry.get("name"))
            try:
                pod = await self.fetch_pod(ref.namespace, name)
            except KubeError as exc:
                log.warning(
                    "DRA: claim %s: cannot read pod %s/%s to check its caps: %s",
                    ref,
                    ref.namespace,
                    name,
                    exc,
                )
                continue
            for container, others, units in containers_with_other_caps(
                pod, ref.name, self.config.fractional.resource_name
            ):
                where = f"claim {ref}: container {container} of pod {ref.namespace}/{name}"
                hint = "ask for both shares in one claim (one request each), or give each its own container"
                if units:
                    raise ClaimRefused(
                        f"{where} also asks {self.config.fractional.resource_name} of the device plugin; "
                        "a container gets one memory cap",
                        hint=hint,
                    )
                for other in others:
                    if await self._capped(ClaimRef(ref.namespace, "", other)):
                        raise ClaimRefused(
                            f"{where} also uses claim {ref.namespace}/{other}, a share of a GPU too; "
                            "a container gets one memory cap",
                            hint=hint,
                        )

    async def _capped(self, ref: ClaimRef) -> bool:
        """Whether the claim is allocated a shared device of this driver (read from the API server)."""
        try:
            other = await self.fetch_claim(ref)
        except KubeError:
            return False
        results = ((other.get("status") or {}).get("allocation") or {}).get("devices", {}).get("results")
        for r in results if isinstance(results, list) else ():
            if isinstance(r, dict) and r.get("driver") == self.driver:
                pool, device = r.get("pool"), r.get("device")
                if isinstance(pool, str) and isinstance(device, str):
                    try:
                        info = await self.directory.lookup(pool, device)
                    except KubeError:
                        info = None
                    if info is not None and info.sharing == names.SHARING_SHARED:
                        return True
        return False

    def _caps(self, plan: ClaimPlan) -> tuple[memcap.DeviceCap, ...]:
        """One cap per GPU of the claim (shares of one GPU add up); none when nothing is capped. A MIG
        device is never capped: its memory is its own, in hardware."""
        if all(d.memory_bytes is None for d in plan.devices):
            return ()
        totals = {g.uuid: g.memory_total_bytes for g in self.gpus()}
        limits: dict[str, int] = {}
        for d in plan.devices:
            if d.mig_uuid is not None:
                continue
            total = totals[d.gpu_uuid]
            used = limits.get(d.gpu_uuid, 0) + (d.memory_bytes if d.memory_bytes is not None else total)
            limits[d.gpu_uuid] = min(total, used)
        return tuple(memcap.DeviceCap(uuid, limit, totals[uuid]) for uuid, limit in limits.items())

    def _make(self, plan: ClaimPlan, before: ClaimRecord | None = None) -> Prepared:
        """Record, create the MIG instances to create, make the region and the spec, record as prepared;
        on failure remove what was made. `before`: the claim's record from an earlier attempt, whose MIG
        instances the plan adopts (those it does not are destroyed)."""
        uid = plan.claim.uid
        caps = self._caps(plan)
        key = region_key(uid) if caps else None
        ids = tuple(cdi.device_id(self.driver, uid, n) for n in range(len(plan.devices)))
        try:
            plan = self._adopt(plan, before)
            self.checkpoint.write(ClaimRecord(PREPARING, plan, key))  # the intent, before any instance
            if before is not None:
                self._destroy_unadopted(before, plan)
            plan = self._create_migs(plan, key)
            cap_spec = None
            if key is not None:
                region = memcap.replace_region(self.regions_root, key, devices=caps, fail_open=plan.fail_open)
                set_compute_share(region, compute_share(plan, caps))
                cap_spec = memcap.container_spec(
                    region,
                    preload_lib=self.preload_lib,
                    visible_device=",".join(c.uuid for c in caps),
                    ld_so_preload=self.config.fractional.ld_so_preload,
                )
            gpus = {g.uuid: g for g in self.gpus()}
            spec = cdi.build_spec(
                driver=self.driver,
                uid=uid,
                gpu_minors=[gpus[d.gpu_uuid].minor for d in plan.devices],
                gpu_uuids=[d.mig_uuid or d.gpu_uuid for d in plan.devices],
                device_root=self.config.device_root,
                with_device_nodes=self.with_device_nodes,
                cap=cap_spec,
                extra_nodes=self._mig_nodes(plan, gpus) if self.with_device_nodes else (),
            )
            cdi.write_spec(self.cdi_dir, self.driver, uid, spec)
            self.checkpoint.write(ClaimRecord(PREPARED, plan, key, ids))
        except (OSError, GpunodeError) as exc:
            try:
                self._remove(uid)
            except (OSError, GpunodeError) as cleanup:  # the record stays: the next prepare or start retries
                log.error(
                    "DRA: claim %s: cannot remove what the failed prepare made: %s", plan.claim, cleanup
                )
            what = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
            hint = (
                exc.hint
                if isinstance(exc, GpunodeError) and not isinstance(exc, MemcapError)
                else f"check that {self.config.state_dir} and {self.cdi_dir} are writable by the agent"
            )
            raise ClaimRefused(
                f"claim {plan.claim}: cannot prepare it on this node: {what}", hint=hint
            ) from None
        log.info(
            "DRA: prepared claim %s: %s",
            plan.claim,
            ", ".join(
                f"{d.pool}/{d.device}" + (f" ({d.memory_bytes} bytes)" if d.memory_bytes else "")
                for d in plan.devices
            ),
        )
        return Prepared(plan, ids)

    def _adopt(self, plan: ClaimPlan, before: ClaimRecord | None) -> ClaimPlan:
        """The plan with the MIG instances an earlier attempt at the claim created marked as created by
        gpunode (planning found them at their placements as any instance), so that unprepare destroys them."""
        if before is None:
            return plan
        mine = {
            (d.gpu_uuid, d.mig_profile, d.mig_start): d.mig_uuid for d in before.plan.devices if d.mig_created
        }
        devices = []
        for d in plan.devices:
            key = (d.gpu_uuid, d.mig_profile, d.mig_start)
            if d.mig_uuid is not None and key in mine and mine[key] in (None, d.mig_uuid):
                d = replace(d, mig_created=True)
                log.info(
                    "DRA: claim %s: adopting MIG device %s, created for it before", plan.claim, d.mig_uuid
                )
            devices.append(d)
        return replace(plan, devices=tuple(devices))

    def _destroy_unadopted(self, before: ClaimRecord, plan: ClaimPlan) -> None:
        """Destroy the instances an earlier attempt created that the plan does not use."""
        kept = {d.mig_uuid for d in plan.devices if d.mig_created}
        for d in before.plan.devices:
            if d.mig_created and d.mig_uuid is not None and d.mig_uuid not in kept:
                self._destroy(before.plan.claim, d.mig_uuid)

    def _create_migs(self, plan: ClaimPlan, key: str | None) -> ClaimPlan:
        """Create the plan's MIG instances still to create, recording each UUID as soon as it exists."""
        devices = list(plan.devices)
        for i, d in enumerate(devices):
            if not d.mig_created or d.mig_uuid is not None:
                continue
            assert d.mig_profile is not None and d.mig_start is not None
            if self.mig is None:
                raise ClaimRefused(f"claim {plan.claim}: this node's backend cannot create MIG instances")
            uuid = self.mig.create_mig(d.gpu_uuid, d.mig_profile, d.mig_start)
            devices[i] = replace(d, mig_uuid=uuid)
            plan = replace(plan, devices=tuple(devices))
            self.checkpoint.write(ClaimRecord(PREPARING, plan, key))
            log.info(
                "DRA: claim %s: created MIG device %s (%s at memory slice %d on GPU %s)",
                plan.claim,
                uuid,
                d.mig_profile,
                d.mig_start,
                d.gpu_uuid,
            )
            self._mig_changed()
        return plan

    def _destroy(self, claim: ClaimRef, uuid: str) -> None:
        """Destroy a MIG instance gpunode created for the claim (one already gone is no error)."""
        if self.mig is None:
            raise ClaimRefused(
                f"claim {claim}: MIG device {uuid} was created for it, but this node's backend cannot destroy it"
            )
        try:
            self.mig.destroy_mig(uuid)
        except DeviceNotFound:
            log.info("DRA: claim %s: MIG device %s created for it is gone already", claim, uuid)
            return
        log.info("DRA: claim %s: destroyed MIG device %s created for it", claim, uuid)
        self._mig_changed()

    def _mig_changed(self) -> None:
        if self.on_mig_change is not None:
            try:
                self.on_mig_change()
            except Exception:
                log.exception("DRA: telling the agent of a MIG change failed")

    def _mig_nodes(self, plan: ClaimPlan, gpus: dict[str, Gpu]) -> list[tuple[str, ...]]:
        """Per result, the capability device nodes of its MIG device (none for a GPU)."""
        if not any(d.mig_uuid for d in plan.devices):
            return []
        minors = mig_minors(self.mig_minors_file)
        out: list[tuple[str, ...]] = []
        for d in plan.devices:
            gpu = gpus[d.gpu_uuid]
            mig = gpu.mig_by_uuid(d.mig_uuid) if d.mig_uuid else None
            nodes = []
            if mig is not None:
                for cap in (
                    f"gpu{gpu.minor}/gi{mig.gi_id}/access",
                    f"gpu{gpu.minor}/gi{mig.gi_id}/ci{mig.ci_id}/access",
                ):
                    if cap not in minors:
                        raise OSError(0, f"no MIG capability minor for {cap} in {self.mig_minors_file}")
                    nodes.append(f"/dev/nvidia-caps/nvidia-cap{minors[cap]}")
            out.append(tuple(nodes))
        return out

    def _intact(self, record: ClaimRecord) -> bool:
        """Whether a prepared claim's spec and region are still there."""
        uid = record.plan.claim.uid
        if not cdi.spec_path(self.cdi_dir, self.driver, uid).is_file():
            return False
        migs = {d.mig_uuid for d in record.plan.devices if d.mig_uuid is not None}
        if migs and not migs <= {m.uuid for g in self.gpus() for m in g.mig_devices}:
            return False  # an instance of the claim is gone: prepare it again
        return record.region is None or (self.regions_root / record.region / memcap.LIMIT_FILE).is_file()

    # -- unprepare ---------------------------------------------------------------------------

    async def unprepare(self, ref: ClaimRef) -> None:
        """Remove the claim's spec, region and record (a claim not prepared here is no error)."""
        check_uid(ref.uid)
        async with self._serial(ref.uid):
            try:
                await _to_completion(self._remove, ref.uid)
            except (OSError, GpunodeError) as exc:
                raise ClaimRefused(f"claim {ref}: cannot unprepare it: {exc}") from None
        log.info("DRA: unprepared claim %s", ref)

    def _remove_files(self, uid: str) -> None:
        """The claim's spec and region (its record and MIG instances stay)."""
        cdi.remove_spec(self.cdi_dir, self.driver, uid)
        memcap.remove_region(self.regions_root, region_key(uid))
        memcap.remove_staging(self.regions_root, older_than_s=0, key=region_key(uid))  # the claim is locked

    def _remove(self, uid: str) -> None:
        """Spec first (no new container gets the claim), then the region, then the MIG instances gpunode
        created for the claim, then the record (kept while an instance cannot be destroyed)."""
        self._remove_files(uid)
        try:
            record = self.checkpoint.load(uid)
        except ValueError as exc:
            log.warning("DRA: %s; MIG instances it may name are left alone", exc)
            record = None
        if record is not None:
            for d in record.plan.devices:
                if not d.mig_created:
                    continue
                if d.mig_uuid is not None:
                    self._destroy(record.plan.claim, d.mig_uuid)
                else:
                    log.warning(
                        "DRA: claim %s: the agent stopped while creating %s at memory slice %s on GPU %s; "
                        "an instance there now is left alone (nvidia-smi mig -lgi shows it)",
                        record.plan.claim,
                        d.mig_profile,
                        d.mig_start,
                        d.gpu_uuid,
                    )
        self.checkpoint.remove(uid)

    async def collect_orphans(self) -> list[str]:
        """Unprepare the claims this node prepared whose ResourceClaim is gone from the API server (or was
        made again under a new UID): a kubelet that lost its own record of them never will. Any other
        answer (the API server unreachable, a refusal) keeps the claim. The UIDs removed."""
        removed = []
        records = await asyncio.to_thread(self.records)
        for record in [r for r in records if r.state == PREPARED or _creates(r)]:
            ref = record.plan.claim
            try:
                claim = await self.fetch_claim(ref)
            except KubeNotFound:
                claim = None
            except KubeError as exc:
                log.warning("DRA: cannot check whether claim %s still exists: %s", ref, exc)
                continue
            if claim is not None and (claim.get("metadata") or {}).get("uid") == ref.uid:
                continue
            async with self._serial(ref.uid):
                try:
                    await _to_completion(self._remove, ref.uid)
                except (OSError, GpunodeError) as exc:
                    log.error(
                        "DRA: claim %s is gone from the API server; removing what it had failed: %s", ref, exc
                    )
                    continue
            log.info(
                "DRA: claim %s is gone from the API server; its spec, region and MIG instances are removed",
                ref,
            )
            removed.append(ref.uid)
        return removed

    def keep_compute_shares(self) -> int:
        """Write back the compute share (and mode) of every prepared claim's region that holds another: a
        container can write its region's usage file, its share included. The regions written back."""
        written = 0
        for record in self.prepared():
            if record.region is None:
                continue
            caps = self._caps(record.plan)
            if not caps:
                continue
            want = compute_share(record.plan, caps)
            path = self.regions_root / record.region
            try:
                report = read_compute(path)
                if report.share_milli == want and report.mode == DEFAULT_MODE:
                    continue
                set_compute_share(path, want)
            except (GpunodeError, OSError) as exc:  # a damaged region: the metrics report it
                log.debug("DRA: claim %s: cannot check its compute share: %s", record.plan.claim, exc)
                continue
            log.warning(
                "DRA: claim %s: its region held compute share %s (mode %s), not %d: written back",
                record.plan.claim,
                report.share_milli,
                report.mode,
                want,
            )
            written += 1
        return written

    def prepared(self) -> list[ClaimRecord]:
        """The records of the claims prepared now (for the health stream and tests)."""
        out = []
        for uid in self.checkpoint.uids():
            try:
                record = self.checkpoint.load(uid)
            except ValueError:
                continue
            if record is not None and record.state == PREPARED:
                out.append(record)
        return out
