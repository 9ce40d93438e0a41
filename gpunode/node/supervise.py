"""How the agent runs its parts: one supervisor for the tasks, and the process's signals and deadline.

Supervisor: every long-running part (device plugins, metrics, health, the
simulated node's control socket, ...) is a task it started under a name. The
first part that raises, at start or later, ends the agent: the supervisor
records that part and its error, and the agent stops the others. A part that
returns has simply finished. Stopping cancels every task and waits at most
`grace_s`; the names of the parts still running then are returned, so the
agent can say which one is stuck instead of waiting for it.

ProcessControl (for `gpunode agent`, never for an agent run inside a test):
SIGTERM and SIGINT are received by a thread of its own (the C-level handler
writes the signal to a pipe, see signal.set_wakeup_fd), so they are seen even
while the event loop or the main thread is stuck in a call that never returns.
The first one asks the agent to stop and arms the exit deadline; a second one,
or the deadline passing (the grace period plus a margin), ends the process with
os._exit after one log line and the pending error line. SIGHUP asks for a
reload. A part's failure arms the same deadline, so a thread blocked in a
driver call can never keep the process alive.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable, Coroutine
from typing import Any

from gpunode.errors import AgentPartFailed, GpunodeError, one_line

log = logging.getLogger("gpunode.node.agent")  # the supervisor reports as the agent

STOP_GRACE_S = 10.0  # how long the parts get to stop (well under Kubernetes' default 30 s)
RECANCEL_S = 0.5  # in the second half of the grace period, parts still running are cancelled again this often
EXIT_MARGIN_S = 3.0  # after the grace period: time for the event loop and its executor to wind down


def part_error(part: str, exc: BaseException) -> GpunodeError:
    """The one-line error a failed part ends the agent with: its own GpunodeError, or AgentPartFailed."""
    if isinstance(exc, GpunodeError):
        return exc
    text = one_line(str(exc))
    return AgentPartFailed(
        f"the agent's {part} part failed: {type(exc).__name__}{': ' + text if text else ''}"
    )


class Supervisor:
    """Runs named part tasks; the first to raise stops the agent (see the module's docstring)."""

    def __init__(self, *, grace_s: float = STOP_GRACE_S) -> None:
        self.grace_s = grace_s
        self.failed: tuple[str, BaseException] | None = None
        self._tasks: dict[asyncio.Task[Any], str] = {}
        self._done = asyncio.Event()

    def start(self, name: str, coro: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
        """Run `coro` as the part `name`."""
        task = asyncio.create_task(coro, name=name)
        self._tasks[task] = name
        task.add_done_callback(self._finished)
        return task

    def _finished(self, task: asyncio.Task[Any]) -> None:
        name = self._tasks.get(task, task.get_name())
        if task.cancelled():
            return
        exc = task.exception()
        if exc is None:
            log.debug("part %s finished", name)
            return
        if self.failed is None:
            self.failed = (name, exc)
            err = part_error(name, exc)
            log.error("%s failed: %s (hint: %s); stopping the agent", name, err, err.hint)
            log.debug("%s failed", name, exc_info=exc)
        self._done.set()

    def stop(self) -> None:
        """Ask the supervised parts to end (on the loop's thread)."""
        self._done.set()

    @property
    def stopping(self) -> bool:
        """Whether a stop was asked for or a part failed."""
        return self._done.is_set()

    def error(self) -> GpunodeError | None:
        """The error of the first part that failed, or None."""
        return None if self.failed is None else part_error(*self.failed)

    async def wait(self) -> None:
        """Until a stop is asked for or a part fails."""
        await self._done.wait()

    async def until(self, event: asyncio.Event) -> bool:
        """Wait for `event` or for the end of the agent; True when `event` came first."""
        waits = [asyncio.ensure_future(event.wait()), asyncio.ensure_future(self._done.wait())]
        try:
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waits:
                w.cancel()
        return event.is_set() and not self._done.is_set()

    async def shutdown(self) -> list[str]:
        """Cancel every part and wait at most grace_s; returns the names of those still running."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.grace_s
        pending = {t for t in self._tasks if not t.done()}
        for t in pending:
            t.cancel()
        if pending:  # half the grace period for the parts' own clean-up (sockets, servers)
            _, pending = await asyncio.wait(pending, timeout=self.grace_s / 2)
        while pending and loop.time() < deadline:
            # Cancelled again: Python 3.11's asyncio.wait_for can swallow a cancellation that arrives
            # just as what it waits for completes, and the part would then run on.
            for t in pending:
                t.cancel()
            _, pending = await asyncio.wait(pending, timeout=min(RECANCEL_S, max(deadline - loop.time(), 0)))
        return sorted(self._tasks[t] for t in pending)


class ProcessControl:
    """Signals and the exit deadline of the agent process (see the module's docstring)."""

    def __init__(
        self,
        *,
        stop: Callable[[], None],
        reload: Callable[[], None],
        cleanup: Callable[[], None] = lambda: None,
        grace_s: float = STOP_GRACE_S,
    ) -> None:
        self._stop, self._reload, self._cleanup = stop, reload, cleanup
        self.grace_s = grace_s
        self.error: GpunodeError | None = None  # printed if the deadline ends the process
        self._armed = threading.Lock()
        self._timer: threading.Timer | None = None
        self._signals = 0
        self._pipe: tuple[int, int] | None = None
        self._old_wakeup_fd = -1

    def install(self) -> None:
        """Take over SIGTERM, SIGINT and SIGHUP (main thread only)."""
        r, w = os.pipe()
        os.set_blocking(w, False)
        self._pipe = (r, w)
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, _ignore)  # a C handler is needed for the wakeup pipe to hear the signal
        self._old_wakeup_fd = signal.set_wakeup_fd(w, warn_on_full_buffer=False)
        threading.Thread(target=self._read_signals, name="gpunode-signals", daemon=True).start()

    def uninstall(self) -> None:
        """Give the signals back to their defaults (the deadline, if armed, stays)."""
        signal.set_wakeup_fd(self._old_wakeup_fd)
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, signal.SIG_DFL if sig != signal.SIGINT else signal.default_int_handler)

    def _read_signals(self) -> None:
        assert self._pipe is not None
        while True:
            try:
                data = os.read(self._pipe[0], 64)
            except OSError:
                return
            for signum in data:
                self.on_signal(signum)

    def on_signal(self, signum: int) -> None:
        """Act on one signal (called on the signal thread)."""
        if signum == signal.SIGHUP:
            self._reload()
            return
        if signum not in (signal.SIGTERM, signal.SIGINT):
            return
        self._signals += 1
        name = signal.Signals(signum).name
        if self._signals > 1:
            log.warning("%s again while stopping: exiting now", name)
            self.exit_now(0)
        log.info("%s: stopping (at most %g s)", name, self.grace_s)
        self.arm()
        self._stop()

    def arm(self) -> None:
        """Start the exit deadline once: the process ends grace_s + EXIT_MARGIN_S from now at the latest."""
        with self._armed:
            if self._timer is not None:
                return
            self._timer = threading.Timer(self.grace_s + EXIT_MARGIN_S, self._deadline)
            self._timer.daemon = True
            self._timer.start()

    def _deadline(self) -> None:
        stuck = sorted(
            t.name for t in threading.enumerate() if not t.daemon and t is not threading.main_thread()
        )
        log.warning(
            "the agent did not stop within %g s (threads still busy: %s); exiting anyway",
            self.grace_s,
            ", ".join(stuck) or "none besides the main one",
        )
        self.exit_now(self.error.exit_code if self.error is not None else 0)

    def exit_now(self, code: int) -> None:
        """Remove what can be removed, print the pending error line, and end the process."""
        with contextlib.suppress(Exception):
            self._cleanup()
        if self.error is not None:
            with contextlib.suppress(Exception):
                print(f"gpunode: {self.error}\nHINT: {self.error.hint}", file=sys.stderr, flush=True)
        with contextlib.suppress(Exception):
            logging.shutdown()
            sys.stdout.flush()
        os._exit(code)


def _ignore(signum: int, frame: object) -> None:
    """The Python-level handler: nothing; the signal thread acts on the wakeup pipe."""
