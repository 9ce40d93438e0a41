"""The agent's checkpoint of the memory caps it handed out, so a restart loses nothing.

One JSON file (state_dir/checkpoint.json), written atomically (temporary file,
fsync, rename) after every Allocate that creates a cap. Each record names the
region key, the resource, the device IDs, the GPU and the limit. On start-up
the agent re-creates any region whose files vanished, so every container keeps
its cap; the kubelet (pod-resources) stays the source of truth for which
containers still exist, and regions of containers it no longer lists are
garbage-collected after a grace period. A checkpoint that cannot be parsed is
kept aside (renamed, never deleted) and reported; the agent starts with an
empty one. Loading it (once, at start) also removes the temporary files that
a killed agent left in the state directory (see remove_stale_temp_files). This
module does file I/O only; it knows nothing of gRPC.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import threading
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path

from gpunode.node.files import write_atomically

log = logging.getLogger(__name__)

VERSION = 1
FILE_NAME = "checkpoint.json"
# ".<name>.<pid>.tmp": how gpunode.node.files.write_atomically stages a file before renaming it into
# place (the checkpoint, the staged interposer in lib/, a region's ld.so.preload).
TEMP_FILE_RE = re.compile(r"\.(?P<name>.+)\.(?P<pid>[0-9]{1,10})\.tmp")


@dataclass(frozen=True)
class CapRecord:
    """One cap handed out, as checkpointed: region key, resource, device IDs, the capped device and its limit.

    Sizes are bytes; fail_open is the region's fail-open flag (an unusable usage file lets allocations
    through instead of refusing them).
    """

    key: str  # memcap region key (inventory.region_key of the device IDs)
    resource: str
    device_ids: tuple[str, ...]
    gpu_uuid: str  # the UUID the cap applies to (MIG UUID for a MIG replica)
    limit_bytes: int
    device_total_bytes: int
    fail_open: bool
    created: float  # unix seconds


class Checkpoint:
    """Thread-safe view of the checkpoint file."""

    def __init__(self, state_dir: Path) -> None:
        self.path = Path(state_dir) / FILE_NAME
        self._lock = threading.Lock()
        self._records: dict[str, CapRecord] = {}
        self.problem: str | None = None  # why the file on disk could not be used, if so

    def load(self) -> dict[str, CapRecord]:
        """Read the file; a broken one is renamed aside and reported, never lost. Removes stale temporary
        files first (it runs at start, before this process stages any file)."""
        remove_stale_temp_files(self.path.parent)
        with self._lock:
            self._records = {}
            try:
                text = self.path.read_text()
            except FileNotFoundError:
                return {}
            try:
                doc = json.loads(text)
                if not isinstance(doc, dict) or doc.get("version") != VERSION:
                    raise ValueError(
                        f"unknown checkpoint version {doc.get('version') if isinstance(doc, dict) else doc!r}"
                    )
                for item in doc.get("caps", []):
                    rec = CapRecord(**{**item, "device_ids": tuple(item["device_ids"])})
                    self._records[rec.key] = rec
            except (ValueError, TypeError, KeyError) as exc:
                aside = self.path.with_name(f"{FILE_NAME}.corrupt-{int(time.time())}")
                os.replace(self.path, aside)
                self.problem = f"{self.path} could not be read ({exc}); kept as {aside.name}"
                log.error("checkpoint: %s; starting with an empty checkpoint", self.problem)
                self._records = {}
            return dict(self._records)

    def records(self) -> dict[str, CapRecord]:
        """A copy of the records held now, by region key."""
        with self._lock:
            return dict(self._records)

    def replace(self, record: CapRecord) -> None:
        """Record a cap that replaced whatever was held under its key (a fresh region), and rewrite the file."""
        with self._lock:
            self._records[record.key] = record
            self._write()

    def add(self, record: CapRecord) -> None:
        """Record a cap and rewrite the file; a key held already with the same limit keeps its record."""
        with self._lock:
            if self._records.get(record.key) == record:
                return
            existing = self._records.get(record.key)
            if existing is not None and existing.limit_bytes == record.limit_bytes:
                return  # the same devices allocated again (container restart): keep the first record
            self._records[record.key] = record
            self._write()

    def remove(self, keys: Iterable[str]) -> None:
        """Drop the records of `keys`, rewriting the file only when one of them was held."""
        with self._lock:
            gone = [k for k in keys if self._records.pop(k, None) is not None]
            if gone:
                self._write()

    def _write(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        doc = {
            "version": VERSION,
            "caps": [asdict(r) for r in sorted(self._records.values(), key=lambda r: r.key)],
        }
        write_atomically(self.path, json.dumps(doc, indent=1), sync_dir=True)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    except (OverflowError, OSError):
        return False
    return True


def remove_stale_temp_files(state_dir: Path) -> list[Path]:
    """Remove the ``.<name>.<pid>.tmp`` files a killed agent left in state_dir, lib/ and the region
    directories; the paths removed.

    A file is stale when its pid is no live process, or is this process's own pid (a restarted agent
    in a container often gets the pid its predecessor had; call this before staging any file). A file
    of another live process is kept: it may be another agent's write in progress.
    """
    state_dir = Path(state_dir)
    dirs = [state_dir, state_dir / "lib"]
    regions = state_dir / "memcap"
    with contextlib.suppress(OSError):
        dirs += [d for d in regions.iterdir() if d.is_dir() and not d.is_symlink()]
    removed = []
    own = os.getpid()
    for directory in dirs:
        try:
            entries = list(directory.iterdir())
        except OSError:
            continue
        for entry in entries:
            match = TEMP_FILE_RE.fullmatch(entry.name)
            if match is None or (entry.is_dir() and not entry.is_symlink()):
                continue
            pid = int(match.group("pid"))
            if pid != own and _pid_alive(pid):
                continue
            try:
                entry.unlink()
            except FileNotFoundError:
                continue
            except OSError as exc:
                log.warning("cannot remove the stale temporary file %s: %s", entry, exc)
                continue
            removed.append(entry)
    if removed:
        log.info("removed %d stale temporary file(s) in %s", len(removed), state_dir)
    return removed
