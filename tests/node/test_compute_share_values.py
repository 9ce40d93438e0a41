"""Compute shares the agent accepts and refuses (one line each), and the default share."""

from __future__ import annotations

import pytest

from gpunode.errors import InvalidComputeShare
from gpunode.node.memcap.compute import parse_compute_share, share_from_memory

GIB = 2**30


@pytest.mark.parametrize(
    ("value", "milli"), [("1", 1), ("250", 250), (" 1000 ", 1000), (700, 700), ("5.0", 5)]
)
def test_shares_accepted(value: object, milli: int) -> None:
    assert parse_compute_share(value) == milli


@pytest.mark.parametrize(
    ("value", "says"),
    [
        ("0", "must be above zero"),
        ("-5", "must be above zero"),
        ("1001", "more than one GPU"),
        ("2500", "more than one GPU"),
        ("abc", "not a number"),
        ("nan", "not a number"),
        ("inf", "not a number"),
        ("", "not a number"),
        (True, "not a number"),
        ("12.5", "finer than the unit"),
        ("0.3", "finer than the unit"),
    ],
)
def test_bad_shares_are_refused_with_one_line(value: object, says: str) -> None:
    with pytest.raises(InvalidComputeShare) as err:
        parse_compute_share(value)
    message = str(err.value)
    assert says in message and "gpunode.io/gpu-milli" in message and "\n" not in message
    assert "\n" not in err.value.hint and "1 to 1000" in err.value.hint


def test_default_share_follows_the_memory_share() -> None:
    assert share_from_memory(4 * GIB, 16 * GIB) == 250
    assert share_from_memory(1, 80 * GIB) == 1  # never zero: a share of zero would never run
    assert share_from_memory(80 * GIB, 80 * GIB) == 1000
    assert share_from_memory(0, 0) == 1000  # nothing known: the whole GPU (measured, never starved)
