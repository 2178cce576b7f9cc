"""Warm spares: pre-started interpreters that become the executors of built-in runtimes (issue 15).

With ``warm_start`` on (the default) and at least one built-in runtime configured (``trainer``,
``parameter-server``), a daemon keeps one spare while it is idle: ``python -m worker_daemon.warm`` (see that
module for the protocol), which imports torch, transformers, accelerate and the common model modules and then
waits. The job manager (:mod:`worker_daemon.jobs`) hands the next task of a built-in runtime to it instead of
starting a cold interpreter; the spare is started exactly as a task's process is (its own session, killed with
the daemon, pipes for stdin, stdout and stderr), so once it is the task nothing in its supervision differs.

:class:`Spares` keeps that one process:

* :meth:`Spares.ensure` starts a spare unless one is there (or starting); the job manager calls it when the
  daemon starts (after its benchmark, which a spare's imports would slow) and whenever its last task has ended.
  No spare is started while a task runs: its imports would take the CPU of the task's own start-up.
* :meth:`Spares.take` hands the spare out, if there is one that is alive and was started with the daemon's
  present environment (a library may have read a variable at import time); the task gets it even while it is
  still importing, which is never slower than a cold start.
* A spare that dies on its own is replaced, at most :data:`MAX_FAILURES` times in a row; one whose imports
  failed is retired and warm start is off for the daemon's lifetime (tasks start cold, and show the failure
  themselves). Either way a warning says so.
* :meth:`Spares.close` kills the spare and starts no more (daemon shutdown).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import sys
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

logger = logging.getLogger(__name__)

#: Runtimes whose executors a spare can become (worker_daemon.warm.WARM_IMPORTS has their imports).
WARM_RUNTIMES = ("trainer", "parameter-server")
#: Spares that may die on their own in a row (before being handed out) before warm start is given up.
MAX_FAILURES = 3
#: Longest ready line read from a spare.
MAX_READY_LINE = 65536


@dataclass(eq=False)
class Spare:
    """One spare process and what the daemon knows about it."""

    process: asyncio.subprocess.Process
    #: The environment it was started with (the daemon's, less its private variables).
    environment: dict[str, str]
    started: float = field(default_factory=time.monotonic)
    #: Seconds its warm-up took, once it reported ready.
    ready_after: float | None = None
    watcher: asyncio.Task[None] | None = None

    @property
    def alive(self) -> bool:
        return self.process.returncode is None


class Spares:
    """The daemon's warm spare (see the module docstring).

    ``runtimes``: the built-in runtimes configured (a spare warms for these; none: no spare ever).
    ``environment``: the environment a spare starts with and a task's base environment (called each time).
    ``preexec``: run in the child between fork and exec (the job manager's ``die_with_parent``).
    ``wanted``: whether a spare is wanted now (the job manager: no task runs and it is not closing).
    Nothing is started before :meth:`activate` (a daemon's start; a job manager in a test or a simulation
    never starts one).
    """

    def __init__(
        self,
        *,
        runtimes: Iterable[str],
        environment: Callable[[], dict[str, str]],
        preexec: Callable[[], None] | None = None,
        wanted: Callable[[], bool] = lambda: True,
    ) -> None:
        self.runtimes = tuple(runtime for runtime in WARM_RUNTIMES if runtime in set(runtimes))
        self._environment = environment
        self._preexec = preexec
        self._wanted = wanted
        self.active = False
        self.spare: Spare | None = None
        self._starting: asyncio.Task[None] | None = None
        self.failures = 0
        #: Why warm start was given up, if it was.
        self.disabled: str | None = None
        self.closed = False
        #: Spares handed out so far (for tests and logs).
        self.handed_out = 0

    @property
    def enabled(self) -> bool:
        return bool(self.runtimes) and self.disabled is None and not self.closed

    def activate(self) -> None:
        """From now on keep a spare while one is wanted; start one now if it is."""
        self.active = True
        self.ensure()

    def ensure(self) -> None:
        """Start a spare in the background unless there is one (or one is starting), none is wanted now, or
        warm start is off or not activated."""
        if not (self.active and self.enabled) or self._starting is not None or not self._wanted():
            return
        if self.spare is not None and self.spare.alive:
            return
        self._starting = asyncio.create_task(self._start(), name="warm-spare-start")

    def take(self, environment: Mapping[str, str]) -> Spare | None:
        """The spare, to become a task whose base environment is ``environment``; None if there is none fit
        to (the task then starts cold). A spare started with another environment is retired."""
        spare = self.spare
        if spare is None:
            return None
        self.spare = None
        if spare.watcher is not None:
            spare.watcher.cancel()
        if not spare.alive:
            return None
        if spare.environment != dict(environment):
            logger.info("the daemon's environment changed since the warm spare started: retiring it")
            self._kill(spare)
            return None
        self.handed_out += 1
        return spare

    def hand_out(self, spare: Spare, *, argv: list[str], environment: Mapping[str, str]) -> None:
        """Send ``spare`` its task: it runs ``argv`` with exactly ``environment`` in the daemon's working
        directory. Its stdin is closed after the line (the task's stdin is /dev/null)."""
        line = json.dumps({"argv": argv, "env": dict(environment), "cwd": os.getcwd()}) + "\n"
        stdin = spare.process.stdin
        assert stdin is not None
        # No drain: a spare still importing reads the line when it is done, and the task must not wait here.
        # The transport sends what is buffered, then closes; a spare that died meanwhile fails the task with
        # its own exit status, as a process that died at start would.
        stdin.write(line.encode())
        stdin.close()

    async def close(self) -> None:
        """Kill the spare (and one starting) and start no more."""
        self.closed = True
        starting = self._starting
        if starting is not None:
            # Not cancelled: a cancelled create_subprocess_exec may have started a process it never returns.
            # Starting takes milliseconds; _start kills what it started once it sees `closed`.
            with contextlib.suppress(asyncio.CancelledError):
                await starting
        spare, self.spare = self.spare, None
        if spare is not None:
            if spare.watcher is not None:
                spare.watcher.cancel()
            self._kill(spare)
            await spare.process.wait()

    # --- internals -----------------------------------------------------------------------------------------

    async def _start(self) -> None:
        read_end, write_end = os.pipe()
        environment = self._environment()
        argv = [sys.executable, "-m", "worker_daemon.warm", "--ready-fd", str(write_end)]
        for runtime in self.runtimes:
            argv += ["--runtime", runtime]
        try:
            try:
                process = await asyncio.create_subprocess_exec(
                    *argv,
                    stdin=asyncio.subprocess.PIPE,
                    stdout=asyncio.subprocess.PIPE,
                    stderr=asyncio.subprocess.PIPE,
                    env=environment,
                    start_new_session=True,
                    preexec_fn=self._preexec,
                    pass_fds=(write_end,),
                )
            finally:
                os.close(write_end)
        except OSError as error:
            os.close(read_end)
            self._starting = None
            self._give_up(f"a warm spare could not be started: {error}")
            return
        except BaseException:
            os.close(read_end)
            raise
        # Read in a thread, which closes the pipe: it ends when the spare writes its line or its end closes
        # (it exits, is killed, or has become a task), whatever happens to the watcher meanwhile.
        ready = asyncio.get_running_loop().run_in_executor(None, _read_ready, read_end)
        spare = Spare(process=process, environment=environment)
        self._starting = None
        if self.closed:  # closed while it was being started
            self._kill(spare)
            await process.wait()
            return
        self.spare = spare
        spare.watcher = asyncio.create_task(self._watch(spare, ready), name="warm-spare-watch")
        logger.info("warm spare started (pid %d) for %s", process.pid, ", ".join(self.runtimes))

    async def _watch(self, spare: Spare, ready: asyncio.Future[bytes]) -> None:
        """Wait for the spare's ready line, then for it to die before it is handed out (cancelled then)."""
        try:
            report = _parse_ready(await ready)
            if report is not None:
                spare.ready_after = time.monotonic() - spare.started
                if report["failed"]:
                    self._retire(spare)
                    self._give_up(f"the warm spare's imports failed ({report['failed']})")
                    return
                self.failures = 0
                notes = f" ({'; '.join(report['notes'])})" if report["notes"] else ""
                logger.info(
                    "warm spare ready after %.1f s (pid %d)%s", spare.ready_after, spare.process.pid, notes
                )
            code = await spare.process.wait()
        except asyncio.CancelledError:
            return
        if self.spare is spare:
            self.spare = None
            self.failures += 1
            logger.warning(
                "the warm spare (pid %d) died before it was used: %s", spare.process.pid, _status(code)
            )
            if self.failures >= MAX_FAILURES:
                self._give_up(f"{self.failures} warm spares in a row died before they were used")
            else:
                self.ensure()

    def _retire(self, spare: Spare) -> None:
        if self.spare is spare:
            self.spare = None
        self._kill(spare)

    def _give_up(self, reason: str) -> None:
        self.disabled = reason
        logger.warning("%s: tasks start cold from now on", reason)

    @staticmethod
    def _kill(spare: Spare) -> None:
        # The spare leads its own session and group (start_new_session): its group id is its pid.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(spare.process.pid, signal.SIGKILL)


def _read_ready(descriptor: int) -> bytes:
    """The first line read from ``descriptor`` (up to :data:`MAX_READY_LINE` bytes; b"" at end of file), which
    is closed afterwards. Blocks: run in a thread."""
    line = b""
    try:
        while not line.endswith(b"\n") and len(line) < MAX_READY_LINE:
            chunk = os.read(descriptor, MAX_READY_LINE - len(line))
            if not chunk:
                break
            line += chunk
    finally:
        os.close(descriptor)
    return line


def _parse_ready(line: bytes) -> dict | None:
    """A spare's ready report, or None for nothing (it died first) or something that is not one."""
    try:
        report = json.loads(line)
    except ValueError:
        return None
    if not isinstance(report, dict) or not isinstance(report.get("notes", []), list):
        return None
    return {"failed": report.get("failed") or None, "notes": [str(note) for note in report.get("notes", [])]}


def _status(code: int) -> str:
    return f"signal {-code}" if code < 0 else f"exit code {code}"
