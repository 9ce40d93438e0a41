"""The chart's values schema refuses what the agent refuses: every count and list bound in
helm/gpunode/values.schema.json is the agent's own (so `helm install` fails early, with the same range),
and a value one past the bound fails the schema as it fails parse_config."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from gpunode.config import health, sharing
from gpunode.config.agent import MAX_PATH_CHARS, parse_config
from gpunode.errors import ConfigError

SCHEMA = json.loads(
    (Path(__file__).resolve().parents[2] / "helm" / "gpunode" / "values.schema.json").read_text()
)
CONFIG = {**SCHEMA["properties"]["config"], "definitions": SCHEMA["definitions"]}
GPUNODE = CONFIG["properties"]["gpunode"]["properties"]
HEALTH = GPUNODE["health"]["properties"]
REMEDIATION = GPUNODE["remediation"]["properties"]
RESOURCES = CONFIG["properties"]["sharing"]["properties"]["timeSlicing"]["properties"]["resources"]
SELECTOR = SCHEMA["definitions"]["deviceSelector"]["anyOf"][1]


@pytest.mark.parametrize(
    ("schema_value", "agent_value"),
    [
        pytest.param(
            lambda: RESOURCES["items"]["properties"]["replicas"]["maximum"],
            sharing.MAX_REPLICAS,
            id="replicas",
        ),
        pytest.param(lambda: RESOURCES["maxItems"], sharing.MAX_SHARED_RESOURCES, id="resources"),
        pytest.param(lambda: SELECTOR["maxItems"], sharing.MAX_SELECTOR_ITEMS, id="device-list"),
        pytest.param(
            lambda: SELECTOR["items"]["anyOf"][0]["maximum"], sharing.MAX_DEVICE_INDEX, id="device-index"
        ),
        pytest.param(lambda: SELECTOR["items"]["anyOf"][1]["maxLength"], sharing.MAX_UUID_CHARS, id="uuid"),
        pytest.param(
            lambda: GPUNODE["fractional"]["properties"]["unit"]["anyOf"][0]["maximum"],
            sharing.MAX_UNIT_BYTES,
            id="unit-max",
        ),
        pytest.param(
            lambda: GPUNODE["fractional"]["properties"]["unit"]["anyOf"][0]["minimum"],
            sharing.MIN_UNIT_BYTES,
            id="unit-min",
        ),
        pytest.param(lambda: SCHEMA["definitions"]["absolutePath"]["maxLength"], MAX_PATH_CHARS, id="paths"),
        pytest.param(
            lambda: HEALTH["xid"]["properties"]["countThreshold"]["maximum"],
            health.XID_COUNT_THRESHOLD[1],
            id="count-threshold",
        ),
        pytest.param(
            lambda: HEALTH["xid"]["properties"]["fatal"]["maxItems"], health.MAX_XID_CODES, id="xid-list"
        ),
        pytest.param(
            lambda: HEALTH["xid"]["properties"]["ignored"]["items"]["maximum"],
            health.MAX_XID_CODE,
            id="xid-code",
        ),
        pytest.param(
            lambda: HEALTH["ecc"]["properties"]["singleBitThreshold"]["maximum"],
            health.SBE_THRESHOLD[1],
            id="sbe",
        ),
        pytest.param(
            lambda: REMEDIATION["maxEvictions"]["maximum"], health.MAX_EVICTIONS[1], id="max-evictions"
        ),
        pytest.param(
            lambda: REMEDIATION["baremetal"]["properties"]["hook"]["maxItems"],
            health.MAX_HOOK_ARGS,
            id="hook",
        ),
    ],
)
def test_the_schema_bound_is_the_agents_bound(schema_value: Any, agent_value: int) -> None:
    assert schema_value() == agent_value


@pytest.mark.parametrize(
    "doc",
    [
        pytest.param(
            {"sharing": {"timeSlicing": {"resources": [{"name": "nvidia.com/gpu", "replicas": 49}]}}},
            id="replicas",
        ),
        pytest.param({"gpunode": {"fractional": {"unit": "1GB"}}}, id="decimal-unit"),
        pytest.param({"gpunode": {"fractional": {"unit": 2**41}}}, id="unit-bytes"),
        pytest.param({"gpunode": {"health": {"xid": {"fatal": [1000]}}}}, id="xid-code"),
        pytest.param({"gpunode": {"health": {"xid": {"countThreshold": 10_001}}}}, id="count-threshold"),
        pytest.param({"gpunode": {"remediation": {"maxEvictions": 1_000_001}}}, id="max-evictions"),
        pytest.param({"gpunode": {"remediation": {"baremetal": {"hook": ["x"] * 65}}}}, id="hook"),
    ],
)
def test_one_past_the_bound_fails_the_schema_and_the_agent(doc: dict[str, Any]) -> None:
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(doc, CONFIG)
    with pytest.raises(ConfigError):
        parse_config(doc, "values.yaml")
