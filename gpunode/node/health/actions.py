"""What both remediators share: the structured action log, backoff, the eviction rate limit, a bounded memory.

Every remediation step (an eviction asked for, a signal sent, a hook run, an
Event posted, a step skipped in dry-run) is one ActionRecord, written to the
`gpunode.remediation` logger as one JSON line and kept in a bounded in-memory
journal that tests and metrics read. Nothing here talks to Kubernetes or to
processes.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Hashable
from dataclasses import asdict, dataclass
from typing import Any

from gpunode.node.health.model import Fault

action_log = logging.getLogger("gpunode.remediation")

JOURNAL_SIZE = 1000


@dataclass(frozen=True)
class ActionRecord:
    """One remediation step, as logged."""

    action: str  # evict | delete | event | annotate-node | sigterm | sigkill | hook | lookup | ...
    result: str  # requested | done | blocked | failed | skipped | dry-run | gone | exited ...
    gpu_uuid: str = ""
    mig_uuid: str | None = None
    fault: str = ""  # fault kind
    xid: int | None = None
    reason: str = ""  # the fault's reason
    namespace: str = ""
    pod: str = ""
    pid: int | None = None
    attempts: int = 0
    detail: str = ""
    dry_run: bool = False
    at: float = 0.0  # time.time()

    def to_json(self) -> str:
        """The record as one JSON line, "event": "remediation", leaving out empty, None and zero fields."""
        data = {k: v for k, v in asdict(self).items() if v not in (None, "", 0) or k in ("result", "action")}
        data["dry_run"] = self.dry_run
        return json.dumps({"event": "remediation", **data}, sort_keys=True)


class Journal:
    """The last JOURNAL_SIZE action records, thread-safe; each record is also logged as JSON."""

    def __init__(self, size: int = JOURNAL_SIZE) -> None:
        self._lock = threading.Lock()
        self._records: deque[ActionRecord] = deque(maxlen=size)
        self.counts: dict[tuple[str, str], int] = {}  # (action, result) -> count, for the metrics

    def add(self, record: ActionRecord) -> ActionRecord:
        """Keep, count and log the record, stamped with time.time() when `at` is unset; returns what was kept.

        Failed and blocked steps are logged at WARNING, others at INFO.
        """
        if not record.at:
            record = ActionRecord(**{**asdict(record), "at": time.time()})
        with self._lock:
            self._records.append(record)
            key = (record.action, record.result)
            self.counts[key] = self.counts.get(key, 0) + 1
        level = logging.WARNING if record.result in ("failed", "blocked") else logging.INFO
        action_log.log(level, "%s", record.to_json())
        return record

    def records(self, action: str | None = None) -> list[ActionRecord]:
        """The kept records, oldest first; only those of `action` when given."""
        with self._lock:
            return [r for r in self._records if action is None or r.action == action]


def fault_fields(fault: Fault) -> dict[str, Any]:
    """The ActionRecord fields that name a fault."""
    return {
        "gpu_uuid": fault.gpu_uuid,
        "mig_uuid": fault.mig_uuid,
        "fault": fault.kind,
        "xid": fault.xid,
        "reason": fault.reason,
    }


class Backoff:
    """Exponential backoff with full jitter between initial_s and max_s."""

    def __init__(self, initial_s: float, max_s: float, *, rng: random.Random | None = None) -> None:
        self.initial_s = initial_s
        self.max_s = max_s
        self._next = initial_s
        self._rng = rng or random.Random()

    def next_delay(self) -> float:
        """Next delay in s, uniform in [d/2, d]; d starts at initial_s and doubles per call up to max_s."""
        delay = self._rng.uniform(self._next / 2, self._next)
        self._next = min(self._next * 2, self.max_s)
        return delay


class RateLimiter:
    """At most `limit` starts per `interval_s`, node-wide (a token bucket refilled continuously)."""

    def __init__(self, limit: int, interval_s: float, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.limit = limit
        self.interval_s = interval_s
        self._clock = clock
        self._tokens = float(limit)
        self._stamp = clock()
        self._lock = asyncio.Lock()

    def _refill(self) -> None:
        now = self._clock()
        self._tokens = min(self.limit, self._tokens + (now - self._stamp) * self.limit / self.interval_s)
        self._stamp = now

    async def acquire(self) -> float:
        """Wait for a token; returns the seconds waited."""
        waited = 0.0
        async with self._lock:
            while True:
                self._refill()
                if self._tokens >= 1.0:
                    self._tokens -= 1.0
                    return waited
                delay = (1.0 - self._tokens) * self.interval_s / self.limit
                waited += delay
                await asyncio.sleep(delay)


class Memory:
    """A bounded set that forgets its oldest entries: "this pod was already evicted"."""

    def __init__(self, size: int = 10000) -> None:
        self._items: OrderedDict[Hashable, None] = OrderedDict()
        self._size = size

    def __contains__(self, key: Hashable) -> bool:
        return key in self._items

    def add(self, key: Hashable) -> None:
        """Remember `key` as the newest entry, forgetting the oldest beyond the size."""
        self._items[key] = None
        self._items.move_to_end(key)
        while len(self._items) > self._size:
            self._items.popitem(last=False)
