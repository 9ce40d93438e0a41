"""MIG layouts of the simulated GPUs: the profiles each GPU model offers and where instances sit.

A MIG layout must fit the GPU the way NVIDIA documents it: every instance sits
at one of its profile's allowed placements (in units of the 8 memory slices),
no two instances share a memory slice, and together they use at most 7
compute slices. GPU instance IDs follow the placement (0 for the whole GPU,
1-2 for halves, 3-6 for quarters, 7-14 for eighths); each GPU instance holds
one compute instance with ID 0.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from gpunode.contract.names import MIB
from gpunode.errors import ProfileError

TOTAL_COMPUTE_SLICES = 7
TOTAL_MEMORY_SLICES = 8


@dataclass(frozen=True)
class MigProfileSpec:
    """One GPU instance profile: its slices, memory and allowed starting memory slices."""

    name: str
    compute_slices: int
    memory_slices: int
    memory_bytes: int
    starts: tuple[int, ...]


def _table(*rows: tuple[str, int, int, int, tuple[int, ...]]) -> dict[str, MigProfileSpec]:
    return {name: MigProfileSpec(name, c, m, mib * MIB, starts) for name, c, m, mib, starts in rows}


# Memory as `nvidia-smi mig -lgip` lists it for each profile, in MiB.
MIG_TABLES: dict[str, dict[str, MigProfileSpec]] = {
    "a100-80gb": _table(
        ("1g.10gb", 1, 1, 9728, (0, 1, 2, 3, 4, 5, 6)),
        ("1g.20gb", 1, 2, 19968, (0, 2, 4, 6)),
        ("2g.20gb", 2, 2, 19968, (0, 2, 4)),
        ("3g.40gb", 3, 4, 40192, (0, 4)),
        ("4g.40gb", 4, 4, 40192, (0,)),
        ("7g.80gb", 7, 8, 80896, (0,)),
    ),
    "a100-40gb": _table(
        ("1g.5gb", 1, 1, 4864, (0, 1, 2, 3, 4, 5, 6)),
        ("1g.10gb", 1, 2, 9984, (0, 2, 4, 6)),
        ("2g.10gb", 2, 2, 9984, (0, 2, 4)),
        ("3g.20gb", 3, 4, 20096, (0, 4)),
        ("4g.20gb", 4, 4, 20096, (0,)),
        ("7g.40gb", 7, 8, 40192, (0,)),
    ),
    "h100-80gb": _table(
        ("1g.10gb", 1, 1, 9984, (0, 1, 2, 3, 4, 5, 6)),
        ("1g.20gb", 1, 2, 20096, (0, 2, 4, 6)),
        ("2g.20gb", 2, 2, 20096, (0, 2, 4)),
        ("3g.40gb", 3, 4, 40448, (0, 4)),
        ("4g.40gb", 4, 4, 40448, (0,)),
        ("7g.80gb", 7, 8, 81152, (0,)),
    ),
}

# The MIG profile tables of the models that have MIG: (model name token, more than this many GiB, table).
_TABLE_BY_MODEL = (("A100", 60, "a100-80gb"), ("A100", 0, "a100-40gb"), ("H100", 60, "h100-80gb"))


def table_of_model(model: str, memory_total_bytes: int) -> str | None:
    """The MIG profile table of a GPU model (by its name and memory), or None when gpunode knows none."""
    gib = memory_total_bytes / 2**30
    for token, min_gib, table in _TABLE_BY_MODEL:
        if token in model and gib > min_gib:
            return table
    return None


# First GPU instance ID of each placement size (memory slices): a heap-style numbering.
GI_ID_BASE = {8: 0, 4: 1, 2: 3, 1: 7}


@dataclass(frozen=True)
class MigPlacement:
    """One placed MIG instance of a layout."""

    profile: str
    start: int  # first memory slice
    memory_slices: int
    compute_slices: int
    memory_bytes: int
    gi_id: int
    ci_id: int = 0


def place_mig_layout(table: str, profiles: Sequence[str], *, where: str) -> tuple[MigPlacement, ...]:
    """Place a MIG layout on one GPU, in the given order, or raise ProfileError saying why it cannot fit."""
    specs_by_name = MIG_TABLES.get(table)
    if specs_by_name is None:
        raise ProfileError(f"{where}: unknown MIG table {table!r} (known: {', '.join(sorted(MIG_TABLES))})")
    specs: list[MigProfileSpec] = []
    for name in profiles:
        spec = specs_by_name.get(name)
        if spec is None:
            raise ProfileError(
                f"{where}: {name!r} is not a MIG profile of this GPU (profiles: {', '.join(specs_by_name)})"
            )
        specs.append(spec)
    compute = sum(s.compute_slices for s in specs)
    if compute > TOTAL_COMPUTE_SLICES:
        raise ProfileError(
            f"{where}: layout {'+'.join(profiles)} needs {compute} compute slices, "
            f"the GPU has {TOTAL_COMPUTE_SLICES}"
        )
    memory = sum(s.memory_slices for s in specs)
    if memory > TOTAL_MEMORY_SLICES:
        raise ProfileError(
            f"{where}: layout {'+'.join(profiles)} needs {memory} memory slices, "
            f"the GPU has {TOTAL_MEMORY_SLICES}"
        )
    # Place the largest instances first; the layout keeps the order it was written in.
    order = sorted(range(len(specs)), key=lambda i: -specs[i].memory_slices)
    starts: dict[int, int] = {}
    if not _place(specs, order, 0, [False] * TOTAL_MEMORY_SLICES, starts):
        raise ProfileError(
            f"{where}: layout {'+'.join(profiles)} has no valid placement: "
            "its instances cannot sit at their allowed memory slices without overlapping"
        )
    return tuple(
        MigPlacement(
            profile=s.name,
            start=starts[i],
            memory_slices=s.memory_slices,
            compute_slices=s.compute_slices,
            memory_bytes=s.memory_bytes,
            gi_id=GI_ID_BASE[s.memory_slices] + starts[i] // s.memory_slices,
        )
        for i, s in enumerate(specs)
    )


def _place(
    specs: list[MigProfileSpec], order: list[int], k: int, used: list[bool], starts: dict[int, int]
) -> bool:
    if k == len(order):
        return True
    i = order[k]
    spec = specs[i]
    for start in spec.starts:
        cells = range(start, start + spec.memory_slices)
        if any(used[c] for c in cells):
            continue
        for c in cells:
            used[c] = True
        starts[i] = start
        if _place(specs, order, k + 1, used, starts):
            return True
        for c in cells:
            used[c] = False
    return False
