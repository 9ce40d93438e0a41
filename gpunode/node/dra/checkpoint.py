"""The DRA plugin's write-ahead record of claims: nothing is created for a claim before it is recorded.

One file per claim, `<stateDir>/dra/claims/<claim UID>.json` (directory 0700, files 0600, written
atomically and fsynced), with the claim's plan and a state:

- `preparing`: written before the region and the CDI spec are made. Found at start, it means the
  agent stopped mid-prepare: whatever of the claim exists (region, spec) is removed with the record,
  and the kubelet's retry prepares the claim afresh, once.
- `prepared`: written after both exist, with the CDI device IDs returned. A second
  NodePrepareResources for the claim returns them again and creates nothing.

NodeUnprepareResources removes the spec, then the region, then the record, so a crash part-way
leaves a record that the kubelet's retry (or the next start, for `preparing`) finishes removing.
"""

from __future__ import annotations

import contextlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpunode.node.dra.claims import ClaimPlan, check_uid
from gpunode.node.files import write_atomically

PREPARING, PREPARED = "preparing", "prepared"
DIR_MODE, FILE_MODE = 0o700, 0o600
MAX_RECORD_BYTES = 256 * 1024


@dataclass(frozen=True)
class ClaimRecord:
    """One claim's record."""

    state: str  # PREPARING | PREPARED
    plan: ClaimPlan
    region: str | None  # the region key, when a device is capped
    cdi_ids: tuple[str, ...] = ()  # per allocation result, in plan order (PREPARED)

    def as_json(self) -> dict[str, Any]:
        """The record as written to its file."""
        return {
            "state": self.state,
            "plan": self.plan.as_json(),
            "region": self.region,
            "cdi": list(self.cdi_ids),
        }


class ClaimCheckpoint:
    """The records under root (state_dir/dra/claims)."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def _path(self, uid: str) -> Path:
        return self.root / f"{check_uid(uid)}.json"

    def write(self, record: ClaimRecord) -> None:
        """Record the claim (replacing its record) durably before returning. Raises OSError."""
        self.root.mkdir(mode=DIR_MODE, parents=True, exist_ok=True)
        data = json.dumps(record.as_json(), sort_keys=True)
        write_atomically(self._path(record.plan.claim.uid), data, mode=FILE_MODE, sync_dir=True)

    def load(self, uid: str) -> ClaimRecord | None:
        """The claim's record, or None. A record that does not read back is a ValueError naming it."""
        path = self._path(uid)
        try:
            with open(path, "rb") as f:
                raw = f.read(MAX_RECORD_BYTES + 1)
        except FileNotFoundError:
            return None
        try:
            if len(raw) > MAX_RECORD_BYTES:
                raise ValueError("too large")
            data = json.loads(raw)
            record = ClaimRecord(
                state=data["state"] if data["state"] in (PREPARING, PREPARED) else PREPARING,
                plan=ClaimPlan.from_json(data["plan"]),
                region=None if data["region"] is None else str(data["region"]),
                cdi_ids=tuple(str(x) for x in data["cdi"]),
            )
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise ValueError(f"{path}: the record does not read back ({exc})") from None
        if record.plan.claim.uid != uid:
            raise ValueError(f"{path}: the record is of claim {record.plan.claim.uid}")
        return record

    def remove(self, uid: str) -> None:
        """Forget the claim (no error if it was not recorded)."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self._path(uid))

    def uids(self) -> list[str]:
        """The UIDs of every recorded claim (names that are not UIDs are left alone)."""
        try:
            names = os.listdir(self.root)
        except FileNotFoundError:
            return []
        out = []
        for name in sorted(names):
            stem = name.removesuffix(".json")
            if name.endswith(".json") and not name.startswith("."):
                with contextlib.suppress(Exception):
                    out.append(check_uid(stem))
        return out
