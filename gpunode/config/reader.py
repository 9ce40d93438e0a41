"""Configuration text: strict YAML (a key given twice is refused) and Kubernetes resource names.

Sections are read with gpunode.contract.reader.SectionReader (with parse_bytes
and parse_duration), the one strict reader, shared with the node-state
annotation, so every section reports errors the same way: the file, the dotted
key, what was expected and what was found. This module only parses text and
values; it never reads files or the environment (config.agent does).
"""

from __future__ import annotations

import re
from typing import Any

import yaml

from gpunode.contract.names import NVIDIA_DOMAIN
from gpunode.contract.reader import excerpt
from gpunode.errors import ConfigError


def parse_resource_name(name: str, where: str, *, default_domain: str = NVIDIA_DOMAIN) -> str:
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
            f"{where}: {excerpt(name)} is not a valid extended resource name",
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


def excerpt_text(text: str, limit: int = 120) -> str:
    """`text` cut to `limit` characters: a parser's own message may quote the file; ours quote a little."""
    return text if len(text) <= limit else f"{text[: limit - 3]}..."


def load_yaml(text: str, *, where: str) -> Any:
    """Parse YAML (or JSON) text safely; errors name `where` with the line and column."""
    try:
        return yaml.load(text, Loader=_StrictLoader)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = excerpt_text(getattr(exc, "problem", None) or str(exc))
        if "given twice" in problem:
            hint = "give each key once: plain YAML would silently keep only the last one"
        elif isinstance(exc, yaml.constructor.ConstructorError):
            hint = "write plain YAML values: tags such as !!python/object are not read"
        else:
            hint = (
                "fix the YAML syntax at that line: an unclosed quote or bracket, a tab, or indentation; "
                "`gpunode devices --config FILE` checks a file without starting anything"
            )
        raise ConfigError(f"{where}: not valid YAML{at}: {problem}", hint=hint) from None
    except RecursionError:
        raise ConfigError(
            f"{where}: not valid configuration: lists or mappings nested too deeply",
            hint="a configuration file nests a few levels deep; check the brackets",
        ) from None
    except ValueError as exc:  # e.g. an integer of thousands of digits
        raise ConfigError(
            f"{where}: not valid configuration: {str(exc).split(';')[0]}",
            hint="numbers in a configuration file are small; check for a runaway value",
        ) from None
