"""Simulated-node profiles: the YAML schema and its strict loader (MIG placement is in simnode.mig).

A profile describes one GPU node for gpunode.node.devices.simnode.backend: the driver version,
the GPU models (NVML name, memory, power and clock envelope, which optional
NVML features the model has), the GPUs in PCI order with their bus IDs, NUMA
nodes and MIG layouts, and the NVLink topology. Profiles ship in
gpunode/node/devices/simnode/profiles/ and users may write their own; both are loaded by
`load_profile`.

Schema (version 1; sizes accept 81559Mi, 80GiB or a number of bytes)::

    version: 1                      # required, must be 1
    name: dgx-h100                  # optional, defaults to the file name without .yaml
    description: text               # optional
    driver_version: "550.90.07"     # required, as nvmlSystemGetDriverVersion reports it
    seed: ""                        # optional string or int; changes every UUID
    models:                         # required: one or more GPU models, by a short key
      h100:
        name: NVIDIA H100 80GB HBM3 # required, the NVML device name
        architecture: hopper        # optional
        memory_total: 81559Mi       # required, as nvmlDeviceGetMemoryInfo reports it
        memory_reserved: 0          # optional, driver-reserved framebuffer (default 0)
        power_idle_w: 70            # required
        power_limit_w: 700          # required, > power_idle_w
        sm_clock_idle_mhz: 345      # required
        sm_clock_max_mhz: 1980      # required, >= sm_clock_idle_mhz
        mem_clock_mhz: 2619         # required
        temp_idle_c: 32             # optional (default 30)
        temp_load_c: 70             # optional (default 75), >= temp_idle_c
        mig_table: h100-80gb        # optional: MIG profiles the model offers (see MIG_TABLES)
        supports: [ecc, ...]        # optional NVML features: see FEATURES
    gpus:                           # required, in NVML index order
      - model: h100                 # optional when there is exactly one model
        pci_bus_id: "00000000:18:00.0"   # required, unique
        numa_node: 0                # optional int, or null for none
        minor: 0                    # optional, /dev/nvidia<minor>; defaults to the index
        mig: [1g.10gb, 3g.40gb]     # optional: absent/null = MIG disabled, [] = enabled and empty
    nvlink: nvswitch                # optional: none (default), nvswitch (every GPU in one
                                    # mesh), or a list of index pairs [[0, 1], [2, 3]]

This module only parses and validates; it keeps no state and never touches the
simulated devices (sim.py does).
"""

from __future__ import annotations

import difflib
import importlib.resources
import re
from dataclasses import dataclass
from pathlib import Path

import yaml

from gpunode.contract.deviceids import normalize_pci_bus_id
from gpunode.contract.reader import SectionReader, excerpt
from gpunode.errors import ConfigError, ProfileError
from gpunode.node.devices.simnode.mig import MIG_TABLES, MigPlacement, place_mig_layout

FEATURES = frozenset(
    {
        "ecc",  # volatile ECC counters and ECC events
        "row_remapping",  # nvmlDeviceGetRemappedRows (A100 and later)
        "page_retirement",  # nvmlDeviceGetRetiredPagesPendingStatus (before A100)
        "memory_temperature",  # NVML_FI_DEV_MEMORY_TEMP (HBM parts)
        "profiling",  # DCGM profiling fields: GR engine, tensor, DRAM activity, PCIe bytes
        "nvlink",  # NVLink links and throughput counters
        "encoder",  # NVENC utilisation
        "decoder",  # NVDEC utilisation
    }
)


MAX_PROFILE_BYTES = 1024 * 1024  # a profile is a few KiB


@dataclass(frozen=True)
class SimModel:
    """A GPU model of a profile."""

    key: str
    name: str
    architecture: str | None
    memory_total_bytes: int
    memory_reserved_bytes: int
    power_idle_w: float
    power_limit_w: float
    sm_clock_idle_hz: float
    sm_clock_max_hz: float
    mem_clock_hz: float
    temp_idle_c: float
    temp_load_c: float
    mig_table: str | None
    features: frozenset[str]

    def supports(self, feature: str) -> bool:
        """Whether the model has the NVML feature `feature` (a FEATURES name, e.g. "ecc", "nvlink")."""
        return feature in self.features


