"""The data placement decides on: GPU and node state, a request, and the placement chosen.

Everything here is frozen plain data in base units (bytes, milli-GPU where 1000
is one whole GPU, milli-CPU). Validation happens at construction, so a request
or a state that placement receives is always well formed; a bad one raises
InvalidRequest or InvalidState (GpunodeError subclasses that are also
ValueError). This module holds no policy and performs no I/O.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Literal

from gpunode.contract.names import MILLI_PER_GPU, SHARING_MODES, Sharing
from gpunode.errors import InvalidRequest, InvalidState

EMPTY_MAPPING: Mapping[str, int] = MappingProxyType({})
EMPTY_LABELS: Mapping[str, str] = MappingProxyType({})


def _freeze_mapping(value: Mapping[str, int] | None) -> Mapping[str, int]:
    return MappingProxyType(dict(value)) if value else EMPTY_MAPPING


@dataclass(frozen=True)
class GpuState:
    """One physical GPU as placement sees it: what is free on it now, and how it is connected.

    milli_free is the free compute share (0..1000); memory_free_bytes the free
    memory. A GPU whose memory_total_bytes is 0 has no known memory size: it
    takes compute-share and whole-GPU requests, but no request by memory.
    mig_free maps a MIG profile to the number of free instances of it.
    serves_whole says whether a whole-GPU request may take a `fractional` GPU
    when it is fully free (its node also offers it whole); `whole` GPUs always
    serve whole requests and MIG and time-sliced ones never, whatever it says.
    True by default: a modelled GPU (the trace simulator's) serves both.
    """

    uuid: str
    index: int
    model: str
    milli_free: int
    memory_total_bytes: int
    memory_free_bytes: int
    numa_node: int | None
    nvlink_peers: frozenset[str] = frozenset()
    healthy: bool = True
    mig_free: Mapping[str, int] = field(default_factory=lambda: EMPTY_MAPPING)
    sharing: Sharing = Sharing.FRACTIONAL
    serves_whole: bool = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "mig_free", _freeze_mapping(self.mig_free))
        object.__setattr__(self, "nvlink_peers", frozenset(self.nvlink_peers))
        if not self.uuid:
            raise InvalidState("a GPU needs a UUID")
        if not 0 <= self.milli_free <= MILLI_PER_GPU:
            raise InvalidState(
                f"GPU {self.uuid}: milli_free must be within 0..{MILLI_PER_GPU}, got {self.milli_free}"
            )
        if self.memory_total_bytes < 0 or not 0 <= self.memory_free_bytes <= max(self.memory_total_bytes, 0):
            raise InvalidState(
                f"GPU {self.uuid}: memory_free_bytes {self.memory_free_bytes} must be within "
                f"0..memory_total_bytes ({self.memory_total_bytes})"
            )
        if self.sharing not in SHARING_MODES:
            raise InvalidState(
                f"GPU {self.uuid}: sharing must be one of {', '.join(SHARING_MODES)}, got {self.sharing!r}"
            )
        object.__setattr__(self, "sharing", Sharing(self.sharing))
        if any(n < 0 for n in self.mig_free.values()):
            raise InvalidState(f"GPU {self.uuid}: free MIG instance counts cannot be negative")
        if self.uuid in self.nvlink_peers:
            raise InvalidState(f"GPU {self.uuid} lists itself as an NVLink peer")

    @property
    def fully_free(self) -> bool:
        """Nothing of the GPU is handed out (all compute and, where known, all memory free)."""
        return self.milli_free == MILLI_PER_GPU and self.memory_free_bytes == self.memory_total_bytes

    @property
    def free_share_milli(self) -> int:
        """The free share in milli-GPU: the scarcer of free compute and free memory."""
        if self.memory_total_bytes <= 0:
            return self.milli_free
        by_memory = self.memory_free_bytes * MILLI_PER_GPU // self.memory_total_bytes
        return min(self.milli_free, by_memory)


@dataclass(frozen=True)
class NodeState:
    """A node: its GPUs (ordered by index), free CPU (milli-cores), free memory and labels."""

    name: str
    gpus: tuple[GpuState, ...]
    cpu_milli_free: int
    memory_free_bytes: int
    labels: Mapping[str, str] = field(default_factory=lambda: EMPTY_LABELS)

    def __post_init__(self) -> None:
        object.__setattr__(self, "gpus", tuple(sorted(self.gpus, key=lambda g: (g.index, g.uuid))))
        object.__setattr__(
            self, "labels", MappingProxyType(dict(self.labels)) if self.labels else EMPTY_LABELS
        )
        if not self.name:
            raise InvalidState("a node needs a name")
        if self.cpu_milli_free < 0 or self.memory_free_bytes < 0:
            raise InvalidState(f"node {self.name}: free CPU and memory cannot be negative")
        uuids = [g.uuid for g in self.gpus]
        if len(set(uuids)) != len(uuids):
            raise InvalidState(f"node {self.name}: duplicate GPU UUIDs")

    def gpu(self, uuid: str) -> GpuState:
        """The GPU with this UUID; InvalidState when the node has none."""
        for g in self.gpus:
            if g.uuid == uuid:
                return g
        raise InvalidState(f"node {self.name} has no GPU {uuid}")


@dataclass(frozen=True)
class Request:
    """What one pod asks for. At most one GPU kind: whole GPUs, a fraction of one GPU, or a MIG profile.

    A fraction is asked by compute share (gpu_milli, 1..999) and/or by memory
    (gpu_memory_bytes); both, when given, must fit on the same GPU. gpu_models,
    when set, restricts the GPU models the pod accepts.
    """

    gpus: int = 0
    gpu_milli: int = 0
    gpu_memory_bytes: int = 0
    mig_profile: str | None = None
    gpu_models: frozenset[str] | None = None
    cpu_milli: int = 0
    memory_bytes: int = 0

    def __post_init__(self) -> None:
        if self.gpu_models is not None:
            object.__setattr__(self, "gpu_models", frozenset(self.gpu_models))
        for name in ("gpus", "gpu_milli", "gpu_memory_bytes", "cpu_milli", "memory_bytes"):
            if getattr(self, name) < 0:
                raise InvalidRequest(f"{name} cannot be negative, got {getattr(self, name)}")
        if self.gpu_milli >= MILLI_PER_GPU:
            raise InvalidRequest(
                f"gpu_milli asks for a fraction of one GPU (1..{MILLI_PER_GPU - 1}); "
                f"ask for whole GPUs with gpus=N instead of {self.gpu_milli}"
            )
        kinds = [self.gpus > 0, self.gpu_milli > 0 or self.gpu_memory_bytes > 0, self.mig_profile is not None]
        if sum(kinds) > 1:
            raise InvalidRequest(
                "a request can ask for whole GPUs, a fraction, or a MIG profile, not several"
            )
        if self.mig_profile is not None and not self.mig_profile:
            raise InvalidRequest("mig_profile cannot be empty")
        if self.gpu_models is not None and not self.gpu_models:
            raise InvalidRequest("gpu_models, when given, must name at least one model")

    @property
    def kind(self) -> Literal["cpu", "whole", "fraction", "mig"]:
        """What the request asks for: "whole" GPUs, a "fraction" of one, a "mig" instance, or only "cpu"."""
        if self.gpus:
            return "whole"
        if self.gpu_milli or self.gpu_memory_bytes:
            return "fraction"
        if self.mig_profile is not None:
            return "mig"
        return "cpu"

    def share_on(self, gpu: GpuState) -> int:
        """The share (milli-GPU) this fractional request takes of `gpu`: the larger of compute and memory."""
        share = self.gpu_milli
        if self.gpu_memory_bytes and gpu.memory_total_bytes > 0:
            by_memory = -(-self.gpu_memory_bytes * MILLI_PER_GPU // gpu.memory_total_bytes)
            share = max(share, by_memory)
        return share


@dataclass(frozen=True)
class Placement:
    """The decision: which node, which GPUs (UUIDs, or MIG parent UUIDs), and the policy's score."""

    node: str
    gpu_uuids: tuple[str, ...]
    score: float
