"""The queue configuration file: the example, the tree forms, defaults, and one message per mistake."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml

from gpunode.cluster.queueing.config import MAX_FILE_BYTES, load_queue_config, parse_queue_config
from gpunode.errors import ConfigError, QueueConfigError

EXAMPLE = Path(__file__).resolve().parents[3] / "gpunode" / "examples" / "queues.yaml"
GIB = 2**30
TIB = 2**40


def base() -> dict[str, Any]:
    """A valid two-level configuration the mistakes below are made in."""
    return {
        "queues": [
            {
                "name": "org",
                "guarantee": {"gpu": 64, "gpu_memory": "2Ti"},
                "children": [
                    {"name": "team-a", "weight": 3, "guarantee": {"gpu": 40, "gpu/V100M32": 8}},
                    {
                        "name": "team-b",
                        "guarantee": {"gpu": 0.5, "gpu_memory": "64Gi"},
                        "borrowLimit": {"gpu": 8},
                    },
                ],
            },
            {"name": "other", "weight": 2, "priority": 5},
        ]
    }


def test_the_example_file_loads_with_four_teams_weighted_4_3_2_1() -> None:
    cfg = load_queue_config(EXAMPLE)
    assert cfg.root_names == ("org",)
    assert cfg.leaves == ("team-a", "team-b", "team-c", "team-d")
    assert [cfg.queues[q].weight for q in cfg.leaves] == [4.0, 3.0, 2.0, 1.0]
    assert all(cfg.queues[q].parent == "org" for q in cfg.leaves)
    assert cfg.fair_share.half_life_s == 7200.0 and cfg.fair_share.window_s == 86400.0
    assert cfg.fair_share.k == 1.0
    assert (cfg.preemption.notice_s, cfg.preemption.min_runtime_s) == (300.0, 600.0)
    assert cfg.backfill.enabled and cfg.backfill.default_runtime_s == 3600.0
    assert cfg.backfill.reservations == 32
    assert cfg.backfill.reservations_per_queue == 8
    assert cfg.backfill.reserve_after_s == 0.0
    assert cfg.gang_timeout_s == 1800.0 and cfg.energy_weight == 0.0 and cfg.placement_policy == "gpunode"


def test_units_inheritance_and_defaults() -> None:
    cfg = parse_queue_config(base(), "q.yaml")
    org, a, b, other = (cfg.queues[n] for n in ("org", "team-a", "team-b", "other"))
    # GPUs become milli-GPU, sizes bytes; org states gpu and memory, and inherits its children's V100 sum
    assert org.guarantee == {"gpu": 64_000, "gpu_memory": 2 * TIB, "gpu/V100M32": 8_000}
    assert a.guarantee == {"gpu": 40_000, "gpu/V100M32": 8_000}
    assert b.guarantee == {"gpu": 500, "gpu_memory": 64 * GIB}
    assert b.borrow_limit == {"gpu": 8_000} and a.borrow_limit is None
    assert cfg.limit("team-b") == {"gpu": 8_500} and cfg.limit("team-a") is None
    assert (a.weight, b.weight, other.weight) == (3.0, 1.0, 2.0)
    assert (org.priority, a.priority, other.priority) == (0, 0, 5)
    assert org.children == ("team-a", "team-b") and a.parent == "org" and other.parent is None
    assert cfg.leaves == ("team-a", "team-b", "other") and cfg.root_names == ("org", "other")
    assert cfg.ancestors("team-b") == ("org",) and cfg.leaves_under("org") == ("team-a", "team-b")
    assert a.where == "q.yaml: queues[0].children[0]"


def test_flat_parent_references_build_the_same_tree_as_nesting() -> None:
    flat = {
        "queues": [
            {"name": "team-x", "parent": "lab", "guarantee": {"gpu": 2}},
            {"name": "lab", "parent": "org", "priority": 7},
            {"name": "org"},
            {"name": "team-y", "parent": "lab", "weight": 0.25},
        ]
    }
    cfg = parse_queue_config(flat, "flat.yaml")
    assert list(cfg.queues) == ["org", "lab", "team-x", "team-y"]  # parents first
    assert cfg.queues["lab"].children == ("team-x", "team-y")
    assert cfg.ancestors("team-y") == ("lab", "org")
    assert cfg.queues["org"].guarantee == {"gpu": 2000}  # summed up two levels
    assert cfg.queues["team-x"].priority == 7  # inherited from its parent


def test_a_parent_reference_that_agrees_with_the_nesting_is_accepted() -> None:
    data = {"queues": [{"name": "org", "children": [{"name": "a", "parent": "org"}]}]}
    assert parse_queue_config(data, "q.yaml").queues["a"].parent == "org"


def test_a_file_that_cannot_be_read_is_one_queue_config_error(tmp_path: Path) -> None:
    with pytest.raises(QueueConfigError, match="cannot read the queue configuration"):
        load_queue_config(tmp_path / "missing.yaml")
    broken = tmp_path / "broken.yaml"
    broken.write_text("queues: [ {name: a\n")
    with pytest.raises(QueueConfigError, match=r"broken.yaml: not valid YAML at line \d+") as exc:
        load_queue_config(broken)
    assert isinstance(exc.value, ConfigError) and exc.value.exit_code == 2
    twice = tmp_path / "twice.yaml"
    twice.write_text("queues: [{name: a}]\nqueues: [{name: b}]\n")
    with pytest.raises(QueueConfigError, match="given twice"):
        load_queue_config(twice)
    huge = tmp_path / "huge.yaml"
    huge.write_bytes(b"#" * (MAX_FILE_BYTES + 1))
    with pytest.raises(QueueConfigError, match="larger than 1Mi"):
        load_queue_config(huge)
    binary = tmp_path / "binary.yaml"
    binary.write_bytes(b"queues: \xff\xfe\n")
    with pytest.raises(QueueConfigError, match="not UTF-8"):
        load_queue_config(binary)


def edit(path: str, value: Any) -> dict[str, Any]:
    """base() with the value at a dotted path (list indexes as numbers) set; value DELETE removes the key."""
    data = base()
    *parents, last = path.split(".")
    node: Any = data
    for part in parents:
        node = node[int(part)] if part.isdigit() else node[part]
    if value is DELETE:
        del node[last]
    elif last.isdigit():
        node[int(last)] = value
    else:
        node[last] = value
    return data


DELETE = object()
Q0 = "q.yaml: queues[0]"
A = f"{Q0}.children[0]"
B = f"{Q0}.children[1]"

# (case id, the invalid document, the exact message)
MISTAKES: list[tuple[str, dict[str, Any], str]] = [
    ("not-a-mapping", [1, 2], "q.yaml: expected a mapping, got list [1, 2]"),  # type: ignore[list-item]
    ("no-queues", {"fairShare": {}}, "q.yaml: queues: required key is missing"),
    ("empty-queues", {"queues": []}, "q.yaml: queues: expected at least one queue"),
    ("unknown-top-key", edit("fairshare", {}), "q.yaml: unknown key fairshare (did you mean fairShare?)"),
    (
        "unknown-queue-key",
        edit("queues.1.wieght", 2),
        "q.yaml: queues[1]: unknown key wieght (did you mean weight?)",
    ),
    (
        "unknown-resource",
        edit("queues.0.children.0.guarantee.gpus", 1),
        f"{A}.guarantee: unknown key gpus (did you mean gpu?)",
    ),
    (
        "queue-not-a-mapping",
        edit("queues.1", "other"),
        "q.yaml: queues[1]: expected a mapping, got str 'other'",
    ),
    ("name-not-text", edit("queues.1.name", 5), "q.yaml: queues[1].name: expected str, got int 5"),
    (
        "guarantee-not-a-mapping",
        edit("queues.0.children.0.guarantee", 8),
        f"{A}.guarantee: expected a mapping, got int 8",
    ),
    (
        "weight-bool",
        edit("queues.1.weight", True),
        "q.yaml: queues[1].weight: expected a number above 0, got True",
    ),
    (
        "bad-model-name",
        edit("queues.0.children.0.guarantee.gpu/has space", 1),
        f"{A}.guarantee.gpu/has space: expected gpu/<model>, a GPU model name such as gpu/A100-SXM4-80GB",
    ),
    (
        "priority-too-large",
        edit("queues.1.priority", 10**10),
        "q.yaml: queues[1].priority: expected -1000000000..1000000000, got 10000000000",
    ),
    ("missing-name", edit("queues.1.name", DELETE), "q.yaml: queues[1].name: required key is missing"),
    (
        "bad-name",
        edit("queues.1.name", "has space"),
        "q.yaml: queues[1].name: 'has space' is not a valid queue name",
    ),
    (
        "duplicate-name",
        edit("queues.1.name", "team-a"),
        f"q.yaml: queues[1].name: the queue name team-a is given twice (first at {A})",
    ),
    ("zero-weight", edit("queues.1.weight", 0), "q.yaml: queues[1].weight: expected a number above 0, got 0"),
    (
        "negative-weight",
        edit("queues.1.weight", -1.5),
        "q.yaml: queues[1].weight: expected a number above 0, got -1.5",
    ),
    (
        "text-weight",
        edit("queues.1.weight", "high"),
        "q.yaml: queues[1].weight: expected a number above 0, got 'high'",
    ),
    (
        "negative-quota",
        edit("queues.0.children.0.guarantee.gpu", -2),
        f"{A}.guarantee.gpu: a quota cannot be negative, got -2",
    ),
    (
        "negative-memory",
        edit("queues.0.children.1.guarantee.gpu_memory", -5),
        f"{B}.guarantee.gpu_memory: a size cannot be negative, got -5",
    ),
    (
        "bad-memory-unit",
        edit("queues.0.children.1.guarantee.gpu_memory", "64 gallons"),
        f"{B}.guarantee.gpu_memory: expected a size such as 10Gi, 512MiB or a number of bytes, got '64 gallons'",
    ),
    (
        "milli-fraction",
        edit("queues.0.children.0.guarantee.gpu", 0.0005),
        f"{A}.guarantee.gpu: GPUs are counted in thousandths, got 0.0005",
    ),
    (
        "gpu-as-text",
        edit("queues.0.children.0.guarantee.gpu", "8 GPUs"),
        f"{A}.guarantee.gpu: expected a number of GPUs such as 8 or 0.5, got '8 GPUs'",
    ),
    (
        "empty-model",
        edit("queues.0.children.0.guarantee.gpu/", 1),
        f"{A}.guarantee.gpu/: expected gpu/<model>, a GPU model name such as gpu/A100-SXM4-80GB",
    ),
    (
        "children-above-parent",
        edit("queues.0.children.0.guarantee.gpu", 64),
        f"{Q0}.guarantee.gpu: the children of org are guaranteed 64.5 GPUs in all, more than its own 64 GPUs",
    ),
    (
        "children-memory-above-parent",
        edit("queues.0.guarantee.gpu_memory", "32Gi"),
        f"{Q0}.guarantee.gpu_memory: the children of org are guaranteed 64Gi in all, more than its own 32Gi",
    ),
    (
        "borrow-on-the-only-root",
        {"queues": [{"name": "org", "borrowLimit": {"gpu": 4}, "children": [{"name": "a"}]}]},
        f"{Q0}.borrowLimit: org is the only top-level queue, so it has nobody to borrow from",
    ),
    (
        "negative-borrow",
        edit("queues.0.children.1.borrowLimit.gpu", -1),
        f"{B}.borrowLimit.gpu: a quota cannot be negative, got -1",
    ),
    (
        "unknown-parent",
        edit("queues.1.parent", "orgg"),
        "q.yaml: queues[1].parent: no queue is named orgg",
    ),
    (
        "own-parent",
        edit("queues.1.parent", "other"),
        "q.yaml: queues[1].parent: other names itself as its parent",
    ),
    (
        "nested-and-other-parent",
        edit("queues.0.children.0.parent", "other"),
        f"{A}.parent: team-a is listed among the children of org but names other as its parent",
    ),
    (
        "cycle",
        {
            "queues": [
                {"name": "a", "parent": "c"},
                {"name": "b", "parent": "a"},
                {"name": "c", "parent": "b"},
            ]
        },
        "q.yaml: queues[0].parent: the queues a -> c -> b -> a form a cycle",
    ),
    (
        "children-not-a-list",
        edit("queues.0.children", {"name": "x"}),
        f"{Q0}.children: expected a list, got dict",
    ),
    (
        "priority-text",
        edit("queues.1.priority", "high"),
        "q.yaml: queues[1].priority: expected an integer, got 'high'",
    ),
    (
        "zero-half-life",
        {**base(), "fairShare": {"halfLife": 0}},
        "q.yaml: fairShare.halfLife: expected a duration above 0, got 0",
    ),
    (
        "negative-window",
        {**base(), "fairShare": {"window": -5}},
        "q.yaml: fairShare.window: a duration cannot be negative, got -5",
    ),
    (
        "bad-duration-unit",
        {**base(), "fairShare": {"halfLife": "2 days"}},
        "q.yaml: fairShare.halfLife: expected a duration such as 500ms, 30s or 5m, got '2 days'",
    ),
    (
        "negative-k",
        {**base(), "fairShare": {"k": -1}},
        "q.yaml: fairShare.k: expected a 0..100 number, got -1",
    ),
    (
        "unknown-fairshare-key",
        {**base(), "fairShare": {"halflife": "2h"}},
        "q.yaml: fairShare: unknown key halflife (did you mean halfLife?)",
    ),
    (
        "reclaim-not-bool",
        {**base(), "preemption": {"reclaim": "yes"}},
        "q.yaml: preemption.reclaim: expected true or false, got 'yes'",
    ),
    (
        "idle-first-not-bool",
        {**base(), "preemption": {"idleFirst": "on"}},
        "q.yaml: preemption.idleFirst: expected true or false, got 'on'",
    ),
    (
        "idle-minimum-not-a-duration",
        {**base(), "preemption": {"idleMinimum": "soon"}},
        "q.yaml: preemption.idleMinimum: expected a duration such as 500ms, 30s or 5m, got 'soon'",
    ),
    (
        "share-reclaim-below-the-share",
        {**base(), "preemption": {"shareReclaim": {"above": 0.5}}},
        "q.yaml: preemption.shareReclaim.above: expected a 1..100 number, got 0.5",
    ),
    (
        "share-reclaim-unknown-key",
        {**base(), "preemption": {"shareReclaim": {"abov": 1.5}}},
        "q.yaml: preemption.shareReclaim: unknown key abov (did you mean above?)",
    ),
    (
        "share-reclaim-after-not-a-duration",
        {**base(), "preemption": {"shareReclaim": {"after": "an hour"}}},
        "q.yaml: preemption.shareReclaim.after: expected a duration such as 500ms, 30s or 5m, got 'an hour'",
    ),
    (
        "zero-default-runtime",
        {**base(), "backfill": {"defaultRuntime": "0s"}},
        "q.yaml: backfill.defaultRuntime: expected a duration above 0, got 0",
    ),
    (
        "zero-reservations",
        {**base(), "backfill": {"reservations": 0}},
        "q.yaml: backfill.reservations: expected 1..64, got 0",
    ),
    (
        "negative-reservations-per-queue",
        {**base(), "backfill": {"reservationsPerQueue": -1}},
        "q.yaml: backfill.reservationsPerQueue: expected 0..64, got -1",
    ),
    (
        "reserve-after-not-a-duration",
        {**base(), "backfill": {"reserveAfter": "an hour"}},
        "q.yaml: backfill.reserveAfter: expected a duration such as 500ms, 30s or 5m, got 'an hour'",
    ),
    (
        "negative-overdue-remaining",
        {**base(), "backfill": {"overdueRemaining": -0.5}},
        "q.yaml: backfill.overdueRemaining: expected a 0..10 number, got -0.5",
    ),
    (
        "overdue-remaining-too-large",
        {**base(), "backfill": {"overdueRemaining": 1e300}},
        "q.yaml: backfill.overdueRemaining: expected a 0..10 number, got 1e+300",
    ),
    (
        "overdue-remaining-not-finite",
        {**base(), "backfill": {"overdueRemaining": float("nan")}},
        "q.yaml: backfill.overdueRemaining: expected a 0..10 number, got nan",
    ),
    (
        "reservations-not-an-integer",
        {**base(), "backfill": {"reservations": "four"}},
        "q.yaml: backfill.reservations: expected an integer, got 'four'",
    ),
    (
        "gang-timeout-too-long",
        {**base(), "gang": {"timeout": "200h"}},
        "q.yaml: gang.timeout: a duration must be at most 7d, got 200h",
    ),
    (
        "energy-above-one",
        {**base(), "energy": {"weight": 1.5}},
        "q.yaml: energy.weight: expected a 0..1 number, got 1.5",
    ),
    (
        "unknown-policy",
        {**base(), "placement": {"policy": "best"}},
        "q.yaml: placement.policy: expected one of fgd, bestfit, packing, spread, random, dotprod, gpunode, "
        "got 'best'",
    ),
    (
        "namespace-not-dns1123",
        {**base(), "namespaces": {"Team_A": "team-a"}},
        "q.yaml: namespaces.Team_A: 'Team_A' is not a valid namespace name",
    ),
    (
        "namespace-too-long",
        {**base(), "namespaces": {"n" * 64: "team-a"}},
        f"q.yaml: namespaces.{'n' * 64}: '{'n' * 56}... is not a valid namespace name",
    ),
    (
        "namespace-unknown-queue",
        {**base(), "namespaces": {"team-a-ns": "team-z"}},
        "q.yaml: namespaces.team-a-ns: no queue is named 'team-z'",
    ),
    (
        "namespace-non-leaf-queue",
        {**base(), "namespaces": {"team-a-ns": "org"}},
        "q.yaml: namespaces.team-a-ns: org is not a leaf queue (it has children: team-a, team-b)",
    ),
    (
        "namespaces-not-a-mapping",
        {**base(), "namespaces": ["team-a-ns"]},
        "q.yaml: namespaces: expected a mapping, got list ['team-a-ns']",
    ),
]


@pytest.mark.parametrize(
    ("data", "message"), [(d, m) for _, d, m in MISTAKES], ids=[i for i, _, _ in MISTAKES]
)
def test_each_mistake_is_refused_with_its_own_message(data: Any, message: str) -> None:
    before = copy.deepcopy(data)
    with pytest.raises(QueueConfigError) as exc:
        parse_queue_config(data, "q.yaml")
    assert str(exc.value) == message
    assert exc.value.hint and "\n" not in exc.value.hint
    assert exc.value.exit_code == 2
    assert data == before  # validation never changes the document it reads


def test_the_mistakes_table_has_one_message_per_case() -> None:
    messages = [m for _, _, m in MISTAKES]
    assert len(set(messages)) == len(messages)


def test_idle_first_is_off_by_default_and_read_with_its_minimum() -> None:
    pre = parse_queue_config(base(), "q.yaml").preemption
    assert (pre.idle_first, pre.idle_minimum_s) == (False, 0.0)
    data = {**base(), "preemption": {"idleFirst": True, "idleMinimum": "15m"}}
    pre = parse_queue_config(data, "q.yaml").preemption
    assert (pre.idle_first, pre.idle_minimum_s) == (True, 900.0)


def _share_reclaim(data: dict[str, Any]) -> tuple[float | None, float, float | None, bool]:
    pre = parse_queue_config(data, "q.yaml").preemption
    return pre.share_above, pre.share_after_s, pre.share_loss_budget, pre.share_keeps_reservations


def test_share_reclaim_is_on_unless_turned_off_and_read_with_its_defaults() -> None:
    defaults = (1.0, 0.0, 0.008, True)
    assert _share_reclaim(base()) == defaults
    above, _, budget, _ = _share_reclaim({**base(), "preemption": {"shareReclaim": False}})
    assert above is None and budget is None
    assert _share_reclaim({**base(), "preemption": {"shareReclaim": {}}}) == defaults
    given = {"above": 2, "after": "30m", "lossBudget": False, "keepReservations": False}
    assert _share_reclaim({**base(), "preemption": {"shareReclaim": given}}) == (2.0, 1800.0, None, False)


def test_namespaces_map_to_leaf_queues() -> None:
    assert parse_queue_config(base(), "q.yaml").namespaces == {}
    data = {**base(), "namespaces": {"team-a-ns": "team-a", "0-lab": "other", "b": "team-b"}}
    cfg = parse_queue_config(data, "q.yaml")
    assert cfg.namespaces == {"team-a-ns": "team-a", "0-lab": "other", "b": "team-b"}


def test_too_deep_a_tree_is_refused() -> None:
    node: dict[str, Any] = {"name": "q17"}
    for level in range(16, 0, -1):
        node = {"name": f"q{level}", "children": [node]}
    with pytest.raises(QueueConfigError, match="queues nest more than 16 levels deep"):
        parse_queue_config({"queues": [node]}, "q.yaml")


def test_the_documented_example_is_valid() -> None:
    doc = (Path(__file__).resolve().parents[3] / "docs" / "queueing.md").read_text()
    section = doc.split("## Queue configuration", 1)[1]
    text = section.split("```yaml\n", 1)[1].split("```", 1)[0]
    cfg = parse_queue_config(yaml.safe_load(text), "docs/queueing.md")
    assert cfg.queues["lab-x"].parent == "org" and cfg.leaves == ("team-a", "team-b", "lab-x")
    assert cfg.queues["team-b"].priority == 10 and cfg.limit("team-b") == {"gpu": 16_000}
    assert cfg.queues["org"].guarantee == {"gpu": 64_000, "gpu_memory": 2 * TIB, "gpu/V100M32": 8_000}


def test_too_many_queues_are_refused() -> None:
    data = {"queues": [{"name": f"q{i}"} for i in range(1001)]}
    with pytest.raises(QueueConfigError, match=r"q.yaml: queues: more than 1000 queues"):
        parse_queue_config(data, "q.yaml")
