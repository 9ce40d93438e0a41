"""Device IDs the agent advertises to the kubelet, and PCI bus IDs: one place that writes and reads them.

A kubelet device ID is one of:

    <uuid>            a whole GPU or a MIG device (its UUID, as the NVIDIA device plugin names it)
    <uuid>::<n>       replica n of a time-sliced GPU or MIG device (n = 0, 1, ...)
    <uuid>::mem<n>    memory unit n of a fractional GPU (n = 0, 1, ...)

format and parse are exact inverses: parse refuses anything format would not
write (a missing or signed number, leading zeros, a second separator), so an
ID that parses names one device in one way. Failures are ValueErrors whose
message names the ID and the form expected.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

SEPARATOR = "::"
MEMORY_TAG = "mem"
MIG_UUID_PREFIX = "MIG-"  # NVML names every MIG device MIG-<...>, every GPU GPU-<...>
_NUMBER = re.compile(r"0|[1-9][0-9]*")
_FORMS = "<uuid>, <uuid>::<n> or <uuid>::mem<n>"


@dataclass(frozen=True)
class DeviceId:
    """A parsed device ID: the GPU or MIG UUID, and the replica or memory-unit number when there is one."""

    base: str
    replica: int | None = None
    memory_unit: int | None = None

    def __post_init__(self) -> None:
        _check_base(self.base)
        if self.replica is not None and self.memory_unit is not None:
            raise ValueError(f"device ID of {self.base}: a replica number or a memory unit, not both")
        for n in (self.replica, self.memory_unit):
            if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 0):
                raise ValueError(f"device ID of {self.base}: the number must be an integer >= 0, got {n!r}")

    @property
    def kind(self) -> str:
        """What the ID names, as the inventory says it: "gpu", "mig", "replica" or "memory" (a unit)."""
        if self.replica is not None:
            return "replica"
        if self.memory_unit is not None:
            return "memory"
        return "mig" if self.base.startswith(MIG_UUID_PREFIX) else "gpu"

    def __str__(self) -> str:
        if self.replica is not None:
            return f"{self.base}{SEPARATOR}{self.replica}"
        if self.memory_unit is not None:
            return f"{self.base}{SEPARATOR}{MEMORY_TAG}{self.memory_unit}"
        return self.base


def _check_base(base: str) -> None:
    if not isinstance(base, str) or not base or SEPARATOR in base or base != base.strip():
        raise ValueError(
            f"{base!r} is not a GPU or MIG UUID a device ID can start with "
            f"(it must be non-empty, without spaces around it or {SEPARATOR!r})"
        )


def replica_id(base: str, n: int) -> str:
    """The ID of replica n of a time-sliced GPU or MIG device: <uuid>::<n>."""
    return str(DeviceId(base, replica=n))


def memory_unit_id(base: str, n: int) -> str:
    """The ID of memory unit n of a fractional GPU: <uuid>::mem<n>."""
    return str(DeviceId(base, memory_unit=n))


def parse_device_id(text: str) -> DeviceId:
    """Read a device ID written by replica_id, memory_unit_id or a bare UUID; ValueError otherwise."""
    if not isinstance(text, str):
        raise ValueError(f"a device ID is a string ({_FORMS}), got {type(text).__name__}")
    base, sep, suffix = text.partition(SEPARATOR)
    if not sep:
        return DeviceId(_base_of(text, base))
    base = _base_of(text, base)
    if suffix.startswith(MEMORY_TAG):
        number = suffix[len(MEMORY_TAG) :]
        if _NUMBER.fullmatch(number):
            return DeviceId(base, memory_unit=int(number))
    elif _NUMBER.fullmatch(suffix):
        return DeviceId(base, replica=int(suffix))
    raise ValueError(f"device ID {text!r}: expected {_FORMS} with n a number such as 0 or 12")


def _base_of(text: str, base: str) -> str:
    try:
        _check_base(base)
    except ValueError:
        raise ValueError(f"device ID {text!r}: expected {_FORMS}, with a UUID before {SEPARATOR!r}") from None
    return base


# -- PCI bus IDs --------------------------------------------------------------------------------

# A domain of 4 to 8 hex digits: sysfs writes 4 ("0000:18:00.0"), or 5 behind an Intel VMD bridge.
_BUS_ID = re.compile(r"([0-9A-Fa-f]{4,8}):([0-9A-Fa-f]{2}):([0-9A-Fa-f]{2})\.([0-7])")


def normalize_pci_bus_id(value: str) -> str:
    """A PCI bus ID in NVML's form, "00000000:18:00.0", from a form with a 4- to 8-digit domain.

    Hex digits are upper-cased and surrounding spaces dropped. Anything else (a
    missing domain, a function above 7, stray characters) is a ValueError naming
    the value and the form expected.
    """
    m = _BUS_ID.fullmatch(value.strip()) if isinstance(value, str) else None
    if not m:
        raise ValueError(f"{value!r} is not a PCI bus ID such as 00000000:18:00.0 or 0000:18:00.0")
    domain, bus, dev, fn = m.groups()
    return f"{int(domain, 16):08X}:{bus.upper()}:{dev.upper()}.{fn}"
