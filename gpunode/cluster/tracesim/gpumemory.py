"""GPU memory in the simulators: each model's memory, and the memory a simulated pod asks.

A simulated GPU carries its model's memory (MODEL_MEMORY_MIB) as well as its compute
share, and a fractional pod asks both; placement (gpunode.placement.fit and its numpy
form) fits both on the same GPU, so a pod whose compute fits but whose memory does not
is not placed there.

The table: the openb trace's models at their datasheet sizes (V100M16 / V100M32: V100
16 and 32 GB; P100: the 16 GB card; A10: 24 GB) and the simulated node profiles'
`memory_total` where one exists (gpunode/node/devices/simnode/profiles: T4 15360 MiB,
A100 81920 MiB, H100 81559 MiB). G2 and G3 are openb's undisclosed models: their
memory is unknown, so, as for any model missing from the table, DEFAULT_MEMORY_MIB
(16 GiB, a V100-class card, as queueing.energy assumes for them) is used and
`unknown_models` names them for a one-line notice. The cluster side does not import
the node package, so the profile figures are repeated here.

The memory a pod asks: its own figure when the trace gives one (`gpu_memory_mib`),
else the memory of its compute share of the smallest GPU model it may land on in
the cluster (rounded down). A pod asking that much fits wherever its compute fits,
so a trace without memory asks places exactly as a compute-only simulation does.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from types import MappingProxyType

from gpunode.contract.names import MIB, MILLI_PER_GPU
from gpunode.placement.fit import model_matches

MODEL_MEMORY_MIB: Mapping[str, int] = MappingProxyType(
    {
        "V100M16": 16384,  # V100 SXM2 16 GB
        "V100M32": 32768,  # V100 SXM2 32 GB
        "P100": 16384,  # P100 16 GB
        "T4": 15360,  # simnode profile t4.yaml
        "A10": 24576,  # A10 24 GB
        "A100": 81920,  # simnode profile a100-mig.yaml
        "H100": 81559,  # simnode profiles dgx-h100.yaml, h100-mig.yaml
    }
)
DEFAULT_MEMORY_MIB = 16384  # a model not in the table (openb's G2, G3): a V100-class 16 GiB card


def _entry(model: str) -> int | None:
    exact = MODEL_MEMORY_MIB.get(model)
    if exact is not None:
        return exact
    for name, mib in MODEL_MEMORY_MIB.items():
        if model and model_matches(model, frozenset({name})):
            return mib
    return None


def model_memory_bytes(model: str) -> int:
    """The memory of one GPU of the model: the table's entry (by whole name or one word), else the default."""
    mib = _entry(model)
    return (DEFAULT_MEMORY_MIB if mib is None else mib) * MIB


def unknown_models(models: Iterable[str]) -> tuple[str, ...]:
    """The models (sorted, without repeats, "" left out) whose memory is not in the table."""
    return tuple(sorted({m for m in models if m and _entry(m) is None}))


def unknown_notice(models: Iterable[str]) -> str | None:
    """One line naming the models given the default memory; None when every model is known."""
    unknown = unknown_models(models)
    if not unknown:
        return None
    return (
        f"GPU memory of model(s) {', '.join(unknown)} unknown: assumed {DEFAULT_MEMORY_MIB // 1024} GiB "
        "each (docs/scheduler.md, trace simulator)"
    )


class MemoryAsks:
    """The GPU memory each simulated pod asks, in a cluster of these GPU models (one per simulation)."""

    def __init__(self, cluster_models: Iterable[str]) -> None:
        self.models = tuple(sorted({m for m in cluster_models if m}))
        self._smallest: dict[frozenset[str] | None, int] = {}

    def smallest(self, gpu_models: frozenset[str] | None) -> int:
        """Bytes of the smallest GPU the constraint accepts in the cluster (0: it accepts none)."""
        known = self._smallest.get(gpu_models)
        if known is None:
            sizes = [model_memory_bytes(m) for m in self.models if model_matches(m, gpu_models)]
            known = self._smallest[gpu_models] = min(sizes, default=0)
        return known

    def ask(self, gpu_milli: int, gpu_models: frozenset[str] | None, explicit: int = 0) -> int:
        """The bytes a fraction of gpu_milli asks: `explicit` when given, else that share of the smallest GPU."""
        if explicit:
            return explicit
        return gpu_milli * self.smallest(gpu_models) // MILLI_PER_GPU
