"""GetPreferredAllocation's policy: which of the device IDs the kubelet offers a container should get.

The kubelet offers the free devices of one resource and asks for `size` of them,
some of which it may require (must_include). The choice is made by
gpunode.placement, the code the scheduler extender and the simulator use, over
the same picture of the GPUs the extender reads from this node's annotation:
placement_node() runs the node's one per-GPU accounting
(gpunode.node.allocation.accounting) with every device the kubelet did not offer
counted as held, and converts it as the extender does (gpunode.placement.published).

Per kind of device:
- whole GPUs: the set with the best interconnect (NVLink, then NUMA locality);
- time-sliced replicas: spread over GPUs, or packed, as sharing.replicaPlacement says;
- memory units: all on one GPU, the one placement's policy picks for that much memory;
- MIG devices: the required ones, then the lowest IDs.
Every request is checked first, whatever the kind (check_request): a size of at
least 1 and at most the healthy devices offered, no ID twice in one list, no ID
that is not of the resource, and no more required IDs than the size.
Pure functions; no I/O. Errors are AllocationError, or placement's Unsatisfiable
(a ValueError) when placement cannot satisfy the request.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Collection, Mapping, Sequence

from gpunode import placement
from gpunode.contract.deviceids import parse_device_id
from gpunode.contract.nodestate import NodeGpuState
from gpunode.errors import AllocationError
from gpunode.node.allocation.accounting import gpu_records
from gpunode.node.inventory import AdvertisedDevice
from gpunode.node.state import Snapshot
from gpunode.placement.published import node_state


def placement_node(
    snapshot: Snapshot, *, resource: str, offered: Collection[str], name: str = "this-node"
) -> placement.NodeState:
    """Placement's view of this node: a device of `resource` is held unless it is among `offered`.

    The kubelet offers every free device of the resource, so what it leaves out is held
    (or unhealthy, which the GPU's health says anyway). Devices of other resources count as free.
    """
    free = set(offered)
    holders = {d.id: "" for d in snapshot.inventory.by_resource(resource) if d.id not in free}
    state = NodeGpuState(node=name, updated=0.0, generation=0, gpus=gpu_records(snapshot, holders))
    return node_state(state, cpu_milli_free=0, memory_free_bytes=0)


def offered_devices(snapshot: Snapshot, resource: str, offered: Sequence[str]) -> list[AdvertisedDevice]:
    """The healthy devices among the offered IDs, in order; an ID that is not of `resource` is refused."""
    devices: list[AdvertisedDevice] = []
    for dev_id in dict.fromkeys(offered):
        st = snapshot.status(dev_id)
        if st is None or st.device.resource != resource:
            raise AllocationError(
                f"{resource}: unknown device ID {dev_id[:80]!r} in the preferred-allocation request"
            )
        if st.healthy:
            devices.append(st.device)
    return devices


def _whole_gpus(
    snapshot: Snapshot,
    resource: str,
    offered: Sequence[str],
    devices: Sequence[AdvertisedDevice],
    must: Sequence[str],
    size: int,
) -> list[str]:
    """The set of GPUs with the best interconnect (NVLink, then NUMA locality)."""
    node = placement_node(snapshot, resource=resource, offered=offered)
    ids = [d.id for d in devices]
    return list(placement.preferred_whole_gpus(node, count=size, available=ids, must_include=must))


def _replicas(devices: Sequence[AdvertisedDevice], must: Sequence[str], size: int, mode: str) -> list[str]:
    """Replicas spread over the GPUs (or MIG devices) with the most free ones, or packed onto the fullest."""
    free_by_unit: dict[str, list[str]] = defaultdict(list)  # GPU or MIG UUID -> its offered replicas
    for d in devices:
        free_by_unit[d.target_uuid].append(d.id)
    return list(placement.preferred_replicas(free_by_unit, count=size, must_include=must, mode=mode))


def _gpu_for_units(
    snapshot: Snapshot,
    resource: str,
    offered: Sequence[str],
    by_gpu: Mapping[str, Sequence[str]],
    must_gpus: set[str],
    size: int,
    unit_bytes: int,
) -> str:
    """The one GPU `size` memory units come from: the required units' GPU, else placement's choice."""
    if len(must_gpus) > 1:
        raise AllocationError(f"{resource}: the devices that must be included span GPUs {sorted(must_gpus)}")
    candidates = sorted(must_gpus) or [g for g, ids in by_gpu.items() if len(ids) >= size]
    if not candidates:
        raise AllocationError(f"{resource}: no single GPU has {size} free units")
    node = placement_node(snapshot, resource=resource, offered=offered)
    request = placement.Request(gpu_memory_bytes=size * unit_bytes)
    gpu = placement.preferred_fraction_gpu(node, request, candidates=candidates, policy="gpunode")
    if gpu is None:
        raise AllocationError(f"{resource}: no single GPU has {size} free units")
    return gpu


def _memory_units(
    snapshot: Snapshot,
    resource: str,
    offered: Sequence[str],
    devices: Sequence[AdvertisedDevice],
    must: Sequence[str],
    size: int,
) -> list[str]:
    """All units on one GPU: the required ones, then the lowest-numbered free units of that GPU."""
    by_gpu: dict[str, list[str]] = defaultdict(list)
    for d in devices:
        by_gpu[d.gpu_uuid].append(d.id)
    gpu_of = {d.id: d.gpu_uuid for d in devices}
    must_gpus = {gpu_of[m] for m in must if m in gpu_of}
    unit_bytes = devices[0].memory_cap_bytes or 1
    gpu = _gpu_for_units(snapshot, resource, offered, by_gpu, must_gpus, size, unit_bytes)
    chosen = [m for m in must if m in by_gpu[gpu]]
    in_order = sorted(by_gpu[gpu], key=lambda i: parse_device_id(i).memory_unit or 0)
    chosen += [i for i in in_order if i not in chosen][: size - len(chosen)]
    return chosen


def _mig_devices(devices: Sequence[AdvertisedDevice], must: Sequence[str], size: int) -> list[str]:
    """One profile per resource, so any instance serves: the required ones, then the lowest IDs."""
    chosen = list(must)
    rest = sorted((d for d in devices if d.id not in chosen), key=lambda d: (d.gpu_uuid, d.id))
    chosen += [d.id for d in rest][: size - len(chosen)]
    return chosen


def check_request(resource: str, available: Sequence[str], must_include: Sequence[str], size: int) -> None:
    """Refuse what no kubelet sends: a size below 1, an ID twice in a list, more required IDs than the size."""
    if size <= 0:
        raise AllocationError(f"{resource}: allocation_size must be at least 1, got {size}")
    for name, ids in (("available_deviceIDs", available), ("must_include_deviceIDs", must_include)):
        seen: set[str] = set()
        for dev_id in ids:
            if dev_id in seen:
                raise AllocationError(f"{resource}: {name} lists {dev_id[:80]!r} more than once")
            seen.add(dev_id)
    if len(must_include) > size:
        raise AllocationError(
            f"{resource}: must_include_deviceIDs names {len(must_include)} devices but allocation_size is {size}"
        )


def preferred_allocation(
    snapshot: Snapshot,
    resource: str,
    available: Sequence[str],
    must_include: Sequence[str],
    size: int,
    *,
    replica_placement: str = "spread",
    within: Collection[str] | None = None,
) -> list[str]:
    """Choose `size` device IDs out of `available`, keeping every one of `must_include`.

    replica_placement: spread or pack, for time-sliced replicas (sharing.replicaPlacement).
    within: GPU (or MIG) UUIDs the choice is confined to, the cluster's assignment: only devices on
    them are chosen (AllocationError when that cannot give `size`), while the view of the node
    still counts every offered device as free.
    """
    check_request(resource, available, must_include, size)
    offered = [*must_include, *available]
    devices = offered_devices(snapshot, resource, offered)
    where = ""
    if within is not None:
        allowed = set(within)
        devices = [d for d in devices if d.gpu_uuid in allowed or d.target_uuid in allowed]
        kept = {d.id for d in devices}
        if outside := [m for m in must_include if m not in kept]:
            raise AllocationError(
                f"{resource}: required device {outside[0][:80]!r} is not on the assigned GPUs"
            )
        where = " on the assigned GPUs"
    if size > len(devices):
        raise AllocationError(
            f"{resource}: {size} devices asked for, only {len(devices)} healthy ones offered{where}"
        )
    must = list(must_include)
    kinds = {d.kind for d in devices}
    if kinds <= {"gpu"}:
        return _whole_gpus(snapshot, resource, offered, devices, must, size)
    if kinds == {"replica"}:
        return _replicas(devices, must, size, replica_placement)
    if kinds == {"memory"}:
        return _memory_units(snapshot, resource, offered, devices, must, size)
    return _mig_devices(devices, must, size)
