"""Child processes for the end-to-end tests: started in their own process group with their output in a log
file, waited on for health, and stopped with SIGTERM then SIGKILL (the whole group), even when the test
run itself is interrupted (an atexit hook stops whatever is still running)."""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Self

_LIVE: set[Proc] = set()
_LIVE_LOCK = threading.Lock()


class StartError(RuntimeError):
    """A component did not come up; the message carries the end of its log."""


class Poller:
    """A daemon thread the test starts and stops; subclasses loop in _run until self._stop is set."""

    def __init__(self, name: str) -> None:
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> Self:
        """Start the thread."""
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop the thread (waits up to 30 s for it)."""
        self._stop.set()
        self._thread.join(30)

    def _run(self) -> None:
        raise NotImplementedError


class Proc:
    """One supervised child process (see the module docstring)."""

    def __init__(
        self,
        name: str,
        argv: Sequence[str],
        log_dir: Path,
        *,
        env: Mapping[str, str] | None = None,
        cwd: Path | None = None,
    ) -> None:
        """Describe the process; start() runs it. Its output goes to <log_dir>/<name>.log."""
        self.name = name
        self.argv = [str(a) for a in argv]
        self.log = log_dir / f"{name}.log"
        self.env = dict(env) if env is not None else None
        self.cwd = cwd
        self.popen: subprocess.Popen[bytes] | None = None

    def start(self) -> Proc:
        """Start it in a new session (its own process group)."""
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log, "ab") as out:
            out.write(f"$ {' '.join(self.argv)}\n".encode())
            out.flush()
            self.popen = subprocess.Popen(
                self.argv,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=self.env,
                cwd=self.cwd,
                start_new_session=True,
            )
        with _LIVE_LOCK:
            _LIVE.add(self)
        return self

    def running(self) -> bool:
        """Whether it was started and has not exited."""
        return self.popen is not None and self.popen.poll() is None

    def tail(self, lines: int = 40) -> str:
        """The last lines of its log."""
        try:
            text = self.log.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def wait_until(self, ready: Callable[[], bool], *, timeout_s: float, what: str) -> None:
        """Poll `ready` until true; StartError (with the log's end) when it exits or the time is up."""
        deadline = time.monotonic() + timeout_s
        while True:
            if not self.running():
                code = self.popen.returncode if self.popen is not None else None
                raise StartError(f"{self.name} exited ({code}) before {what}:\n{self.tail()}")
            with contextlib.suppress(Exception):
                if ready():
                    return
            if time.monotonic() > deadline:
                raise StartError(f"{self.name}: no {what} after {timeout_s:.0f}s:\n{self.tail()}")
            time.sleep(0.25)

    def stop(self, grace_s: float = 15.0) -> None:
        """SIGTERM to its process group, SIGKILL after `grace_s`; waits until it is gone."""
        popen = self.popen
        if popen is None:
            return
        try:
            if popen.poll() is None:
                _signal_group(popen.pid, signal.SIGTERM)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    popen.wait(grace_s)
            # Children it left in its group (runc shims, plugins) go too.
            _signal_group(popen.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                popen.wait(10)
        finally:
            with _LIVE_LOCK:
                _LIVE.discard(self)


def _signal_group(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, sig)


def stop_all() -> None:
    """Stop every process still running, newest first."""
    with _LIVE_LOCK:
        live = list(_LIVE)
    for proc in reversed(sorted(live, key=lambda p: p.popen.pid if p.popen else 0)):
        proc.stop(grace_s=5.0)


atexit.register(stop_all)