@dataclass(frozen=True)
class SimGpuSpec:
    """One GPU slot of a profile, in index order."""

    index: int
    model: str  # SimModel.key
    pci_bus_id: str  # "00000000:18:00.0"
    numa_node: int | None
    minor: int
    mig: tuple[MigPlacement, ...] | None  # None = MIG disabled


@dataclass(frozen=True)
class SimProfile:
    """A validated simulated node."""

    name: str
    source: str  # the file it came from
    description: str
    driver_version: str
    seed: str
    models: tuple[SimModel, ...]
    gpus: tuple[SimGpuSpec, ...]
    nvlink: str  # "none", "nvswitch" or "pairs"
    nvlink_pairs: tuple[tuple[int, int], ...] = ()

    def model(self, key_or_name: str) -> SimModel:
        """The GPU model with this key or name; ProfileError naming the known keys when there is none."""
        for m in self.models:
            if key_or_name in (m.key, m.name):
                return m
        known = ", ".join(m.key for m in self.models)
        raise ProfileError(f"profile {self.name}: no GPU model {key_or_name!r} (models: {known})")


def bundled_profiles() -> tuple[str, ...]:
    """Names of the profiles shipped with gpunode."""
    root = importlib.resources.files("gpunode.node.devices.simnode") / "profiles"
    return tuple(sorted(p.name[: -len(".yaml")] for p in root.iterdir() if p.name.endswith(".yaml")))


def load_profile(name_or_path: str | Path) -> SimProfile:
    """Load a bundled profile by name ("dgx-h100") or a user's profile from a file path."""
    text, source, stem = _read_profile_text(name_or_path)
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = excerpt(str(getattr(e, "problem", None) or e), 120).strip("'\"")
        raise ProfileError(f"{source}: not valid YAML{at}: {problem}") from None
    try:
        return _parse_profile(data, source=source, stem=stem)
    except ProfileError:
        raise
    except ConfigError as e:
        hint = None if e.hint == ConfigError.default_hint else e.hint
        raise ProfileError(str(e), hint=hint) from None


def _read_profile_text(name_or_path: str | Path) -> tuple[str, str, str]:
    as_text = str(name_or_path)
    looks_like_path = isinstance(name_or_path, Path) or "/" in as_text or as_text.endswith((".yaml", ".yml"))
    if not looks_like_path:
        resource = importlib.resources.files("gpunode.node.devices.simnode") / "profiles" / f"{as_text}.yaml"
        if not resource.is_file():
            bundled = bundled_profiles()
            close = difflib.get_close_matches(as_text, bundled, n=1)
            typo = f"; did you mean {close[0]}?" if close else ""
            raise ProfileError(
                f"no bundled simulated-node profile named {excerpt(as_text)} (bundled: {', '.join(bundled)}"
                f"){typo}",
                hint="give one of the bundled names, or a path to your own profile file (with a '/')",
            )
        return resource.read_text(encoding="utf-8"), f"{as_text}.yaml (bundled)", as_text
    path = Path(as_text)
    try:
        with path.open("rb") as f:
            data = f.read(MAX_PROFILE_BYTES + 1)
        if len(data) > MAX_PROFILE_BYTES:
            raise ProfileError(
                f"{path}: larger than {MAX_PROFILE_BYTES // 1024} KiB, too large for a simulated-node profile",
                hint="a profile is a few KiB; check the path given to --sim-profile (gpunode.simProfile)",
            )
        return data.decode("utf-8"), str(path), path.stem
    except OSError as e:
        raise ProfileError(
            f"{path}: cannot read the profile: {e.strerror or e}",
            hint="check the path given to --sim-profile",
        ) from None
    except UnicodeDecodeError:
        raise ProfileError(f"{path}: the profile is not UTF-8 text") from None


