"""The regions root: listing regions, their modes on the host, removing and garbage-collecting them.

Listing opens every region through the guarded C wrappers (region.load_region),
so a usage file a container truncated or rewrote makes that region unusable
(recorded in problems.PROBLEMS and logged once), never the agent. Garbage
collection only renames and removes directories: it never reads a region.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import stat
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

from gpunode.errors import RegionDamaged
from gpunode.node.memcap.problems import PROBLEMS, RegionProblem
from gpunode.node.memcap.region import (
    _KEY_RE,
    _TEMP_PREFIXES,
    REGION_DIR_MODE,
    REGIONS_ROOT_MODE,
    STALE_TEMP_AGE_S,
    Region,
    _check_key,
    _io_error,
    load_region,
)

log = logging.getLogger("gpunode.node.memcap")


def _region_dirs(root: Path) -> Iterator[Path]:
    try:
        entries = sorted(root.iterdir())
    except FileNotFoundError:
        return
    except OSError as exc:
        raise _io_error(f"cannot list regions in {root}", exc, root) from exc
    for entry in entries:
        if _KEY_RE.fullmatch(entry.name) and entry.is_dir() and not entry.is_symlink():
            yield entry


def scan_regions(root: str | os.PathLike[str]) -> tuple[tuple[Region, ...], tuple[RegionProblem, ...]]:
    """The valid regions under root and the problems of the unusable ones, by key; logs and records nothing.

    A directory removed while it is read (garbage collection, a replacement) is neither.
    """
    regions: list[Region] = []
    problems: list[RegionProblem] = []
    for path in _region_dirs(Path(root)):
        try:
            regions.append(load_region(path))
        except RegionDamaged as exc:
            if path.is_dir():
                problems.append(RegionProblem.of(path, exc))
    return tuple(regions), tuple(problems)


def list_regions(root: str | os.PathLike[str]) -> tuple[Region, ...]:
    """The valid regions under root, by key. Unusable ones are left out and recorded (logged once each:
    see region_problems); gc_regions removes them with their container."""
    regions, problems = scan_regions(root)
    for problem in problems:
        PROBLEMS.bad(problem.path, RegionDamaged(problem.message, key=problem.key, reason=problem.reason))
    for region in regions:
        PROBLEMS.good(region.path)
    return regions


def secure_root(root: str | os.PathLike[str]) -> list[Path]:
    """Create root if needed and make it and every region directory in it root-only (0700).

    Containers get their files through bind mounts, which the runtime sets up as root, so no one
    else needs to reach them; the usage files themselves stay writable by any uid for the
    container's processes. Returns the directories whose mode was tightened.
    """
    root = Path(root)
    tightened = []
    try:
        root.mkdir(parents=True, exist_ok=True)
        for path, mode in [(root, REGIONS_ROOT_MODE)] + [(p, REGION_DIR_MODE) for p in _region_dirs(root)]:
            if stat.S_IMODE(path.lstat().st_mode) != mode:
                os.chmod(path, mode)
                tightened.append(path)
    except OSError as exc:
        raise _io_error(f"cannot set the modes of the memory-cap regions in {root}", exc, root) from exc
    if tightened:
        log.info("memory caps: made %d director(ies) under %s root-only", len(tightened), root)
    return tightened


def remove_region(root: str | os.PathLike[str], key: str) -> bool:
    """Remove a region; False if it did not exist. Processes still mapping it keep their mapping."""
    root = Path(root)
    path = root / _check_key(key)
    if not path.exists():
        return False
    trash = root / f".trash-{key}-{os.urandom(4).hex()}"
    try:
        os.rename(path, trash)
    except FileNotFoundError:
        return False
    except OSError as exc:
        raise _io_error(f"cannot remove region {path}", exc, root) from exc
    shutil.rmtree(trash, ignore_errors=True)
    log.debug("removed memory-cap region %s", path)
    return True


def _changed_since(path: Path, since: float | None) -> bool:
    if since is None:
        return False
    try:
        st = path.lstat()
    except OSError:
        return True
    return max(st.st_mtime, st.st_ctime) >= since


def gc_regions(
    root: str | os.PathLike[str], keep: Iterable[str], *, changed_since: float | None = None
) -> tuple[str, ...]:
    """Remove every region whose key is not in keep (and stale half-made ones); the keys removed.

    changed_since (seconds since the epoch): also keep directories created or replaced after it, so an
    Allocate that lands while keep is computed does not lose its fresh region.
    """
    root = Path(root)
    keep = set(keep)
    removed = tuple(
        p.name
        for p in _region_dirs(root)
        if p.name not in keep and not _changed_since(p, changed_since) and remove_region(root, p.name)
    )
    for key in removed:
        PROBLEMS.gone(root / key)
    remove_staging(root)
    return removed


def remove_staging(
    root: str | os.PathLike[str], *, older_than_s: float = STALE_TEMP_AGE_S, key: str | None = None
) -> int:
    """Remove half-made (``.tmp-<key>-*``) and half-removed (``.trash-<key>-*``) regions under `root` that
    were last changed more than older_than_s ago (0: every one; only when nothing stages a region now),
    of one region key or of all; how many went."""
    root = Path(root)
    prefixes = _TEMP_PREFIXES if key is None else tuple(f"{p}{_check_key(key)}-" for p in _TEMP_PREFIXES)
    now = time.time()
    gone = 0
    with contextlib.suppress(OSError):
        for entry in root.iterdir():
            if not entry.name.startswith(prefixes):
                continue
            with contextlib.suppress(OSError):
                if older_than_s > 0 and now - entry.lstat().st_mtime <= older_than_s:
                    continue
                if entry.is_dir() and not entry.is_symlink():
                    shutil.rmtree(entry, ignore_errors=True)
                else:
                    entry.unlink()
                gone += 1
    return gone
