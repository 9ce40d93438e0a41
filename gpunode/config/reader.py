"""Small, strict readers for configuration mappings.

Every part of gpunode that owns a configuration section parses it with a
SectionReader, so that all sections report errors the same way: the file, the
dotted key, what was expected and what was found. A reader refuses unknown keys
when it is finished, so a typo never passes silently; load_yaml refuses a key
given twice for the same reason. This module only parses text and values; it
never reads files or the environment (config.py does).
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import yaml

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
                others = [str(k) for k in self._data if k != key]
                close = difflib.get_close_matches(key, others, n=1)
                typo = f" (is {close[0]} a misspelling of it?)" if close else ""
                raise ConfigError(f"{self.key_path(key)}: required key is missing{typo}")
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


def parse_resource_name(name: str, where: str, *, default_domain: str = "nvidia.com") -> str:
    """A Kubernetes extended resource name; a bare name gets `default_domain/` (as the NVIDIA plugin does)."""
    full = name if "/" in name else f"{default_domain}/{name}"
    domain, _, short = full.partition("/")
    if (
        not re.fullmatch(r"[a-z0-9]([-a-z0-9.]*[a-z0-9])?", domain)
        or len(domain) > 253
        or not re.fullmatch(r"[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?", short)
        or len(short) > 63
    ):
        raise ConfigError(
            f"{where}: {name!r} is not a valid extended resource name",
            hint="use domain/name (e.g. nvidia.com/gpu.shared): a DNS domain, then at most 63 letters, "
            "digits, '-', '_' or '.', starting and ending with a letter or digit",
        )
    return full


class _StrictLoader(yaml.SafeLoader):
    """A SafeLoader that refuses a key given twice in one mapping (plain YAML keeps the last silently)."""


def _construct_unique_mapping(loader: _StrictLoader, node: yaml.MappingNode) -> dict[Any, Any]:
    seen: set[object] = set()
    for key_node, _ in node.value:
        key = loader.construct_object(key_node)
        try:
            duplicate = key in seen
            seen.add(key)
        except TypeError:  # an unhashable key: construct_mapping reports it
            continue
        if duplicate:
            raise yaml.constructor.ConstructorError(
                "while reading a mapping",
                node.start_mark,
                f"the key {key!r} is given twice",
                key_node.start_mark,
            )
    return loader.construct_mapping(node)


_StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_unique_mapping)

# YAML 1.1 reads 1:0 as the base-60 number 60; a MIG index such as "1:0" must stay a string.
# Keep every implicit type except int and float, then add both back without their base-60 forms.
_INT, _FLOAT = "tag:yaml.org,2002:int", "tag:yaml.org,2002:float"
_StrictLoader.yaml_implicit_resolvers = {
    first: [(tag, rx) for tag, rx in resolvers if tag not in (_INT, _FLOAT)]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_StrictLoader.add_implicit_resolver(
    _INT,
    re.compile(r"^(?:[-+]?0b[0-1_]+|[-+]?0[0-7_]+|[-+]?(?:0|[1-9][0-9_]*)|[-+]?0x[0-9a-fA-F_]+)$"),
    list("-+0123456789"),
)
_StrictLoader.add_implicit_resolver(
    _FLOAT,
    re.compile(
        r"^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+][0-9]+)?|\.[0-9][0-9_]*(?:[eE][-+][0-9]+)?"
        r"|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$"
    ),
    list("-+0123456789."),
)


def load_yaml(text: str, *, where: str) -> Any:
    """Parse YAML (or JSON) text safely; errors name `where` with the line and column."""
    try:
        return yaml.load(text, Loader=_StrictLoader)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or str(exc)
        raise ConfigError(f"{where}: not valid YAML{at}: {problem}") from None
