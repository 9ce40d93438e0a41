"""Memory-cap regions on disk: create, load, list, remove and garbage-collect them.

A region is one directory per container allocation, ``<root>/<key>/``, holding
the ``limit`` file (written once, read-only to the container) and the ``usage``
file (shared read-write with the preload library). Every check of the layout
is done by the C functions of ``gpunode._memcap``; this module validates what
callers pass, writes new regions atomically and reads existing ones back.

The usage file is mounted read-write into a container, whose processes may
truncate or rewrite it at any instant: every access goes through the guarded
C wrappers (native/src/guard.c), so a shrinking file is an error for that
region (RegionDamaged), never a fault of the agent. Only root may reach the
files on the host: the regions root and the region directories are 0700.
"""

from __future__ import annotations

import contextlib
import errno
import importlib
import logging
import os
import re
import shutil
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpunode.errors import MemcapError, RegionDamaged
from gpunode.node.memcap.problems import PROBLEMS

log = logging.getLogger("gpunode.node.memcap")

LIMIT_FILE = "limit"
USAGE_FILE = "usage"
LIMIT_FILE_MODE = 0o444
USAGE_FILE_MODE = 0o666  # container processes run as any uid; the directories keep host users out
REGION_DIR_MODE = 0o700
REGIONS_ROOT_MODE = 0o700
STALE_TEMP_AGE_S = 600.0

_KEY_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
_TEMP_PREFIXES = (".tmp-", ".trash-")
_CORRUPT_HINT = (
    "the region is corrupt or was written by another gpunode version; "
    "remove it (remove_region) and allocate the container again"
)
_TENANT = "a container truncated or rewrote its usage file"


def _native() -> Any:
    try:
        return importlib.import_module("gpunode._memcap")
    except ImportError as exc:
        raise MemcapError(
            f"the CFFI module gpunode._memcap is not built ({exc})",
            hint="reinstall gpunode with `pip install .` on a machine with a C compiler, so native/ is built",
        ) from exc


@dataclass(frozen=True)
class DeviceCap:
    """The cap on one GPU (or MIG device) of a region, in bytes."""

    uuid: str
    limit_bytes: int
    device_total_bytes: int


@dataclass(frozen=True)
class Region:
    """A region on disk. The single-device fields describe devices[0]."""

    key: str
    path: Path
    devices: tuple[DeviceCap, ...]
    fail_open: bool
    generation: int

    @property
    def gpu_uuid(self) -> str:
        """The UUID of the capped GPU or MIG device (devices[0])."""
        return self.devices[0].uuid

    @property
    def limit_bytes(self) -> int:
        """The cap on devices[0], in bytes."""
        return self.devices[0].limit_bytes

    @property
    def device_total_bytes(self) -> int:
        """The total memory of devices[0], in bytes."""
        return self.devices[0].device_total_bytes

    @property
    def limit_path(self) -> Path:
        """The region's limit file (read-only to the container)."""
        return self.path / LIMIT_FILE

    @property
    def usage_path(self) -> Path:
        """The region's usage file, shared read-write with the interposer."""
        return self.path / USAGE_FILE


def _io_error(what: str, exc: OSError, where: Path) -> MemcapError:
    return MemcapError(f"{what}: {exc}", hint=f"check that {where} exists and the agent may write to it")


def _check_key(key: str) -> str:
    if not isinstance(key, str) or not _KEY_RE.fullmatch(key):
        raise MemcapError(
            f"invalid region key {key!r}",
            hint="use 1-128 characters of letters, digits, '.', '_' and '-', starting with a letter or digit",
        )
    return key


