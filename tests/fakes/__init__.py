"""Stand-ins for what cannot exist on a test machine (a kubelet, an API server, a GPU, a container).

Each behaves like the real thing over the real protocol (a Unix socket, HTTP,
a shared memory-cap region); tests use them instead of mocks.

CappedProcess stands in for a process inside a capped container: a real
child process that claims a slot in a memory-cap region and reserves GPU
memory through the same C functions the preload library calls on cuMemAlloc
(gpunode._memcap), then holds them until stopped, as a running CUDA process
holds its allocations. Killing it leaves a dead slot, as a crashed process does.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType

_HOLDER = r"""
import json, os, sys
from gpunode import _memcap
lib, ffi = _memcap.lib, _memcap.ffi
def check(rc, what):
    if rc != 0:
        sys.exit(what + ": " + ffi.string(lib.gpunode_memcap_strerror(rc)).decode())
for region_dir, reservations in json.loads(sys.argv[1]):
    region = lib.gpunode_memcap_region_new()
    check(lib.gpunode_memcap_region_open(region, region_dir.encode(), 1), "region_open " + region_dir)
    slot = ffi.new("int *")
    check(lib.gpunode_memcap_slot_claim(region, os.getpid(), 0, slot), "slot_claim")
    for device, size in reservations:
        check(lib.gpunode_memcap_reserve(region, slot[0], device, size), "reserve")
print("holding", flush=True)
sys.stdin.read()
"""


class CappedProcess:
    """A live process holding `reservations` ({device index in the region: bytes}) in the region at `region_dir`.

    `also` adds more (region_dir, reservations) pairs held by the same process, so one
    process can stand in for the processes of many containers.
    """

    def __init__(
        self,
        region_dir: str | os.PathLike[str],
        reservations: dict[int, int],
        *,
        also: Sequence[tuple[str | os.PathLike[str], dict[int, int]]] = (),
    ) -> None:
        self.holdings = [(Path(region_dir), dict(reservations)), *((Path(d), dict(r)) for d, r in also)]
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int:
        if self._proc is None:
            raise RuntimeError("the capped process is not started")
        return self._proc.pid

    def start(self) -> CappedProcess:
        root = Path(__file__).resolve().parents[2]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}
        spec = json.dumps([(str(d), sorted(r.items())) for d, r in self.holdings])
        self._proc = subprocess.Popen(
            [sys.executable, "-c", _HOLDER, spec],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=env,
        )
        assert self._proc.stdout is not None
        line = self._proc.stdout.readline()
        if line.strip() != b"holding":
            err = self._proc.stderr.read() if self._proc.stderr else b""
            self._proc.wait(10)
            raise RuntimeError(f"the capped process could not reserve: {err.decode().strip() or line!r}")
        return self

    def stop(self) -> None:
        """End the process normally (its slot becomes dead; the agent reclaims it)."""
        if self._proc is None:
            return
        assert self._proc.stdin is not None
        self._proc.stdin.close()
        self._proc.wait(10)
        for stream in (self._proc.stdout, self._proc.stderr):
            if stream is not None:
                stream.close()
        self._proc = None

    def kill(self) -> None:
        """SIGKILL, as the OOM killer does."""
        if self._proc is not None:
            self._proc.kill()
            self.stop()

    def __enter__(self) -> CappedProcess:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
