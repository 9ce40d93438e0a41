"""Small, strict readers for configuration mappings.

Every part of gpunode that owns a configuration section parses it with a
SectionReader, so that all sections report errors the same way: the file, the
dotted key, what was expected and what was found. A reader refuses unknown keys
when it is finished, so a typo never passes silently. This module only parses;
it never reads files or the environment (config.py does).
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from gpunode.errors import ConfigError

T = TypeVar("T")
_MISSING: Any = object()

_BYTE_UNITS = {
    "": 1, "b": 1,
    "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}  # fmt: skip
_DURATION_UNITS = {"ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}


def parse_bytes(value: object, *, where: str) -> int:
    """Parse a size such as 1073741824, "10Gi", "512MiB" or "16GB" into bytes."""
    if isinstance(value, bool):
        raise ConfigError(f"{where}: expected a size such as 10Gi, got {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise ConfigError(f"{where}: a size cannot be negative, got {value}")
        return value
    if isinstance(value, str):
        m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", value)
        if m and m.group(2).lower() in _BYTE_UNITS:
            return int(float(m.group(1)) * _BYTE_UNITS[m.group(2).lower()])
    raise ConfigError(f"{where}: expected a size such as 10Gi, 512MiB or a number of bytes, got {value!r}")


def parse_duration(value: object, *, where: str) -> float:
    """Parse a duration such as 5, 2.5, "500ms", "30s", "5m" into seconds."""
    if isinstance(value, bool):
        raise ConfigError(f"{where}: expected a duration such as 30s, got {value!r}")
    if isinstance(value, int | float):
        if value < 0:
            raise ConfigError(f"{where}: a duration cannot be negative, got {value}")
        return float(value)
    if isinstance(value, str):
        m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h)?\s*", value)
        if m:
            return float(m.group(1)) * _DURATION_UNITS[m.group(2) or "s"]
    raise ConfigError(f"{where}: expected a duration such as 500ms, 30s or 5m, got {value!r}")


class SectionReader:
    """Reads one mapping strictly. `where` names the file and the section, e.g. "cfg.yaml: gpunode.health"."""

    def __init__(self, data: object, where: str) -> None:
        if data is None:
            data = {}
        if not isinstance(data, Mapping):
            label = where.removesuffix(": ")
            raise ConfigError(f"{label}: expected a mapping, got {type(data).__name__} {data!r}")
        self._data = data
        self._where = where
        self._seen: set[str] = set()

    def key_path(self, key: str) -> str:
        return f"{self._where}.{key}" if not self._where.endswith(": ") else f"{self._where}{key}"

    def has(self, key: str) -> bool:
        return key in self._data

    def raw(self, key: str, default: Any = _MISSING) -> Any:
        self._seen.add(key)
        if key not in self._data or self._data[key] is None:
            if default is _MISSING:
                raise ConfigError(f"{self.key_path(key)}: required key is missing")
            return default
        return self._data[key]

    def get(self, key: str, kind: type[T], default: Any = _MISSING) -> T:
        value = self.raw(key, default)
        if value is default and default is not _MISSING:
            return value
        ok = isinstance(value, kind) and not (kind is not bool and isinstance(value, bool))
        if kind is float and isinstance(value, int) and not isinstance(value, bool):
            value, ok = float(value), True
        if not ok:
            raise ConfigError(
                f"{self.key_path(key)}: expected {kind.__name__}, got {type(value).__name__} {value!r}"
            )
        return value

    def choice(self, key: str, choices: tuple[str, ...], default: Any = _MISSING) -> str:
        value = self.get(key, str, default)
        if value not in choices:
            raise ConfigError(f"{self.key_path(key)}: expected one of {', '.join(choices)}, got {value!r}")
        return value

    def size(self, key: str, default: Any = _MISSING) -> int:
        value = self.raw(key, default)
        return value if value is default else parse_bytes(value, where=self.key_path(key))

    def duration(self, key: str, default: Any = _MISSING) -> float:
        value = self.raw(key, default)
        return value if value is default else parse_duration(value, where=self.key_path(key))

    def int_list(self, key: str, default: Any = _MISSING) -> tuple[int, ...]:
        value = self.raw(key, default)
        if value is default:
            return value
        if not isinstance(value, list) or not all(
            isinstance(v, int) and not isinstance(v, bool) for v in value
        ):
            raise ConfigError(f"{self.key_path(key)}: expected a list of integers, got {value!r}")
        return tuple(value)

    def section(self, key: str) -> SectionReader:
        return SectionReader(self.raw(key, {}), self.key_path(key))

    def parse(self, key: str, parser: Callable[[object, str], T], default: Any = _MISSING) -> T:
        value = self.raw(key, default)
        return value if value is default else parser(value, self.key_path(key))

    def finish(self) -> None:
        """Refuse the keys nobody read, naming each with the closest known key as a suggestion."""
        unknown = sorted(str(k) for k in self._data if k not in self._seen)
        if not unknown:
            return
        known = sorted(self._seen)

        def with_suggestion(key: str) -> str:
            close = difflib.get_close_matches(key, known, n=1)
            return f"{key} (did you mean {close[0]}?)" if close else key

        hint = f"the keys allowed here are: {', '.join(known)}" if known else "this section takes no keys"
        label = self._where.removesuffix(": ")
        listed = ", ".join(with_suggestion(k) for k in unknown)
        raise ConfigError(f"{label}: unknown key{'s' if len(unknown) > 1 else ''} {listed}", hint=hint)