def _check_size(value: object, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise MemcapError(
            f"{what} must be an integer number of bytes, got {value!r}", hint="pass a size in bytes"
        )
    if value <= 0:
        raise MemcapError(
            f"{what} must be positive, got {value}", hint="a memory cap needs at least one byte"
        )
    return value


def _check_device(cap: DeviceCap, uuid_bytes: int) -> DeviceCap:
    uuid = cap.uuid
    if not isinstance(uuid, str) or not uuid or len(uuid.encode()) >= uuid_bytes or not uuid.isprintable():
        raise MemcapError(
            f"invalid GPU UUID {uuid!r}", hint="pass the UUID NVML reports, such as GPU-5a2f..."
        )
    if any(c.isspace() for c in uuid):
        raise MemcapError(
            f"invalid GPU UUID {uuid!r}: it contains whitespace", hint="pass the UUID NVML reports"
        )
    limit = _check_size(cap.limit_bytes, f"limit for {uuid}")
    total = _check_size(cap.device_total_bytes, f"device total for {uuid}")
    if limit > total:
        log.info("cap of %d bytes on %s is above the device's %d bytes; clamped", limit, uuid, total)
        limit = total
    return DeviceCap(uuid, limit, total)


def _status_error(status: int, path: Path, errno_value: int = 0, *, usage_part: bool = False) -> MemcapError:
    """The error for a C status; RegionDamaged when it is about one region's files.

    usage_part: the limit file was valid and the usage file is what failed (a container can write it).
    """
    m = _native()
    text = m.ffi.string(m.lib.gpunode_memcap_strerror(status)).decode()
    detail = f": {os.strerror(errno_value)}" if errno_value else ""
    lib = m.lib
    if status == lib.GPUNODE_MEMCAP_ERR_ARGUMENT:
        return MemcapError(f"memory-cap region {path}: {text}{detail}", hint=_CORRUPT_HINT)
    if usage_part:
        if status in (lib.GPUNODE_MEMCAP_ERR_FAULT, lib.GPUNODE_MEMCAP_ERR_SIZE):
            reason = "truncated"
        elif status == lib.GPUNODE_MEMCAP_ERR_IO and errno_value == errno.EWOULDBLOCK:
            # Opened without blocking: a file lease the container took fails the open at once (instead of
            # the kernel's 45 s lease-break wait); the region is skipped as damaged while the lease lasts.
            reason = "leased"
            detail = ": held by a file lease (a container locks its usage file)"
        elif status == lib.GPUNODE_MEMCAP_ERR_IO:
            reason = "missing" if errno_value == errno.ENOENT else "io"
        else:
            reason = "corrupt"
        blame = f" ({_TENANT})" if reason in ("truncated", "corrupt") else ""
        message = f"memory-cap region {path}: {text}{detail}{blame}"
        return RegionDamaged(message, key=path.name, reason=reason)
    if status == lib.GPUNODE_MEMCAP_ERR_NO_REGION:
        hint = "the region does not exist: create it with create_region, or it was garbage-collected"
    elif status == lib.GPUNODE_MEMCAP_ERR_IO:
        hint = f"check that {path} and its files exist and that the agent may read and write them"
    else:
        hint = _CORRUPT_HINT
    return RegionDamaged(
        f"memory-cap region {path}: {text}{detail}", key=path.name, reason="limit", hint=hint
    )


@contextlib.contextmanager
def _opened(path: Path, *, writable: bool) -> Iterator[Any]:
    m = _native()
    region = m.lib.gpunode_memcap_region_new()
    if region == m.ffi.NULL:
        raise MemoryError("cannot allocate a region handle")
    try:
        status = m.lib.gpunode_memcap_guarded_open(region, os.fsencode(path), 1 if writable else 0)
        if status != m.lib.GPUNODE_MEMCAP_OK:
            scratch = m.ffi.new("struct gpunode_memcap_limit *")
            usage_part = m.lib.gpunode_memcap_region_copy_limit(region, scratch) == m.lib.GPUNODE_MEMCAP_OK
            errno_value = m.lib.gpunode_memcap_region_errno(region)
            raise _status_error(status, path, errno_value, usage_part=usage_part)
        yield region
    finally:
        m.lib.gpunode_memcap_region_free(region)


def _region_of(handle: Any, path: Path) -> Region:
    """The Region described by an open handle's (validated) limit part."""
    m = _native()
    limit = m.ffi.new("struct gpunode_memcap_limit *")
    m.lib.gpunode_memcap_region_copy_limit(handle, limit)
    devices = tuple(
        DeviceCap(m.ffi.string(d.uuid).decode(), int(d.limit_bytes), int(d.total_bytes))
        for d in (limit.devices[i] for i in range(limit.device_count))
    )
    fail_open = bool(limit.flags & m.lib.GPUNODE_MEMCAP_FLAG_FAIL_OPEN)
    return Region(path.name, path, devices, fail_open, int(limit.generation))


def load_region(path: str | os.PathLike[str]) -> Region:
    """Open and validate the region directory at path (both files); RegionDamaged says what is wrong."""
    path = Path(path)
    with _opened(path, writable=False) as handle:
        return _region_of(handle, path)


def _write_file(path: Path, data: bytes, mode: int) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        os.fsync(fd)
        os.fchmod(fd, mode)
    finally:
        os.close(fd)


def create_region(
    root: str | os.PathLike[str],
    key: str,
    *,
    gpu_uuid: str,
    limit_bytes: int,
    device_total_bytes: int,
    fail_open: bool = False,
) -> Region:
    """Create the region for one GPU, or return it if it already exists with the same cap.

    A limit above the device's memory is clamped to it. Raises MemcapError for a bad key,
    UUID or size, or when a region with this key exists with a different cap.
    """
    return create_multi_gpu_region(
        root, key, devices=(DeviceCap(gpu_uuid, limit_bytes, device_total_bytes),), fail_open=fail_open
    )


def create_multi_gpu_region(
    root: str | os.PathLike[str], key: str, *, devices: Sequence[DeviceCap], fail_open: bool = False
) -> Region:
    """Create a region capping several GPUs of one container (each device its own cap).

    Returns the region already at key if it has the same caps; see replace_region for a fresh one.
    """
    root = Path(root)
    caps = _check_request(key, devices, fail_open)
    final = root / key
    if final.exists():
        return _existing(final, caps, fail_open)
    staging, generation = _stage(root, key, caps, fail_open)
    try:
        os.rename(staging, final)
    except OSError as exc:
        shutil.rmtree(staging, ignore_errors=True)
        if final.exists():  # created concurrently under the same key
            return _existing(final, caps, fail_open)
        raise _io_error(f"cannot create region {final}", exc, root) from exc
    return _created(root, final, caps, fail_open, generation)


def replace_region(
    root: str | os.PathLike[str], key: str, *, devices: Sequence[DeviceCap], fail_open: bool = False
) -> Region:
    """A fresh region at key (new generation, no usage), taking the place of whatever is there.

    What a previous holder left (a zeroed magic, garbage, a truncated file, a huge counter) does
    not matter: the old directory is moved aside and removed; processes that still map its usage
    file keep their mapping of the unlinked file and no longer count against the new region.
    """
    root = Path(root)
    caps = _check_request(key, devices, fail_open)
    final = root / key
    staging, generation = _stage(root, key, caps, fail_open)
    try:
        for _ in range(16):
            try:
                os.rename(staging, final)
                break
            except OSError as exc:
                if exc.errno not in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOTDIR, errno.EISDIR):
                    raise
            with contextlib.suppress(FileNotFoundError):
                os.rename(final, root / f".trash-{key}-{os.urandom(4).hex()}")
        else:
            raise OSError(errno.EBUSY, "the key is being replaced concurrently")
    except OSError as exc:
        shutil.rmtree(staging, ignore_errors=True)
        raise _io_error(f"cannot replace region {final}", exc, root) from exc
    PROBLEMS.gone(final)
    _empty_trash(root, key)
    return _created(root, final, caps, fail_open, generation)


