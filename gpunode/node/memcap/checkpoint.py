"""The agent's checkpoint of the memory caps it handed out, so a restart loses nothing.

One small JSON file per cap, state_dir/checkpoint.d/<region key>.json, written
atomically (temporary file, fsync, rename, directory fsync) when an Allocate
creates the cap and unlinked when its region is removed: an Allocate writes
one file of a few hundred bytes whatever the number of caps held, and a crash
loses at most the cap being written (whose Allocate has not answered yet).
Each record names the region key, the resource, the device IDs, the GPU and the
limit. On start-up the agent re-creates any region whose files vanished, so
every container keeps its cap; the kubelet (pod-resources) stays the source of
truth for which containers still exist, and regions of containers it no longer
lists are garbage-collected after a grace period. A record that cannot be
parsed is kept aside (renamed, never deleted) and reported; the others load.
The old format, one state_dir/checkpoint.json for every cap, is read once at
start: its records are written as files, then it is removed (a broken one is
kept aside as before). Loading (once, at start) also removes the temporary
files that a killed agent left in the state directory (see
remove_stale_temp_files). This module does file I/O only; it knows nothing of gRPC.
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
FILE_NAME = "checkpoint.json"  # the old format: every cap in one file, read once for the upgrade
DIR_NAME = "checkpoint.d"  # one <key>.json per cap
RECORD_RE = re.compile(r"(?P<key>[0-9a-f]{1,64})\.json")
MAX_RECORD_BYTES = 64 * 1024  # a record is a few hundred bytes; a bigger file is not one of ours
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


def _record(item: object) -> CapRecord:
    """A CapRecord from its JSON form; ValueError/TypeError/KeyError when it is not one."""
    if not isinstance(item, dict):
        raise ValueError(f"a cap record is an object, got {type(item).__name__}")
    rec = CapRecord(**{**item, "device_ids": tuple(item["device_ids"])})
    if not RECORD_RE.fullmatch(f"{rec.key}.json"):
        raise ValueError(f"bad region key {rec.key!r}")
    return rec


class Checkpoint:
    """Thread-safe view of the checkpoint directory, with the caps held per capped GPU."""

    def __init__(self, state_dir: Path) -> None:
        self.state_dir = Path(state_dir)
        self.path = self.state_dir / FILE_NAME  # the old single file
        self.dir = self.state_dir / DIR_NAME
        self._lock = threading.Lock()
        self._records: dict[str, CapRecord] = {}
        self._by_gpu: dict[str, dict[str, None]] = {}  # capped UUID -> keys, oldest first
        self.problem: str | None = None  # why a file on disk could not be used, if so
        self.writes = 0  # record files written since start (for tests and the bench)

    def load(self) -> dict[str, CapRecord]:
        """Read the records; a broken file is renamed aside and reported, never lost. Upgrades an old
        checkpoint.json. Removes stale temporary files first (it runs at start, before this process
        stages any file)."""
        remove_stale_temp_files(self.state_dir)
        with self._lock:
            self._records = {}
            self._by_gpu = {}
            try:
                names = sorted(os.listdir(self.dir))
            except FileNotFoundError:
                names = []
            for name in names:
                if RECORD_RE.fullmatch(name):
                    self._load_file(self.dir / name)
            self._upgrade()
            return dict(self._records)

    def _load_file(self, path: Path) -> None:
        try:
            with open(path, "rb") as f:
                text = f.read(MAX_RECORD_BYTES + 1)
            if len(text) > MAX_RECORD_BYTES:
                raise ValueError(f"more than {MAX_RECORD_BYTES} bytes")
            rec = _record(json.loads(text))
            if f"{rec.key}.json" != path.name:
                raise ValueError(f"it holds the record of {rec.key}")
        except OSError as exc:
            self._report(f"{path} could not be read ({exc.strerror or exc})")
            return
        except (ValueError, TypeError, KeyError) as exc:
            self._set_aside(path, exc)
            return
        self._hold(rec)

    def _upgrade(self) -> None:
        """Turn an old checkpoint.json into one file per cap, then remove it (kept aside when broken)."""
        try:
            text = self.path.read_text()
        except FileNotFoundError:
            return
        except OSError as exc:
            self._report(f"{self.path} could not be read ({exc.strerror or exc})")
            return
        try:
            doc = json.loads(text)
            if not isinstance(doc, dict) or doc.get("version") != VERSION:
                raise ValueError(
                    f"unknown checkpoint version {doc.get('version') if isinstance(doc, dict) else doc!r}"
                )
            old = [_record(item) for item in doc.get("caps", [])]
        except (ValueError, TypeError, KeyError) as exc:
            self._set_aside(self.path, exc)
            return
        for rec in old:
            if rec.key not in self._records:  # a file written since is newer than the old checkpoint
                self._write(rec, sync_dir=False)
                self._hold(rec)
        _sync_dir(self.dir)  # every record is in place before the old file goes
        self.path.unlink()
        _sync_dir(self.state_dir)
        log.info("checkpoint: %d cap(s) of %s moved to %s/", len(old), self.path.name, self.dir)

    def _set_aside(self, path: Path, exc: Exception) -> None:
        aside = path.with_name(f"{path.name}.corrupt-{int(time.time())}")
        os.replace(path, aside)
        self._report(f"{path} could not be read ({exc}); kept as {aside.name}")

    def _report(self, problem: str) -> None:
        self.problem = problem if self.problem is None else f"{self.problem}; {problem}"
        log.error("checkpoint: %s; its cap is not restored", problem)

    def _hold(self, rec: CapRecord) -> None:
        old = self._records.get(rec.key)
        if old is not None:
            self._by_gpu.get(old.gpu_uuid, {}).pop(rec.key, None)
        self._records[rec.key] = rec
        self._by_gpu.setdefault(rec.gpu_uuid, {})[rec.key] = None

    def _drop(self, key: str) -> bool:
        rec = self._records.pop(key, None)
        if rec is None:
            return False
        keys = self._by_gpu.get(rec.gpu_uuid, {})
        keys.pop(key, None)
        if not keys:
            self._by_gpu.pop(rec.gpu_uuid, None)
        return True

    def records(self) -> dict[str, CapRecord]:
        """A copy of the records held now, by region key."""
        with self._lock:
            return dict(self._records)

    def get(self, key: str) -> CapRecord | None:
        """The record of one region key, or None."""
        with self._lock:
            return self._records.get(key)

    def keys_on(self, gpu_uuid: str) -> list[str]:
        """The keys of the caps on one capped UUID, oldest first."""
        with self._lock:
            return list(self._by_gpu.get(gpu_uuid, ()))

    def count_on(self, gpu_uuid: str) -> int:
        """How many caps one capped UUID has."""
        with self._lock:
            return len(self._by_gpu.get(gpu_uuid, ()))

    def replace(self, record: CapRecord) -> None:
        """Record a cap that replaced whatever was held under its key (a fresh region): one file written."""
        with self._lock:
            self._write(record)
            self._drop(record.key)
            self._hold(record)

    def remove(self, keys: Iterable[str]) -> None:
        """Drop the records of `keys`, unlinking their files (the directory is synced once)."""
        with self._lock:
            gone = [k for k in keys if self._drop(k)]
            for key in gone:
                with contextlib.suppress(FileNotFoundError):
                    (self.dir / f"{key}.json").unlink()
            if gone:
                _sync_dir(self.dir)

    def _write(self, record: CapRecord, *, sync_dir: bool = True) -> None:
        if not self.dir.is_dir():
            self.dir.mkdir(parents=True, exist_ok=True)
            _sync_dir(self.state_dir)
        write_atomically(self.dir / f"{record.key}.json", json.dumps(asdict(record)), sync_dir=sync_dir)
        self.writes += 1


def _sync_dir(path: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        dir_fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)


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
    """Remove the ``.<name>.<pid>.tmp`` files a killed agent left in state_dir, lib/ (and its layout-<N>/),
    checkpoint.d/, status/ and the region directories; the paths removed (see remove_stale_temps)."""
    state_dir = Path(state_dir)
    dirs = [state_dir, state_dir / "lib", state_dir / DIR_NAME, state_dir / "status"]
    with contextlib.suppress(OSError):  # the staged interposers, one directory per region layout
        dirs += [d for d in (state_dir / "lib").iterdir() if d.is_dir() and d.name.startswith("layout-")]
    return remove_stale_temps(dirs, region_roots=[state_dir / "memcap"])


def remove_stale_temps(dirs: Iterable[Path], *, region_roots: Iterable[Path] = ()) -> list[Path]:
    """Remove the ``.<name>.<pid>.tmp`` files a killed agent left in `dirs` and in every region directory
    of `region_roots`; the paths removed.

    A file is stale when its pid is no live process, or is this process's own pid (a restarted agent
    in a container often gets the pid its predecessor had; call this before staging any file). A file
    of another live process is kept: it may be another agent's write in progress.
    """
    dirs = list(dirs)
    for regions in region_roots:
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
        log.info(
            "removed %d stale temporary file(s): %s", len(removed), ", ".join(str(p) for p in removed[:5])
        )
    return removed
