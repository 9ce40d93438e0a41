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
# Ceilings for any size or duration read anywhere: far above every real value, low enough that no
# arithmetic on them overflows or loops for ever. Sections bound their own keys more tightly.
MAX_BYTES = 2**50  # 1 PiB
MAX_DURATION_S = 7 * 86400.0  # one week


def format_seconds(seconds: float) -> str:
    """A duration for messages: 0.1s, 30s, 10m, 2h, 7d."""
    for unit, size in (("d", 86400.0), ("h", 3600.0), ("m", 60.0)):
        if seconds >= size and seconds % size == 0:
            return f"{seconds / size:g}{unit}"
    return f"{seconds:g}s"


def format_bytes(size: int) -> str:
    """A size for messages: 1Mi, 1Ti, 1536 bytes."""
    for unit, factor in (("Pi", 2**50), ("Ti", TIB), ("Gi", GIB), ("Mi", MIB), ("Ki", KIB)):
        if size >= factor and size % factor == 0:
            return f"{size // factor}{unit}"
    return f"{size} bytes"


MAX_EXCERPT_CHARS = 60


def excerpt(value: object, limit: int = MAX_EXCERPT_CHARS) -> str:
    """repr(value) cut to `limit` characters, ending in "..." when cut: a message quotes a value, never a file."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[: limit - 3]}..."


def parse_bytes(value: object, *, where: str, error: type[GpunodeError] = ConfigError) -> int:
    """Parse a size such as 1073741824, "10Gi", "512MiB" or "16GB" into bytes."""
    if isinstance(value, bool):
        raise error(f"{where}: expected a size such as 10Gi, got {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise error(f"{where}: a size cannot be negative, got {value}")
        size = value
    elif isinstance(value, str) and len(value) <= 64:
        m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", value)
        if not m or m.group(2).lower() not in _BYTE_UNITS:
            raise error(f"{where}: expected a size such as 10Gi, 512MiB or a number of bytes, got {value!r}")
        number = float(m.group(1)) * _BYTE_UNITS[m.group(2).lower()]
        size = int(number) if math.isfinite(number) else MAX_BYTES + 1
    else:
        raise error(f"{where}: expected a size such as 10Gi, 512MiB or a number of bytes, got {value!r:.80}")
    if size > MAX_BYTES:
        raise error(f"{where}: a size must be at most {format_bytes(MAX_BYTES)}, got {value!s:.40}")
    return size


def parse_duration(value: object, *, where: str, error: type[GpunodeError] = ConfigError) -> float:
    """Parse a duration such as 5, 2.5, "500ms", "30s", "5m" into seconds."""
    if isinstance(value, bool):
        raise error(f"{where}: expected a duration such as 30s, got {value!r}")
    if isinstance(value, int | float):
        if value < 0:
            raise error(f"{where}: a duration cannot be negative, got {value}")
        seconds = float(value) if isinstance(value, float) or value <= MAX_DURATION_S else math.inf
    elif isinstance(value, str) and len(value) <= 64:
        m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h)?\s*", value)
        if not m:
            raise error(f"{where}: expected a duration such as 500ms, 30s or 5m, got {value!r}")
        seconds = float(m.group(1)) * _DURATION_UNITS[m.group(2) or "s"]
    else:
        raise error(f"{where}: expected a duration such as 500ms, 30s or 5m, got {value!r:.80}")
    if not seconds <= MAX_DURATION_S:  # also refuses NaN and infinity
        raise error(
            f"{where}: a duration must be at most {format_seconds(MAX_DURATION_S)}, got {value!s:.40}"
        )
    return seconds


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
            raise error(f"{label}: expected a mapping, got {type(data).__name__} {excerpt(data)}")
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
            raise self.fail(key, f"expected {kind.__name__}, got {type(value).__name__} {excerpt(value)}")
        return value

    def choice(self, key: str, choices: tuple[str, ...], default: Any = _MISSING) -> str:
        """The key's string value, checked to be one of choices, or default."""
        value = self.get(key, str, default)
        if value not in choices:
            raise self.fail(key, f"expected one of {', '.join(choices)}, got {excerpt(value)}")
        return value

    def integer(
        self, key: str, default: Any = _MISSING, *, minimum: int | None = None, maximum: int | None = None
    ) -> int:
        """An integer (never a bool), within minimum..maximum when those are given."""
        value = self.raw(key, default)
        if value is default and default is not _MISSING:
            return value
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.fail(key, f"expected an integer, got {excerpt(value)}")
        if (minimum is not None and value < minimum) or (maximum is not None and value > maximum):
            if minimum is not None and maximum is not None:
                bound = f"{minimum}..{maximum}"
            else:
                bound = f">= {minimum}" if minimum is not None else f"<= {maximum}"
            raise self.fail(key, f"expected {bound}, got {value}")
        return value

    def number(
        self,
        key: str,
        default: Any = _MISSING,
        *,
        minimum: float | None = None,
        maximum: float | None = None,
    ) -> float:
        """A finite number (int or float, never a bool), within minimum..maximum when those are given."""
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
            if maximum is not None:
                bound = f"{minimum if minimum is not None else '-inf'}..{maximum:g} "
            raise self.fail(key, f"expected a {bound}number, got {value!r:.40}")
        if maximum is not None and value > maximum:
            low = "" if minimum is None else f"{minimum:g}.."
            raise self.fail(key, f"expected a {low}{maximum:g} number, got {value!r:.40}")
        return float(value)

    def flag(self, key: str, default: Any = _MISSING) -> bool:
        """true or false, nothing else (no 0/1, no "yes")."""
        value = self.raw(key, default)
        if value is default and default is not _MISSING:
            return value
        if not isinstance(value, bool):
            raise self.fail(key, f"expected true or false, got {excerpt(value)}")
        return value

    def size(
        self, key: str, default: Any = _MISSING, *, minimum: int = 0, maximum: int = MAX_BYTES, hint: str = ""
    ) -> int:
        """The key's size value parsed to bytes, or default; outside minimum..maximum is refused (with hint)."""
        value = self.raw(key, default)
        if value is default:
            return value
        size = parse_bytes(value, where=self.key_path(key), error=self._error)
        if not minimum <= size <= maximum:
            raise self.fail(
                key,
                f"expected {format_bytes(minimum) if minimum else 0}..{format_bytes(maximum)}, "
                f"got {format_bytes(size) if size else 0}",
                hint=hint or None,
            )
        return size

    def duration(
        self,
        key: str,
        default: Any = _MISSING,
        *,
        minimum: float = 0.0,
        maximum: float = MAX_DURATION_S,
        hint: str = "",
    ) -> float:
        """The key's duration value parsed to seconds, or default; outside minimum..maximum is refused."""
        value = self.raw(key, default)
        if value is default:
            return value
        seconds = parse_duration(value, where=self.key_path(key), error=self._error)
        if not minimum <= seconds <= maximum:
            raise self.fail(
                key,
                f"expected {format_seconds(minimum) if minimum else 0}..{format_seconds(maximum)}, "
                f"got {format_seconds(seconds) if seconds else 0}",
                hint=hint or None,
            )
        return seconds

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
            raise self.fail(key, f"expected a list of integers, got {excerpt(value)}")
        return tuple(value)

    def text_list(self, key: str, default: Any = _MISSING) -> tuple[str, ...]:
        """A list of non-empty strings."""
        value = self.raw(key, default)
        if value is default and default is not _MISSING:
            return value
        if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
            raise self.fail(key, f"expected a list of non-empty strings, got {excerpt(value)}")
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