def _check_request(key: str, devices: Sequence[DeviceCap], fail_open: bool) -> tuple[DeviceCap, ...]:
    lib = _native().lib
    _check_key(key)
    if not isinstance(fail_open, bool):
        raise MemcapError(f"fail_open must be a bool, got {fail_open!r}", hint="pass True or False")
    if not 1 <= len(devices) <= lib.GPUNODE_MEMCAP_MAX_DEVICES:
        raise MemcapError(
            f"a region caps 1 to {lib.GPUNODE_MEMCAP_MAX_DEVICES} devices, got {len(devices)}",
            hint="split the container's devices or check the request",
        )
    caps = tuple(_check_device(d, lib.GPUNODE_MEMCAP_UUID_BYTES) for d in devices)
    if len({c.uuid for c in caps}) != len(caps):
        raise MemcapError("a region lists the same GPU twice", hint="pass each GPU once")
    return caps


def _stage(root: Path, key: str, caps: tuple[DeviceCap, ...], fail_open: bool) -> tuple[Path, int]:
    """A complete region directory under a temporary name in root, and its generation."""
    m = _native()
    lib = m.lib
    final = root / key
    limit = m.ffi.new("struct gpunode_memcap_limit *")
    limit.generation = int.from_bytes(os.urandom(8), "little") | 1
    limit.flags = lib.GPUNODE_MEMCAP_FLAG_FAIL_OPEN if fail_open else 0
    limit.device_count = len(caps)
    for i, cap in enumerate(caps):
        limit.devices[i].uuid = cap.uuid.encode()
        limit.devices[i].limit_bytes = cap.limit_bytes
        limit.devices[i].total_bytes = cap.device_total_bytes
    status = lib.gpunode_memcap_limit_seal(limit)
    if status != lib.GPUNODE_MEMCAP_OK:
        raise _status_error(status, final)
    usage_size = lib.gpunode_memcap_usage_size()
    usage = m.ffi.new("char[]", usage_size)
    status = lib.gpunode_memcap_usage_format(usage, usage_size, limit)
    if status != lib.GPUNODE_MEMCAP_OK:
        raise _status_error(status, final)
    try:
        if not root.is_dir():
            root.mkdir(parents=True, exist_ok=True)
            os.chmod(root, REGIONS_ROOT_MODE)
        staging = Path(tempfile.mkdtemp(prefix=f".tmp-{key}-", dir=root))
    except OSError as exc:
        raise _io_error(f"cannot create a region under {root}", exc, root) from exc
    try:
        _write_file(staging / LIMIT_FILE, bytes(m.ffi.buffer(limit)), LIMIT_FILE_MODE)
        _write_file(staging / USAGE_FILE, bytes(m.ffi.buffer(usage)), USAGE_FILE_MODE)
        os.chmod(staging, REGION_DIR_MODE)
    except OSError as exc:
        shutil.rmtree(staging, ignore_errors=True)
        raise _io_error(f"cannot create region {final}", exc, root) from exc
    return staging, int(limit.generation)


def _created(
    root: Path, final: Path, caps: tuple[DeviceCap, ...], fail_open: bool, generation: int
) -> Region:
    dir_fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
    region = Region(final.name, final, caps, fail_open, generation)
    log.debug("created memory-cap region %s: %s", final, caps)
    return region


def _empty_trash(root: Path, key: str) -> None:
    for entry in root.glob(f".trash-{key}-*"):
        shutil.rmtree(entry, ignore_errors=True)


def _existing(path: Path, caps: tuple[DeviceCap, ...], fail_open: bool) -> Region:
    region = load_region(path)
    if (region.devices, region.fail_open) != (caps, fail_open):
        raise MemcapError(
            f"region {path} already exists with a different cap ({region.devices}, fail_open={region.fail_open})",
            hint="a key names one allocation; remove the old region (remove_region) before reusing its key",
        )
    return region