def _parse_profile(data: object, *, source: str, stem: str) -> SimProfile:
    top = SectionReader(data, f"{source}: ")
    version = top.get("version", int)
    if version != 1:
        raise ProfileError(f"{top.key_path('version')}: unsupported profile version {version} (expected 1)")
    name = top.get("name", str, stem)
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", name):
        raise ProfileError(
            f"{top.key_path('name')}: expected letters, digits, '.', '_' or '-', got {excerpt(name)}"
        )
    description = top.get("description", str, "")
    driver_version = top.get("driver_version", str)
    seed_raw = top.raw("seed", "")
    if isinstance(seed_raw, bool) or not isinstance(seed_raw, str | int):
        raise ProfileError(
            f"{top.key_path('seed')}: expected a string or an integer, got {excerpt(seed_raw)}"
        )
    models = _parse_models(top)
    gpus = _parse_gpus(top, models)
    nvlink, pairs = _parse_nvlink(top, len(gpus), models, gpus)
    top.finish()
    return SimProfile(
        name=name,
        source=source,
        description=description,
        driver_version=driver_version,
        seed=str(seed_raw),
        models=models,
        gpus=gpus,
        nvlink=nvlink,
        nvlink_pairs=pairs,
    )


def _parse_models(top: SectionReader) -> tuple[SimModel, ...]:
    where = top.key_path("models")
    raw = top.raw("models")
    if not isinstance(raw, dict) or not raw:
        raise ProfileError(
            f"{where}: expected a mapping of one or more GPU models by key, got {excerpt(raw)}"
        )
    models = []
    for key, spec in raw.items():
        if not isinstance(key, str):
            raise ProfileError(f"{where}: model keys must be strings, got {excerpt(key)}")
        models.append(_parse_model(key, SectionReader(spec, f"{where}.{key}")))
    names = [m.name for m in models]
    if len(set(names)) != len(names):
        raise ProfileError(f"{where}: two models share one NVML name")
    return tuple(models)


def _parse_model(key: str, r: SectionReader) -> SimModel:
    def positive(field: str, default: object = None) -> float:
        value = r.get(field, float) if default is None else r.get(field, float, default)
        if value <= 0:
            raise ProfileError(f"{r.key_path(field)}: expected a positive number, got {value}")
        return value

    name = r.get("name", str)
    architecture = r.get("architecture", str, None)
    memory_total = r.size("memory_total")
    memory_reserved = r.size("memory_reserved", 0)
    if memory_total <= 0:
        raise ProfileError(f"{r.key_path('memory_total')}: must be positive")
    if memory_reserved >= memory_total:
        raise ProfileError(f"{r.key_path('memory_reserved')}: must be smaller than memory_total")
    power_idle = positive("power_idle_w")
    power_limit = positive("power_limit_w")
    if power_limit <= power_idle:
        raise ProfileError(f"{r.key_path('power_limit_w')}: must be greater than power_idle_w")
    sm_idle = positive("sm_clock_idle_mhz")
    sm_max = positive("sm_clock_max_mhz")
    if sm_max < sm_idle:
        raise ProfileError(f"{r.key_path('sm_clock_max_mhz')}: must not be below sm_clock_idle_mhz")
    mem_clock = positive("mem_clock_mhz")
    temp_idle = r.get("temp_idle_c", float, 30.0)
    temp_load = r.get("temp_load_c", float, 75.0)
    if temp_load < temp_idle:
        raise ProfileError(f"{r.key_path('temp_load_c')}: must not be below temp_idle_c")
    mig_table = r.get("mig_table", str, None)
    if mig_table is not None and mig_table not in MIG_TABLES:
        raise ProfileError(
            f"{r.key_path('mig_table')}: unknown MIG table {excerpt(mig_table)} (known: {', '.join(sorted(MIG_TABLES))})"
        )
    supports = r.raw("supports", [])
    if not isinstance(supports, list) or not all(isinstance(s, str) for s in supports):
        raise ProfileError(
            f"{r.key_path('supports')}: expected a list of feature names, got {excerpt(supports)}"
        )
    unknown = sorted(set(supports) - FEATURES)
    if unknown:
        raise ProfileError(
            f"{r.key_path('supports')}: unknown feature(s) {', '.join(unknown)} "
            f"(known: {', '.join(sorted(FEATURES))})"
        )
    r.finish()
    return SimModel(
        key=key,
        name=name,
        architecture=architecture,
        memory_total_bytes=memory_total,
        memory_reserved_bytes=memory_reserved,
        power_idle_w=power_idle,
        power_limit_w=power_limit,
        sm_clock_idle_hz=sm_idle * 1e6,
        sm_clock_max_hz=sm_max * 1e6,
        mem_clock_hz=mem_clock * 1e6,
        temp_idle_c=temp_idle,
        temp_load_c=temp_load,
        mig_table=mig_table,
        features=frozenset(supports),
    )


