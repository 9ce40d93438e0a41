"""The simulator rules file: defaults, the example file, stable team hashing, and one message per mistake."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

from gpunode.cluster.timesim.rules import SimRules, hashed_team, load_rules, parse_rules
from gpunode.errors import SimRulesError

EXAMPLE = Path(__file__).resolve().parents[3] / "gpunode" / "examples" / "sim-rules.yaml"


def test_the_example_file_states_the_defaults() -> None:
    assert load_rules(EXAMPLE) == SimRules() == load_rules(None)


def test_team_hash_is_stable_and_follows_the_shares() -> None:
    teams = {"a": 4.0, "b": 3.0, "c": 2.0, "d": 1.0}
    assert hashed_team("openb-pod-0001", teams) == hashed_team("openb-pod-0001", dict(teams))
    counts = Counter(hashed_team(f"openb-pod-{i:04d}", teams) for i in range(20000))
    for team, share in teams.items():
        assert counts[team] / 20000 == pytest.approx(share / 10, abs=0.02)
    assert hashed_team("x", {"only": 1.0}) == "only"


def test_queue_and_priority_by_qos() -> None:
    rules = parse_rules(
        {"queues": {"by": "qos", "qos": {"LS": "prod"}, "default": "batch"}, "priority": {"by": "qos"}}, "r"
    )
    assert rules.queues.queue_of("p", "LS") == "prod"
    assert rules.queues.queue_of("p", "BE") == "batch"
    assert rules.queues.names() == ("prod", "batch")
    assert rules.priority.qos["LS"] == 1


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"replay": {"horizn": "1h"}}, "r.yaml: replay: unknown key horizn (did you mean horizon?)"),
        ({"replay": {"horizon": "10s"}}, "r.yaml: replay.horizon: expected 1m..7d, got 10s"),
        ({"replay": {"unscheduled": "guess"}}, "replay.unscheduled: expected one of sample, lifetime, drop"),
        ({"replay": {"maxJobs": 0}}, "replay.maxJobs: expected 1..10000000, got 0"),
        ({"queues": {"by": "team"}}, "queues.by: expected one of hash, qos"),
        ({"queues": {"teams": {"a": -1}}}, "queues.teams.a: expected a non-negative number"),
        ({"queues": {"teams": {"a": 0}}}, "queues.teams: the shares add up to 0"),
        ({"queues": {"teams": ["a", "b"]}}, "queues.teams: expected a mapping"),
        ({"gangs": {"share": 1.5}}, "gangs.share: expected a 0..1 number, got 1.5"),
        ({"gangs": {"members": [1]}}, "gangs.members: expected pod counts within 2..64"),
        ({"estimates": {"mode": True}}, "estimates.mode: expected str, got bool"),
        ({"estimates": {"bias": 0}}, "estimates.bias: expected a 0.01..100 number, got 0"),
        ({"checkpoint": {"cost": "soon"}}, "checkpoint.cost: expected a duration"),
        ({"metrics": {"window": "1s"}}, "metrics.window: expected 1m..7d, got 1s"),
        ({"extra": 1}, "r.yaml: unknown key extra"),
        ([1, 2], "r.yaml: expected a mapping"),
    ],
)
def test_each_mistake_has_its_message(data: object, message: str) -> None:
    with pytest.raises(SimRulesError) as exc:
        parse_rules(data, "r.yaml")
    assert message in str(exc.value)
    assert "\n" not in str(exc.value) and exc.value.hint


def test_an_estimate_bias_is_read() -> None:
    assert (
        parse_rules({"estimates": {"mode": "noisy", "sigma": 1.0, "bias": 0.5}}, "r.yaml").estimates.bias
        == 0.5
    )
    assert parse_rules({}, "r.yaml").estimates.bias == 1.0


def test_unreadable_and_invalid_files(tmp_path: Path) -> None:
    with pytest.raises(SimRulesError, match="cannot read the simulator rules"):
        load_rules(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("replay: [unclosed\n")
    with pytest.raises(SimRulesError, match="not valid YAML"):
        load_rules(bad)
    big = tmp_path / "big.yaml"
    big.write_text("#" * 70000)
    with pytest.raises(SimRulesError, match="larger than"):
        load_rules(big)
