"""Leader election on a coordination.k8s.io/v1 Lease, with the semantics of client-go's leaderelection.

Candidates share one Lease. Its holder renews it (spec.renewTime) every retry period; the
others read it every retry period (jittered) and take it over only once the record has not
changed for spec.leaseDurationSeconds as measured by their own clock since they last saw it
change: no clock is compared with another machine's. Every write is guarded by the Lease's
metadata.resourceVersion, so of two candidates writing the same version one gets 409 Conflict
and stays a candidate. A holder that has not renewed successfully for renew_deadline_s (counted
from the moment it sent its last successful renewal) stops leading by itself, even while its
renewal requests hang; since renew_deadline_s < lease_duration_s it has stopped before any other
candidate may take over (clocks running at the same rate is the one assumption).

acquireTime is set when a candidate takes the Lease over (leaseTransitions then goes up by one)
and kept while it renews; release() (on shutdown) leaves the Lease with no holder and a 1 s
duration, so that a standby takes over at its next retry instead of waiting out the lease.

LeaderElector.is_leader() may be called from any thread. This module imports nothing from
gpunode.node or gpunode.cluster.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import random
import socket
import threading
import time
import uuid
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any
from urllib.parse import quote

from lightkube.resources.coordination_v1 import Lease

from gpunode.contract.reader import parse_duration
from gpunode.errors import ConfigError, KubeConflict, KubeError, KubeNotFound
from gpunode.infra.kube.client import KubeClient
from gpunode.infra.kube.transport import decode, resource_path

log = logging.getLogger(__name__)
JITTER = 1.2  # client-go's JitterFactor: a candidate waits retry x (1 + up to 1.2) between reads


def micro_time(moment: datetime | None = None) -> str:
    """A metav1.MicroTime: RFC 3339 in UTC with microseconds."""
    return (moment or datetime.now(UTC)).astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def candidate_identity(given: str, pod_name: str | None) -> str:
    """`given` (--leader-elect-identity), else <pod>_<random>, the pod being `pod_name` or this host."""
    return given or f"{pod_name or socket.gethostname()}_{uuid.uuid4().hex[:8]}"


@dataclass(frozen=True)
class ElectionConfig:
    """Where the Lease is, who this candidate is, and the timing (client-go's names and defaults).

    ConfigError unless lease_duration_s > renew_deadline_s > JITTER x retry_period_s > 0 and the
    names are set.
    """

    namespace: str
    name: str
    identity: str
    lease_duration_s: float = 15.0
    renew_deadline_s: float = 10.0
    retry_period_s: float = 2.0

    @classmethod
    def from_flags(cls, args: argparse.Namespace, identity: str) -> ElectionConfig:
        """The election the --leader-elect-* flags describe, for candidate `identity`. ConfigError for a
        bad flag."""
        return cls(
            namespace=args.leader_elect_namespace,
            name=args.leader_elect_lease_name,
            identity=identity,
            lease_duration_s=parse_duration(
                args.leader_elect_lease_duration, where="--leader-elect-lease-duration"
            ),
            renew_deadline_s=parse_duration(
                args.leader_elect_renew_deadline, where="--leader-elect-renew-deadline"
            ),
            retry_period_s=parse_duration(
                args.leader_elect_retry_period, where="--leader-elect-retry-period"
            ),
        )

    def __post_init__(self) -> None:
        if not self.namespace or not self.name or not self.identity:
            raise ConfigError(
                "leader election needs the Lease's namespace and name and this candidate's identity",
                hint="set --leader-elect-namespace, --leader-elect-lease-name and --leader-elect-identity",
            )
        if not self.lease_duration_s > self.renew_deadline_s > JITTER * self.retry_period_s > 0:
            raise ConfigError(
                f"leader election timing: lease duration {self.lease_duration_s:g} s, renew deadline "
                f"{self.renew_deadline_s:g} s, retry period {self.retry_period_s:g} s do not go together",
                hint="keep lease duration > renew deadline > 1.2 x retry period > 0 (defaults 15s, 10s, 2s)",
            )


@dataclass(frozen=True)
class LeaseRecord:
    """The spec of a Lease as the election reads it, and the resourceVersion it was read at."""

    holder: str
    lease_duration_s: int
    acquire_time: str
    renew_time: str
    transitions: int
    resource_version: str = ""

    @property
    def content(self) -> tuple[str, int, str, str, int]:
        """What a change of the record is judged by."""
        return self.holder, self.lease_duration_s, self.acquire_time, self.renew_time, self.transitions


def _time_text(value: Any) -> str:
    return micro_time(value) if isinstance(value, datetime) else str(value or "")


class LeaseLock:
    """Reads, creates and updates one Lease (each call made once; errors are KubeError)."""

    def __init__(self, client: KubeClient, namespace: str, name: str) -> None:
        self.client, self.namespace, self.name = client, namespace, name
        self._collection = resource_path(Lease, namespace)
        self._path = f"{self._collection}/{quote(name, safe='')}"

    def _what(self, verb: str) -> str:
        return f"{verb} lease {self.namespace}/{self.name}"

    def _record(self, raw: bytes, what: str) -> LeaseRecord:
        lease = decode(raw, Lease, what)
        spec, meta = lease.spec, lease.metadata
        return LeaseRecord(
            holder=(spec.holderIdentity if spec else None) or "",
            lease_duration_s=(spec.leaseDurationSeconds if spec else None) or 0,
            acquire_time=_time_text(spec.acquireTime if spec else None),
            renew_time=_time_text(spec.renewTime if spec else None),
            transitions=(spec.leaseTransitions if spec else None) or 0,
            resource_version=(meta.resourceVersion if meta else None) or "",
        )

    def _body(self, record: LeaseRecord) -> dict[str, Any]:
        meta: dict[str, str] = {"name": self.name, "namespace": self.namespace}
        if record.resource_version:
            meta["resourceVersion"] = record.resource_version
        spec: dict[str, Any] = {
            "holderIdentity": record.holder,
            "leaseDurationSeconds": record.lease_duration_s,
            "leaseTransitions": record.transitions,
        }
        if record.acquire_time:
            spec["acquireTime"] = record.acquire_time
        if record.renew_time:
            spec["renewTime"] = record.renew_time
        return {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease", "metadata": meta, "spec": spec}

    async def get(self) -> LeaseRecord | None:
        """The Lease as it is now; None when there is none."""
        what = self._what("get")
        try:
            raw = await self.client.transport.request("GET", self._path, what=what)
        except KubeNotFound:
            return None
        return self._record(raw, what)

    async def create(self, record: LeaseRecord) -> LeaseRecord:
        """Create the Lease; KubeConflict when another candidate created it first."""
        what = self._what("create")
        raw = await self.client.transport.request(
            "POST", self._collection, body=self._body(record), what=what
        )
        return self._record(raw, what)

    async def update(self, record: LeaseRecord) -> LeaseRecord:
        """Replace the Lease, only if it is still at record.resource_version (KubeConflict otherwise)."""
        what = self._what("update")
        raw = await self.client.transport.request("PUT", self._path, body=self._body(record), what=what)
        return self._record(raw, what)


class LeaderElector:
    """One candidate: run() campaigns, leads (calling on_started, renewing) and campaigns again when it
    loses the Lease (calling on_stopped); cancelling run() releases the Lease if held."""

    def __init__(
        self,
        lock: LeaseLock,
        config: ElectionConfig,
        *,
        on_started: Callable[[], Coroutine[Any, Any, None]] | None = None,
        on_stopped: Callable[[], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.lock, self.config = lock, config
        self.on_started, self.on_stopped = on_started, on_stopped
        self._clock = clock
        self._guard = threading.Lock()
        self._valid_until = 0.0  # monotonic: leading until then, unless renewed
        self._observed: LeaseRecord | None = None
        self._observed_at = 0.0  # monotonic: when the record was last seen to change

    # -- state, from any thread ---------------------------------------------------------------

    def is_leader(self, *, margin_s: float = 0.0) -> bool:
        """Whether this candidate leads now and will for margin_s more seconds without renewing."""
        with self._guard:
            return self._clock() + margin_s < self._valid_until

    def takeover_in(self) -> float:
        """Seconds until another candidate could take the Lease over; 0 when this one does not lead.

        Others wait lease_duration_s from when they saw the last renewal, which this candidate sent
        renew_deadline_s before its leadership ends: the difference is the margin beyond that end.
        """
        with self._guard:
            now = self._clock()
            if now >= self._valid_until:
                return 0.0
            return self._valid_until + self.config.lease_duration_s - self.config.renew_deadline_s - now

    @property
    def leader(self) -> str:
        """The holder identity last seen on the Lease ("" when none)."""
        with self._guard:
            return self._observed.holder if self._observed is not None else ""

    def _lead_until(self, deadline: float) -> None:
        with self._guard:
            self._valid_until = deadline

    # -- one step --------------------------------------------------------------------------------

    async def try_acquire_or_renew(self) -> bool:
        """Take or renew the Lease once; True when this candidate holds it afterwards."""
        cfg = self.config
        sent = self._clock()
        now = micro_time()
        mine = LeaseRecord(cfg.identity, max(1, round(cfg.lease_duration_s)), now, now, 0)
        try:
            old = await self.lock.get()
            if old is None:
                return self._won(await self.lock.create(mine), sent)
            if self._observed is None or self._observed.content != old.content:
                with self._guard:
                    self._observed, self._observed_at = old, self._clock()
            expires = self._observed_at + old.lease_duration_s
            if old.holder and old.holder != cfg.identity:
                self._lead_until(0.0)  # whatever this candidate believed, another holds the Lease now
                if self._clock() < expires:
                    return False  # and it has not expired as far as this candidate has seen
            if old.holder == cfg.identity:
                mine = LeaseRecord(
                    cfg.identity,
                    mine.lease_duration_s,
                    old.acquire_time,
                    now,
                    old.transitions,
                    old.resource_version,
                )
            else:
                mine = LeaseRecord(
                    cfg.identity, mine.lease_duration_s, now, now, old.transitions + 1, old.resource_version
                )
            return self._won(await self.lock.update(mine), sent)
        except KubeConflict:
            return False  # another candidate wrote first
        except KubeError as exc:
            log.warning("leader election: %s", exc)
            return False

    def _won(self, record: LeaseRecord, sent: float) -> bool:
        with self._guard:
            self._observed, self._observed_at = record, self._clock()
            self._valid_until = sent + self.config.renew_deadline_s
        return True

    async def release(self) -> bool:
        """Give the Lease up if this candidate holds it (no holder, 1 s duration); True when released."""
        held = self._observed
        self._lead_until(0.0)
        if held is None or held.holder != self.config.identity:
            return False
        now = micro_time()
        try:
            await self.lock.update(LeaseRecord("", 1, now, now, held.transitions, held.resource_version))
        except KubeError as exc:
            log.warning("leader election: could not release the lease: %s", exc)
            return False
        return True

    # -- the loop ----------------------------------------------------------------------------------

    async def run(self) -> None:
        """Campaign and lead until cancelled; on cancellation stop leading and release the Lease."""
        cfg = self.config
        try:
            while True:
                while not await self.try_acquire_or_renew():
                    await asyncio.sleep(cfg.retry_period_s * (1 + random.random() * JITTER))
                log.info("leader election: %s leads (lease %s/%s)", cfg.identity, cfg.namespace, cfg.name)
                started: asyncio.Task[None] | None = None
                if self.on_started is not None:
                    started = asyncio.create_task(self.on_started())
                try:
                    await self._renew()
                    log.warning("leader election: %s lost the lease; campaigning again", cfg.identity)
                finally:
                    self._lead_until(0.0)
                    if started is not None:
                        started.cancel()
                        await asyncio.gather(started, return_exceptions=True)
                    if self.on_stopped is not None:
                        self.on_stopped()
        finally:
            with contextlib.suppress(Exception):
                async with asyncio.timeout(self.lock.client.request_timeout_s):
                    await self.release()

    async def _renew(self) -> None:
        """Renew every retry period; return once the renew deadline has passed without a renewal."""
        cfg = self.config
        while True:
            await asyncio.sleep(cfg.retry_period_s)
            left = self._valid_until - self._clock()
            if left <= 0:
                return
            try:
                async with asyncio.timeout(left):
                    await self.try_acquire_or_renew()
            except TimeoutError:
                pass
            if not self.is_leader():
                return