def _parse_gpus(top: SectionReader, models: tuple[SimModel, ...]) -> tuple[SimGpuSpec, ...]:
    raw = top.raw("gpus")
    if not isinstance(raw, list) or not raw:
        raise ProfileError(f"{top.key_path('gpus')}: expected a non-empty list of GPUs")
    gpus: list[SimGpuSpec] = []
    for index, item in enumerate(raw):
        r = SectionReader(item, top.key_path(f"gpus[{index}]"))
        if r.has("model"):
            key = r.get("model", str)
            model = next((m for m in models if key in (m.key, m.name)), None)
            if model is None:
                raise ProfileError(
                    f"{r.key_path('model')}: unknown model {excerpt(key)} (models: {', '.join(m.key for m in models)})"
                )
        elif len(models) == 1:
            model = models[0]
        else:
            raise ProfileError(f"{r.key_path('model')}: required when the profile has several models")
        try:
            bus = normalize_pci_bus_id(r.get("pci_bus_id", str))
        except ValueError:
            raise ProfileError(
                f"{r.key_path('pci_bus_id')}: expected a PCI bus ID such as 00000000:18:00.0"
            ) from None
        numa = r.get("numa_node", int, None)
        if numa is not None and numa < 0:
            raise ProfileError(f"{r.key_path('numa_node')}: must be 0 or more, or null")
        minor = r.get("minor", int, index)
        if minor < 0:
            raise ProfileError(f"{r.key_path('minor')}: must be 0 or more")
        mig = _parse_mig(r, model)
        r.finish()
        gpus.append(SimGpuSpec(index, model.key, bus, numa, minor, mig))
    for field in ("pci_bus_id", "minor"):
        values = [getattr(g, field) for g in gpus]
        dupes = sorted({str(v) for v in values if values.count(v) > 1})
        if dupes:
            raise ProfileError(f"{top.key_path('gpus')}: duplicate {field} {', '.join(dupes)}")
    return tuple(gpus)


def _parse_mig(r: SectionReader, model: SimModel) -> tuple[MigPlacement, ...] | None:
    layout = r.raw("mig", None)
    if layout is None:
        return None
    where = r.key_path("mig")
    if not isinstance(layout, list) or not all(isinstance(p, str) for p in layout):
        raise ProfileError(f"{where}: expected a list of MIG profile names such as [3g.40gb, 1g.10gb]")
    if model.mig_table is None:
        raise ProfileError(f"{where}: model {model.key} ({model.name}) does not support MIG (no mig_table)")
    return place_mig_layout(model.mig_table, layout, where=where)


def _parse_nvlink(
    top: SectionReader, count: int, models: tuple[SimModel, ...], gpus: tuple[SimGpuSpec, ...]
) -> tuple[str, tuple[tuple[int, int], ...]]:
    raw = top.raw("nvlink", "none")
    where = top.key_path("nvlink")
    pairs: tuple[tuple[int, int], ...] = ()
    if raw in ("none", "nvswitch"):
        kind = str(raw)
    elif isinstance(raw, list):
        parsed: list[tuple[int, int]] = []
        for pair in raw:
            ok = (
                isinstance(pair, list)
                and len(pair) == 2
                and all(isinstance(i, int) and not isinstance(i, bool) for i in pair)
            )
            if not ok:
                raise ProfileError(
                    f"{where}: expected pairs of GPU indexes such as [[0, 1], [2, 3]], got {excerpt(pair)}"
                )
            a, b = pair
            if not (0 <= a < count and 0 <= b < count) or a == b:
                raise ProfileError(
                    f"{where}: pair {pair!r} must name two different GPUs among 0..{count - 1}"
                )
            parsed.append((min(a, b), max(a, b)))
        kind, pairs = "pairs", tuple(sorted(set(parsed)))
    else:
        raise ProfileError(f"{where}: expected none, nvswitch or a list of index pairs, got {excerpt(raw)}")
    if kind != "none":
        by_key = {m.key: m for m in models}
        linked: set[int] = set(range(count)) if kind == "nvswitch" else {i for pair in pairs for i in pair}
        for i in linked:
            model = by_key[gpus[i].model]
            if not model.supports("nvlink"):
                raise ProfileError(
                    f"{where}: GPU {i} ({model.name}) has no NVLink (its model lacks 'nvlink')"
                )
    return kind, pairs
