"""Small, strict readers for decoded YAML and JSON mappings: the one way gpunode reads a document.

Configuration sections (gpunode.config), simulated-node profiles and the
node-state annotation (gpunode.contract.nodestate) are all read with a
SectionReader, so every document reports errors the same way: where it is (the
file, the annotation), the dotted key, what was expected and what was found. A
reader refuses unknown keys when it is finished, so a typo never passes
silently; readers of documents that may grow fields (the annotation) simply do
not call finish. The error class is the caller's: ConfigError for configuration,
NodeStateError for the annotation.

This module sits at the bottom of the package with the rest of the contract: it
imports gpunode.errors and the standard library only. YAML parsing, which needs
PyYAML, stays in gpunode.config.reader.
"""

from __future__ import annotations

import difflib
import math
import re
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from gpunode.contract.names import GIB, KIB, MIB, TIB
from gpunode.errors import ConfigError, GpunodeError

T = TypeVar("T")
_MISSING: Any = object()

_BYTE_UNITS = {
    "": 1, "b": 1,
    "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "ki": KIB, "mi": MIB, "gi": GIB, "ti": TIB,
    "kib": KIB, "mib": MIB, "gib": GIB, "tib": TIB,
}  # fmt: skip
_DURATION_UNITS = {"ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}


def parse_bytes(value: object, *, where: str, error: type[GpunodeError] = ConfigError) -> int:
    """Parse a size such as 1073741824, "10Gi", "512MiB" or "16GB" into bytes."""
    if isinstance(value, bool):
        raise error(f"{where}: expected a size such as 10Gi, got {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise error(f"{where}: a size cannot be negative, got {value}")
        return value
    if isinstance(value, str):
        m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", value)
        if m and m.group(2).lower() in _BYTE_UNITS:
            return int(float(m.group(1)) * _BYTE_UNITS[m.group(2).lower()])
    raise error(f"{where}: expected a size such as 10Gi, 512MiB or a number of bytes, got {value!r}")


def parse_duration(value: object, *, where: str, error: type[GpunodeError] = ConfigError) -> float:
    """Parse a duration such as 5, 2.5, "500ms", "30s", "5m" into seconds."""
    if isinstance(value, bool):
        raise error(f"{where}: expected a duration such as 30s, got {value!r}")
    if isinstance(value, int | float):
        if value < 0:
            raise error(f"{where}: a duration cannot be negative, got {value}")
        return float(value)
    if isinstance(value, str):
        m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h)?\s*", value)
        if m:
            return float(m.group(1)) * _DURATION_UNITS[m.group(2) or "s"]
    raise error(f"{where}: expected a duration such as 500ms, 30s or 5m, got {value!r}")


class SectionReader:
    """Reads one mapping strictly. `where` names the file and the section, e.g. "cfg.yaml: gpunode.health".

    error: the GpunodeError subclass every refusal raises (ConfigError unless given).
    json_object: the data is a decoded JSON object, so null is refused instead of read as an
    empty section, and messages say "object" rather than "mapping".
    """

    def __init__(
        self,
        data: object,
        where: str,
        *,
        error: type[GpunodeError] = ConfigError,
        json_object: bool = False,
    ) -> None:
        self._error = error
        self._json = json_object
        if data is None and not json_object:
            data = {}
        if not isinstance(data, Mapping):
            label = where.removesuffix(": ")
            if json_object:
                raise error(f"{label}: expected an object, got {type(data).__name__}")
            raise error(f"{label}: expected a mapping, got {type(data).__name__} {data!r}")
        self._data = data
        self._where = where
        self._seen: set[str] = set()

    @property
    def where(self) -> str:
        """Where this mapping is, for messages: "cfg.yaml: gpunode.health", "gpunode.io/gpu-state.gpus[0]"."""
        return self._where.removesuffix(": ")

    def key_path(self, key: str) -> str:
        """The dotted path of a key, for messages: "cfg.yaml: gpunode.health.window"."""
        return f"{self._where}.{key}" if not self._where.endswith(": ") else f"{self._where}{key}"

    def fail(self, key: str, problem: str, *, hint: str | None = None) -> GpunodeError:
        """The reader's error about one key, to raise: "<path of key>: <problem>"."""
        return self._error(f"{self.key_path(key)}: {problem}", hint=hint)

    def has(self, key: str) -> bool:
        """Whether the section has the key."""
        return key in self._data

    def raw(self, key: str, default: Any = _MISSING) -> Any:
        """The key's value, unchecked, or default if missing or null; marks it read, raises if required."""
        self._seen.add(key)
        if key not in self._data or self._data[key] is None:
            if default is _MISSING:
                others = [str(k) for k in self._data if k != key]
                close = difflib.get_close_matches(key, others, n=1)
                typo = f" (is {close[0]} a misspelling of it?)" if close else ""
                raise self.fail(key, f"required key is missing{typo}")
            return default
        return self._data[key]

    def get(self, key: str, kind: type[T], default: Any = _MISSING) -> T:
        """The key's value checked to be of kind (an int is accepted as a float), or default."""
        value = self.raw(key, default)
        if value is default and default is not _MISSING:
            return value
        ok = isinstance(value, kind) and not (kind is not bool and isinstance(value, bool))
        if kind is float and isinstance(value, int) and not isinstance(value, bool):
            value, ok = float(value), True
        if not ok:
            raise self.fail(key, f"expected {kind.__name__}, got {type(value).__name__} {value!r}")
        return value

    def choice(self, key: str, choices: tuple[str, ...], default: Any = _MISSING) -> str:
        """The key's string value, checked to be one of choices, or default."""
        value = self.get(key, str, default)
        if value not in choices:
            raise self.fail(key, f"expected one of {', '.join(choices)}, got {value!r}")
        return value

    def integer(
        self, key: str, default: Any = _MISSING, *, minimum: int | None = None, maximum: int | None = None
    ) -> int:
        """An integer (never a bool), within minimum..maximum when those are given."""
        value = self.raw(key, default)
        if value is default and default is not _MISSING:
            return value
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.fail(key, f"expected an integer, got {value!r}")
        if (minimum is not None and value < minimum) or (maximum is not None and value > maximum):
            if minimum is not None and maximum is not None:
                bound = f"{minimum}..{maximum}"
            else:
                bound = f">= {minimum}" if minimum is not None else f"<= {maximum}"
            raise self.fail(key, f"expected {bound}, got {value}")
        return value

    def number(self, key: str, default: Any = _MISSING, *, minimum: float | None = None) -> float:
        """A finite number (int or float, never a bool), at least `minimum` when given."""
        value = self.raw(key, default)
        if value is default and default is not _MISSING:
            return value
        if (
            isinstance(value, bool)
            or not isinstance(value, int | float)
            or not math.isfinite(value)
            or (minimum is not None and value < minimum)
        ):
            bound = "" if minimum is None else "non-negative " if minimum == 0 else f"(>= {minimum}) "
            raise self.fail(key, f"expected a {bound}number, got {value!r}")
        return float(value)

    def flag(self, key: str, default: Any = _MISSING) -> bool:
        """true or false, nothing else (no 0/1, no "yes")."""
        value = self.raw(key, default)
        if value is default and default is not _MISSING:
            return value
        if not isinstance(value, bool):
            raise self.fail(key, f"expected true or false, got {value!r}")
        return value

    def size(self, key: str, default: Any = _MISSING) -> int:
        """The key's size value parsed to bytes, or default."""
        value = self.raw(key, default)
        if value is default:
            return value
        return parse_bytes(value, where=self.key_path(key), error=self._error)

    def duration(self, key: str, default: Any = _MISSING) -> float:
        """The key's duration value parsed to seconds, or default."""
        value = self.raw(key, default)
        if value is default:
            return value
        return parse_duration(value, where=self.key_path(key), error=self._error)

    def items(self, key: str, default: Any = _MISSING) -> list[Any]:
        """A list, its items unread (read each with a SectionReader of its own)."""
        value = self.raw(key, default)
        if value is default and default is not _MISSING:
            return value
        if not isinstance(value, list):
            raise self.fail(key, f"expected a list, got {type(value).__name__}")
        return value

    def int_list(self, key: str, default: Any = _MISSING) -> tuple[int, ...]:
        """The key's value checked to be a list of integers, as a tuple, or default."""
        value = self.raw(key, default)
        if value is default:
            return value
        if not isinstance(value, list) or not all(
            isinstance(v, int) and not isinstance(v, bool) for v in value
        ):
            raise self.fail(key, f"expected a list of integers, got {value!r}")
        return tuple(value)

    def text_list(self, key: str, default: Any = _MISSING) -> tuple[str, ...]:
        """A list of non-empty strings."""
        value = self.raw(key, default)
        if value is default and default is not _MISSING:
            return value
        if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
            raise self.fail(key, f"expected a list of non-empty strings, got {value!r}")
        return tuple(value)

    def section(self, key: str) -> SectionReader:
        """A reader of the mapping under `key` (an empty one when the key is absent), with these settings."""
        return self.item(self.raw(key, {}), self.key_path(key))

    def item(self, data: object, where: str) -> SectionReader:
        """A reader of one list item (or any nested mapping) at `where`, with this reader's settings."""
        return SectionReader(data, where, error=self._error, json_object=self._json)

    def parse(self, key: str, parser: Callable[[object, str], T], default: Any = _MISSING) -> T:
        """The key's value passed through parser (with its key path), or default."""
        value = self.raw(key, default)
        return value if value is default else parser(value, self.key_path(key))

    def unread(self) -> dict[str, Any]:
        """The keys nobody has read, with their values (for documents that keep unknown fields)."""
        return {str(k): v for k, v in self._data.items() if k not in self._seen}

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
        raise self._error(f"{label}: unknown key{'s' if len(unknown) > 1 else ''} {listed}", hint=hint)
