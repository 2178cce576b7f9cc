"""The job manager: runs the tasks the control plane dispatches under this daemon's leases.

For each ``dispatch_job`` it accepts (the lease is ACTIVE in the book and belongs to the job; an executor of the
spec's class and ``descriptor.name`` is configured), :class:`JobManager`:

1. makes ``<work_dir>/hypha-<random uuid>`` (0700) and serves the bridge on ``<dir>/bridge.sock`` (0600) with a
   :class:`~worker_daemon.bridge.remote.RemoteBackend`;
2. starts the process in its own session (so signals reach a launcher's children too, e.g. ``accelerate
   launch``'s), in the daemon's working directory, with ``SOCKET_PATH``, ``WORK_DIR``, ``JOB_JSON`` and
   ``HYPHA_SLOWDOWN`` (the config's ``slowdown`` factor, ``1.0`` unless slowed on purpose) exported, and on a
   worker that lists its devices ``CUDA_VISIBLE_DEVICES`` (the lease's device indices, ``""`` for none), over the
   daemon's environment (less its credentials) and the executor's ``env`` table (which may not name these):

   * runtime ``process``: ``cmd`` + ``args``, with ``{SOCKET_PATH}``, ``{WORK_DIR}`` and ``{JOB_JSON}``
     (compact JSON of the spec) replaced in every argument;
   * runtime ``trainer``: ``python -m worker_daemon.executors.training --socket … --work-dir …`` (the job in
     ``$JOB_JSON``), one process, no launcher;
   * runtime ``inference``: ``python -m worker_daemon.executors.inference --socket … --work-dir …`` (the job
     in ``$JOB_JSON``), with an :class:`~worker_daemon.bridge.remote.results.InferenceBackend` (a task of
     executor class ``inference``, whatever its runtime: docs/inference.md);
   * runtime ``parameter-server``: ``python -m parameter_server --socket … --work-dir … --job-file … --host …
     --port … [--public-url …]`` (the job JSON in ``<work dir>/.job.json``, 0600: it holds slice tokens, which
     ``ps`` would show to every user on a command line) with ``HYPHA_TRANSFER_KEY``, ``HYPHA_TRANSFER_TOKEN``,
     ``HYPHA_TRANSFER_TOKEN_FILE`` (``<work dir>/.transfer-token``, rewritten with each fresh token the
     control plane sends in a ``transfer_token`` frame) and ``HYPHA_SERVER_URL`` (the control plane's HTTP
     base URL) in its environment;

   A task of a built-in runtime (``trainer``, ``parameter-server``) whose executor has no ``env`` is handed
   to the daemon's warm spare when there is one (:mod:`worker_daemon.spares`): a process started the same way earlier, which has done
   the imports and now runs that same command in itself. Everything below is the same for it.

3. posts ``job_started``; re-logs every line of the child's stdout and stderr (prefixed with the task id);
4. when the process ends, by itself or cancelled (``cancel_job``, its lease gone, daemon shutdown: SIGTERM to
   the process group, SIGKILL after ``kill_grace`` seconds), stops the bridge, removes the work dir and posts
   ``job_exited`` with the exit code or signal and the last lines of output (a failure's ``reason`` is the
   failure its output tells of, not the launcher's wrapper of it: :mod:`worker_daemon.failures`).

A dispatch that is refused is answered at once with a ``job_exited`` whose ``reason`` says why. Frames go
through a :class:`~worker_daemon.link.ControlLink`, so a task that ends while the daemon is disconnected
reports it after the next ``welcome``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import re
import shutil
import signal
import sys
import tempfile
import uuid
from collections import OrderedDict, deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from worker_daemon import protocol, telemetry
from worker_daemon.bridge import BridgeServer, serve_bridge
from worker_daemon.bridge.authorisation import DEFAULT_GRACE as DEFAULT_AUTH_GRACE
from worker_daemon.bridge.remote import RemoteBackend
from worker_daemon.bridge.remote.results import INFERENCE_CLASS, InferenceBackend
from worker_daemon.config import (
    DEVICE_VARIABLE,
    PRIVATE_ENVIRONMENT,
    ExecutorConfig,
    WorkerConfig,
    http_base_url,
)
from worker_daemon.failures import root_cause
from worker_daemon.leases import LeaseBook
from worker_daemon.link import ControlLink
from worker_daemon.spares import WARM_RUNTIMES, Spares

logger = logging.getLogger(__name__)

SOCKET_NAME = "bridge.sock"
WORK_DIR_MODE = 0o700
#: Lines of output kept for ``job_exited.log_tail`` (which holds at most 8000 characters).
LOG_TAIL_LINES = 50
LOG_TAIL_CHARS = 8000
#: Seconds between two ``task_log`` frames of a running task (its new output lines, so the job page can show
#: the log while it runs and the control plane keeps its full log); at most :data:`LOG_BATCH_LINES` lines each.
LOG_FORWARD_INTERVAL = 2.0
#: Output kept for the next forwarding, in lines and in characters (so a chatty task adds at most ~64 KB/s to its
#: daemon's connection, far below the control plane's byte limits: docs/protocol.md); a task that prints more in
#: one interval loses its older lines, and the log then says how many.
LOG_BUFFER_LINES = 500
LOG_BUFFER_CHARS = 128 * 1024
#: Characters in one ``task_log`` frame at most (with JSON's worst escaping, 6 bytes a character, it stays
#: below the control plane's 256 KiB frame limit).
LOG_BATCH_CHARS = 32 * 1024
#: Ended tasks remembered (see ``JobManager.finished``).
FINISHED_REMEMBERED = 1000
LOG_BATCH_LINES = 100
#: A line longer than this is logged in pieces (progress bars without newlines must not grow a buffer).
MAX_LINE = 8192
#: AF_UNIX socket paths hold at most 107 bytes on Linux.
MAX_SOCKET_PATH = 107
#: How long to wait for the output of a process that has exited (its children may hold the pipes).
OUTPUT_DRAIN_TIMEOUT = 2.0
#: Environment variables of the daemon that its tasks must not inherit: the worker's own credentials.
SHUTDOWN_REASON = "daemon shutting down"

#: What runtime ``trainer`` runs: the built-in DiLoCo trainer.
TRAINER_MODULE = "worker_daemon.executors.training"
#: What runtime ``inference`` runs: the built-in batch inference executor (docs/inference.md).
INFERENCE_MODULE = "worker_daemon.executors.inference"

_PLACEHOLDER = re.compile(r"\{(SOCKET_PATH|WORK_DIR|JOB_JSON)\}")


def die_with_parent(signal_number: int = signal.SIGTERM) -> None:
    """Run in a child between fork and exec: the kernel sends it ``signal_number`` if its parent dies.

    A daemon killed outright (``kill -9``, the OOM killer) cannot stop its tasks, and a task in its own
    session is reached by nothing else: a parameter server would go on serving, holding its port, forever.
    (An executor notices by itself: its next bridge call fails.) Linux only; elsewhere a no-op.
    """
    if sys.platform != "linux":
        return
    import ctypes

    parent = os.getppid()
    ctypes.CDLL(None, use_errno=True).prctl(1, signal_number)  # 1 = PR_SET_PDEATHSIG
    if os.getppid() != parent:  # the parent died before the prctl: nobody would send the signal
        os._exit(1)


def base_environment() -> dict[str, str]:
    """The daemon's environment less its private variables: what every task's environment starts from."""
    return {key: value for key, value in os.environ.items() if key not in PRIVATE_ENVIRONMENT}


class LaunchError(Exception):
    """A task could not be started (its work dir, bridge or process)."""


def substitute(argument: str, values: Mapping[str, str]) -> str:
    """``argument`` with ``{SOCKET_PATH}``, ``{WORK_DIR}`` and ``{JOB_JSON}`` replaced in one pass (a value
    that itself contains a placeholder is not expanded again); other ``{…}`` are left as they are."""
    return _PLACEHOLDER.sub(lambda match: values[match[1]], argument)


def executor_key(spec: Mapping[str, Any]) -> tuple[str, str] | None:
    """(class, descriptor name) of a JOB_JSON envelope, or None if it names no executor."""
    executor = spec.get("executor")
    if not isinstance(executor, dict):
        return None
    descriptor = executor.get("descriptor")
    executor_class = executor.get("class")
    name = descriptor.get("name") if isinstance(descriptor, dict) else None
    if not isinstance(executor_class, str) or not isinstance(name, str):
        return None
    return executor_class, name


@dataclass(eq=False)
class Task:
    """One dispatched task and what runs for it."""

    dispatch: protocol.DispatchJob
    executor: ExecutorConfig
    work_dir: Path | None = None
    socket_path: Path | None = None
    #: A short private dir holding the socket when the work dir's path is too long for one (removed at the end).
    socket_dir: Path | None = None
    process: asyncio.subprocess.Process | None = None
    bridge: BridgeServer | None = None
    backend: RemoteBackend | None = None
    output: deque[str] = field(default_factory=lambda: deque(maxlen=LOG_TAIL_LINES))
    #: Output lines not yet forwarded to the control plane in a ``task_log`` frame.
    unsent: deque[str] = field(default_factory=deque)
    #: Characters in :attr:`unsent`, and lines pushed out of it before they were forwarded.
    unsent_chars: int = 0
    unsent_dropped: int = 0
    cancel_reason: str | None = None
    #: Why the daemon stopped the task as failed (e.g. its authorisation was lost): reported as a failure.
    failure_reason: str | None = None
    cancel_requested: asyncio.Event = field(default_factory=asyncio.Event)
    started: bool = False
    #: Whether its process is a warm spare that became it (worker_daemon.spares).
    warm: bool = False
    runner: asyncio.Task[protocol.JobExited] | None = None

    @property
    def task_id(self) -> uuid.UUID:
        return self.dispatch.task_id

    @property
    def lease_id(self) -> uuid.UUID:
        return self.dispatch.lease_id

    def log_tail(self) -> str:
        return "\n".join(self.output)[-LOG_TAIL_CHARS:]


def auth_grace(environment: Mapping[str, str] = os.environ) -> float:
    """Seconds a task's transfer token may be refused before the task is failed (``HYPHA_AUTH_GRACE``;
    :mod:`worker_daemon.bridge.authorisation`); the default when unset or not a number in [1, 86400]."""
    text = environment.get("HYPHA_AUTH_GRACE")
    try:
        value = float(text) if text else DEFAULT_AUTH_GRACE
    except ValueError:
        value = DEFAULT_AUTH_GRACE
    if not 1.0 <= value <= 86400.0:
        logger.warning("HYPHA_AUTH_GRACE=%r is not within 1..86400 s; using %g", text, DEFAULT_AUTH_GRACE)
        return DEFAULT_AUTH_GRACE
    return value


#: A parameter server's current transfer token, in its work dir (``HYPHA_TRANSFER_TOKEN_FILE``).
TOKEN_FILE = ".transfer-token"
#: A parameter server's job JSON, in its work dir (``--job-file``): it holds the eval slices' URLs with their
#: tokens, which on the command line every user of the machine would read in ``ps``.
JOB_FILE = ".job.json"


def write_token_file(path: Path, token: str) -> None:
    """Replace ``path``'s content with ``token`` (or any ASCII secret: a job JSON) at once (readable by this
    user only)."""
    partial = path.with_name(f".{path.name}.part")
    descriptor = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    with os.fdopen(descriptor, "w", encoding="ascii") as file:
        file.write(token)
    os.replace(partial, path)


class JobManager:
    """Starts, watches and stops this daemon's tasks (see the module docstring).

    ``book`` is the session's lease book (read only); ``server_url`` the control plane's address as given to
    ``--server``. ``kill_grace`` (default: the config's) is the SIGTERM→SIGKILL delay in seconds;
    ``request_timeout`` bounds each bridge request to the control plane. ``backend_options`` and
    ``bridge_options`` are passed to every :class:`RemoteBackend` and :func:`serve_bridge` (tests shrink
    their timeouts with them). Warm spares (config ``warm_start``) are kept once :meth:`start_spares` is
    called: the daemon calls it when it starts.
    """

    def __init__(
        self,
        *,
        config: WorkerConfig,
        book: LeaseBook,
        server_url: str,
        link: ControlLink | None = None,
        kill_grace: float | None = None,
        request_timeout: float = 30.0,
        backend_options: Mapping[str, Any] | None = None,
        bridge_options: Mapping[str, Any] | None = None,
    ) -> None:
        self.config = config
        self.book = book
        self.server_url = http_base_url(server_url)
        self.link = link if link is not None else ControlLink()
        self.kill_grace = config.kill_grace if kill_grace is None else kill_grace
        self.request_timeout = request_timeout
        self.backend_options = dict(backend_options or {})
        self.bridge_options = dict(bridge_options or {})
        self.tasks: dict[uuid.UUID, Task] = {}
        #: How the last tasks ended, by task id: a dispatch repeated after a reconnect (the control plane had
        #: not heard of the exit yet) is answered with the exit again, never with a second run.
        self.finished: OrderedDict[uuid.UUID, protocol.JobExited] = OrderedDict()
        self.closing = False
        #: The warm spare for the built-in runtimes, kept while no task runs.
        self.spares = Spares(
            runtimes=[executor.runtime for executor in config.executors] if config.warm_start else (),
            environment=base_environment,
            preexec=die_with_parent,
            wanted=lambda: not self.tasks and not self.closing,
        )

    def start_spares(self) -> None:
        """Keep a warm spare from now on (while no task runs), if ``warm_start`` is on and a built-in runtime
        is configured; idempotent. The daemon calls it at start, after its benchmark."""
        self.spares.activate()

    # --- control-plane messages ----------------------------------------------------------------------------

    def handle(self, message: protocol.ServerMessage) -> bool:
        """Act on a message that concerns tasks; False for any other message."""
        match message:
            case protocol.DispatchJob():
                with telemetry.span(
                    "dispatch_job",
                    **{
                        "hypha.job_id": message.job_id,
                        "hypha.task_id": message.task_id,
                        "hypha.role": message.role,
                        "hypha.lease_id": message.lease_id,
                    },
                ) as current:
                    task = self.start(message)
                    telemetry.annotate(current, **{"hypha.started": task is not None})
            case protocol.TransferToken():
                self.refresh_token(message.task_id, message.transfer_token)
            case protocol.CancelJob():
                with telemetry.span("cancel_job", **{"hypha.task_id": message.task_id}) as current:
                    found = self.cancel(
                        message.task_id, reason=message.reason or "cancelled by the control plane"
                    )
                    telemetry.annotate(current, **{"hypha.found": found})
                if not found:
                    logger.info("cancel_job for task %s, which does not run here", message.task_id)
            case protocol.StatusReply() | protocol.SliceAssigned():
                self.link.resolve(message)
            case _:
                return False
        return True

    def refresh_token(self, task_id: uuid.UUID, token: str) -> bool:
        """A running task's fresh transfer token: its bridge uses it from now on, and a parameter server reads
        it from its token file before each call to the control plane. False if the task does not run here."""
        task = self.tasks.get(task_id)
        if task is None:
            return False
        task.dispatch = task.dispatch.model_copy(update={"transfer_token": token})
        if task.backend is not None:
            task.backend.transfer_token = token
        if task.work_dir is not None and task.executor.runtime == "parameter-server":
            write_token_file(task.work_dir / TOKEN_FILE, token)
        return True

    def start(self, dispatch: protocol.DispatchJob) -> Task | None:
        """Start the task ``dispatch`` describes, or refuse it with a ``job_exited``; None when not started."""
        ended = self.finished.get(dispatch.task_id)
        if ended is not None:
            logger.info("task %s has ended already; dispatch answered with its exit again", dispatch.task_id)
            self.link.post(ended)
            return None
        existing = self.tasks.get(dispatch.task_id)
        if existing is not None:
            # A repeated dispatch (after a reconnect, or to say where its peers are now): the task runs already;
            # say so again, and take the peers' addresses, which the control plane may have learnt since.
            if dispatch.peers != existing.dispatch.peers or dispatch.relay != existing.dispatch.relay:
                logger.info(
                    "task %s: peers now %s (relay: %s)", dispatch.task_id, dispatch.peers, dispatch.relay
                )
                existing.dispatch = existing.dispatch.model_copy(
                    update={"peers": dispatch.peers, "relay": dispatch.relay}
                )
            else:
                logger.info("task %s is already running; its peers told again", dispatch.task_id)
            if existing.backend is not None and dispatch.peers:
                # Even at the same address, a parameter server may have been restarted: the bridge sends
                # it an update it may have lost.
                existing.backend.update_peers(dispatch.peers, relay=dispatch.relay)
            if existing.started:
                self.link.post(protocol.JobStarted(task_id=dispatch.task_id))
            return None
        executor, reason = self._check(dispatch)
        if executor is None:
            logger.warning("refusing task %s of job %s: %s", dispatch.task_id, dispatch.job_id, reason)
            self.link.post(protocol.JobExited(task_id=dispatch.task_id, reason=reason))
            return None
        task = Task(dispatch=dispatch, executor=executor)
        self.tasks[dispatch.task_id] = task
        task.runner = asyncio.create_task(self._run(task), name=f"task-{dispatch.task_id}")
        logger.info(
            "starting task %s of job %s (role %s, executor %s/%s, lease %s)",
            dispatch.task_id,
            dispatch.job_id,
            dispatch.role,
            executor.executor_class,
            executor.name,
            dispatch.lease_id,
        )
        return task

    def fail(self, task_id: uuid.UUID, *, reason: str) -> bool:
        """Stop a task that cannot go on and report it failed with ``reason`` (not cancelled: the control
        plane fails its job with the reason); False if it is not running here or already being stopped."""
        task = self.tasks.get(task_id)
        if task is None or task.cancel_reason is not None or task.failure_reason is not None:
            return False
        task.failure_reason = reason
        logger.error("task %s failed: %s", task_id, reason)
        task.cancel_requested.set()
        return True

    def cancel(self, task_id: uuid.UUID, *, reason: str) -> bool:
        """Stop a task (SIGTERM, SIGKILL after the grace); False if it is not running here."""
        task = self.tasks.get(task_id)
        if task is None:
            return False
        if task.cancel_reason is None:
            task.cancel_reason = reason
            logger.info("cancelling task %s: %s", task_id, reason)
        task.cancel_requested.set()
        return True

    def cancel_orphans(self) -> list[uuid.UUID]:
        """Cancel every task whose lease the book no longer holds (ended, pruned, dropped at welcome)."""
        orphans = [
            task
            for task in self.tasks.values()
            if task.cancel_reason is None and self.book.lease(task.lease_id) is None
        ]
        for task in orphans:
            self.cancel(task.task_id, reason=f"lease {task.lease_id} ended")
        return [task.task_id for task in orphans]

    async def wait(self, task_id: uuid.UUID) -> protocol.JobExited | None:
        """Wait until the task has ended and been cleaned up; its ``job_exited``, or None if unknown."""
        task = self.tasks.get(task_id)
        if task is None or task.runner is None:
            return None
        return await asyncio.shield(task.runner)

    async def stop_all(self, *, reason: str = SHUTDOWN_REASON, timeout: float | None = None) -> None:
        """Refuse new tasks, kill the warm spare, cancel every running task and wait for them (at most
        ``timeout`` seconds; default: the kill grace plus 5 s)."""
        self.closing = True
        runners = [task.runner for task in self.tasks.values() if task.runner is not None]
        for task_id in list(self.tasks):
            self.cancel(task_id, reason=reason)
        await self.spares.close()
        if not runners:
            return
        _, pending = await asyncio.wait(
            runners, timeout=self.kill_grace + 5.0 if timeout is None else timeout
        )
        if pending:
            logger.warning("%d task(s) did not stop in time", len(pending))

    # --- running a task ------------------------------------------------------------------------------------

    def _check(self, dispatch: protocol.DispatchJob) -> tuple[ExecutorConfig | None, str]:
        if self.closing:
            return None, SHUTDOWN_REASON
        lease = self.book.lease(dispatch.lease_id)
        if lease is None:
            return None, f"lease {dispatch.lease_id} is not held (active) by this worker"
        if lease.job_id != dispatch.job_id:
            return None, f"lease {dispatch.lease_id} belongs to job {lease.job_id}, not {dispatch.job_id}"
        key = executor_key(dispatch.spec)
        if key is None:
            return None, "the job spec names no executor (executor.class and executor.descriptor.name)"
        executor = self.config.find_executor(*key)
        if executor is None:
            return None, f"no executor {key[0]}/{key[1]} is configured on this worker"
        return executor, ""

    async def _run(self, task: Task) -> protocol.JobExited:
        dispatch = task.dispatch
        # The task's lifetime, from its launch to its job_exited (a child of the dispatch_job span; the
        # bridge's requests, served in this task's context, are its children).
        with telemetry.span(
            "task",
            **{
                "hypha.job_id": dispatch.job_id,
                "hypha.task_id": dispatch.task_id,
                "hypha.role": dispatch.role,
                "hypha.executor": f"{task.executor.executor_class}/{task.executor.name}",
            },
        ) as current:
            exited = await self._launch_and_supervise(task)
            telemetry.annotate(
                current,
                **{
                    "hypha.exit_code": exited.exit_code,
                    "hypha.signal": exited.signal,
                    "hypha.cancelled": exited.cancelled,
                    "hypha.reason": exited.reason or None,
                },
            )
        return exited

    async def _launch_and_supervise(self, task: Task) -> protocol.JobExited:
        try:
            try:
                await self._launch(task)
            except (LaunchError, OSError) as error:
                logger.error("task %s could not be started: %s", task.task_id, error)
                exited = protocol.JobExited(
                    task_id=task.task_id,
                    cancelled=task.cancel_reason is not None,
                    reason=f"could not start: {error}"[:2000],
                    log_tail=task.log_tail(),
                )
            else:
                task.started = True
                self.link.post(protocol.JobStarted(task_id=task.task_id))
                exited = await self._supervise(task)
        except BaseException:
            # The daemon's loop is going away: at least leave no process and no directory behind.
            self._signal(task, signal.SIGKILL)
            await self._clean_up(task)
            self.tasks.pop(task.task_id, None)
            raise
        await self._clean_up(task)
        self.tasks.pop(task.task_id, None)
        self.spares.ensure()  # the daemon may be idle now: a spare for the next task
        self.finished[task.task_id] = exited
        while len(self.finished) > FINISHED_REMEMBERED:
            self.finished.popitem(last=False)
        logger.info(
            "task %s exited: %s",
            task.task_id,
            f"signal {exited.signal}" if exited.signal is not None else f"exit code {exited.exit_code}",
        )
        self.link.post(exited)
        return exited

    async def _launch(self, task: Task) -> None:
        dispatch = task.dispatch
        base = self.config.work_dir
        base.mkdir(parents=True, exist_ok=True)
        work_dir = base / f"hypha-{uuid.uuid4()}"
        work_dir.mkdir(mode=WORK_DIR_MODE)
        task.work_dir = work_dir
        os.chmod(work_dir, WORK_DIR_MODE)  # mkdir's mode is filtered by the umask
        socket_path = work_dir / SOCKET_NAME
        if len(os.fsencode(socket_path)) > MAX_SOCKET_PATH:
            # A Unix socket path has at most 107 bytes; a deep work_dir would make the job unrunnable. The
            # executor is told SOCKET_PATH explicitly, so the socket may live in a short private dir instead.
            socket_dir = Path(tempfile.mkdtemp(prefix="hypha-"))  # 0700, like the work dir
            task.socket_dir = socket_dir
            socket_path = socket_dir / SOCKET_NAME
            if len(os.fsencode(socket_path)) > MAX_SOCKET_PATH:
                raise LaunchError(
                    f"socket path {socket_path} is too long for a Unix socket; set TMPDIR shorter"
                )
            logger.info(
                "task %s: work dir path too long for a socket; socket at %s", task.task_id, socket_path
            )
        task.socket_path = socket_path
        backend_options = {
            "request_timeout": self.request_timeout,
            "auth_grace": auth_grace(),
            **self.backend_options,
        }
        # An inference task's slices and results follow the inference contract (docs/inference.md).
        backend_class = InferenceBackend if task.executor.executor_class == INFERENCE_CLASS else RemoteBackend
        task.backend = backend_class(
            task_id=dispatch.task_id,
            job_id=str(dispatch.job_id),
            link=self.link,
            work_dir=work_dir,
            peers=dispatch.peers,
            relay_peers=dispatch.relay,
            server_url=self.server_url,
            transfer_token=dispatch.transfer_token,
            on_authorisation_lost=lambda reason: self.fail(dispatch.task_id, reason=reason),
            **backend_options,
        )
        bridge_options = {"status_timeout": backend_options["request_timeout"] + 1.0, **self.bridge_options}
        task.bridge = await serve_bridge(
            socket_path=socket_path,
            work_dir=work_dir,
            backend=task.backend,
            job_id=str(dispatch.job_id),
            **bridge_options,
        )
        argv, environment = self._command(task)
        if task.cancel_requested.is_set():
            raise LaunchError(task.cancel_reason or "cancelled")
        # An executor with its own ``env`` starts cold: the spare imported its libraries without those variables.
        warm = task.executor.runtime in WARM_RUNTIMES and not task.executor.env
        spare = self.spares.take(base_environment()) if warm else None
        if spare is not None:
            task.process, task.warm = spare.process, True
            self.spares.hand_out(spare, argv=argv, environment=environment)
            logger.info(
                "task %s runs as pid %d in %s (a warm spare, %s)",
                task.task_id,
                spare.process.pid,
                work_dir,
                "ready" if spare.ready_after is not None else "still importing",
            )
            return
        try:
            task.process = await asyncio.create_subprocess_exec(
                *argv,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
                env=environment,
                start_new_session=True,
                preexec_fn=die_with_parent,
            )
        except OSError as error:
            raise LaunchError(f"{argv[0]}: {error.strerror or error}") from None
        logger.info("task %s runs as pid %d in %s", task.task_id, task.process.pid, work_dir)

    def _command(self, task: Task) -> tuple[list[str], dict[str, str]]:
        """The argv and environment of the task's process."""
        assert task.work_dir is not None and task.socket_path is not None
        dispatch = task.dispatch
        values = {
            "SOCKET_PATH": str(task.socket_path),
            "WORK_DIR": str(task.work_dir),
            "JOB_JSON": json.dumps(dispatch.spec, separators=(",", ":")),
        }
        environment = base_environment()
        # The executor's own variables (config ``env``); the reserved names the daemon sets below are refused
        # when the config is loaded, so none of these can override them.
        environment.update(task.executor.env)
        environment.update(values)
        # The experiment knob (config ``slowdown``): the training executor sleeps (factor − 1) × each step.
        environment["HYPHA_SLOWDOWN"] = repr(self.config.slowdown)
        # The other experiment knob (config ``byzantine``): "" is honest.
        environment["HYPHA_BYZANTINE"] = self.config.byzantine
        if self.book.devices:
            # A worker that lists its devices shows each task only its lease's (none: "" hides every GPU, so a
            # CPU-only task cannot take a device another lease holds). Without a device list it is left alone.
            lease = self.book.lease(task.lease_id)
            devices = lease.devices if lease is not None else ()
            environment[DEVICE_VARIABLE] = protocol.cuda_visible_devices(devices)
        executor = task.executor
        if executor.runtime == "process":
            assert executor.cmd is not None
            return [executor.cmd, *(substitute(argument, values) for argument in executor.args)], environment
        if executor.runtime in ("trainer", "inference"):
            module = TRAINER_MODULE if executor.runtime == "trainer" else INFERENCE_MODULE
            argv = [sys.executable, "-m", module, "--socket", values["SOCKET_PATH"]]
            return [*argv, "--work-dir", values["WORK_DIR"]], environment
        settings = self.config.parameter_server
        job_file = task.work_dir / JOB_FILE
        write_token_file(job_file, values["JOB_JSON"])
        argv = [
            sys.executable,
            "-m",
            "parameter_server",
            "--socket",
            values["SOCKET_PATH"],
            "--work-dir",
            values["WORK_DIR"],
            "--job-file",
            str(job_file),
            "--host",
            settings.host,
            "--port",
            str(settings.port),
        ]
        if settings.public_url:
            argv += ["--public-url", settings.public_url]
        environment["HYPHA_SERVER_URL"] = self.server_url
        for variable, value in (
            ("HYPHA_TRANSFER_KEY", dispatch.transfer_key),
            ("HYPHA_TRANSFER_TOKEN", dispatch.transfer_token),
        ):
            if value is not None:
                environment[variable] = value
            else:
                environment.pop(variable, None)
        environment.pop("HYPHA_TRANSFER_TOKEN_FILE", None)
        if dispatch.transfer_token is not None:
            # Tokens are short-lived: the fresh ones the control plane sends replace this file's content.
            token_file = task.work_dir / TOKEN_FILE
            write_token_file(token_file, dispatch.transfer_token)
            environment["HYPHA_TRANSFER_TOKEN_FILE"] = str(token_file)
        return argv, environment

    async def _supervise(self, task: Task) -> protocol.JobExited:
        process = task.process
        assert process is not None
        readers = [
            asyncio.create_task(self._relay_output(task, stream))
            for stream in (process.stdout, process.stderr)
            if stream is not None
        ]
        exit_wait = asyncio.create_task(process.wait())
        cancel_wait = asyncio.create_task(task.cancel_requested.wait())
        forwarder = asyncio.create_task(self._forward_output(task))
        try:
            await asyncio.wait({exit_wait, cancel_wait}, return_when=asyncio.FIRST_COMPLETED)
            if not exit_wait.done():
                self._signal(task, signal.SIGTERM)
                try:
                    await asyncio.wait_for(asyncio.shield(exit_wait), self.kill_grace)
                except TimeoutError:
                    logger.warning(
                        "task %s did not stop within %gs of SIGTERM; sending SIGKILL",
                        task.task_id,
                        self.kill_grace,
                    )
                    self._signal(task, signal.SIGKILL)
                    await exit_wait
        finally:
            cancel_wait.cancel()
            forwarder.cancel()
        # Whatever of its process group is still around (children that outlived the leader) goes too.
        self._signal(task, signal.SIGKILL)
        _, pending = await asyncio.wait(readers, timeout=OUTPUT_DRAIN_TIMEOUT)
        for reader in pending:
            reader.cancel()
        await asyncio.gather(*readers, return_exceptions=True)
        self._flush_output(task)
        code = process.returncode
        assert code is not None
        exit_code, signal_number = (None, -code) if code < 0 else (code, None)
        cancelled = task.cancel_reason is not None
        if cancelled:
            reason = task.cancel_reason or ""
        elif task.failure_reason is not None:
            reason = task.failure_reason
        elif signal_number is not None:
            reason = f"killed by signal {signal_number}"
        else:
            # The executor's own failure, not the launcher's wrapper of it (worker_daemon.failures).
            reason = "" if code == 0 else root_cause(task.output) or f"exited with code {code}"
        return protocol.JobExited(
            task_id=task.task_id,
            exit_code=exit_code,
            signal=signal_number,
            cancelled=cancelled,
            reason=reason[:2000],
            log_tail=task.log_tail(),
        )

    async def _relay_output(self, task: Task, stream: asyncio.StreamReader) -> None:
        """Log the stream line by line with the task's prefix and keep the last lines for the log tail."""
        prefix = str(task.task_id)[:8]
        buffer = b""
        while True:
            chunk = await stream.read(65536)
            buffer += chunk
            # \r ends a line too: progress bars redraw with it.
            parts = re.split(rb"\r\n|\n|\r", buffer)
            buffer = parts.pop() if chunk else b""
            while len(buffer) > MAX_LINE:
                parts.append(buffer[:MAX_LINE])
                buffer = buffer[MAX_LINE:]
            for part in parts:
                line = part.decode("utf-8", errors="replace").rstrip()
                if line:
                    task.output.append(line)
                    task.unsent.append(line[:1000])
                    task.unsent_chars += len(task.unsent[-1])
                    while len(task.unsent) > LOG_BUFFER_LINES or task.unsent_chars > LOG_BUFFER_CHARS:
                        task.unsent_chars -= len(task.unsent.popleft())
                        task.unsent_dropped += 1
                    logger.info("[task %s] %s", prefix, line)
            if not chunk:
                return

    async def _forward_output(self, task: Task) -> None:
        """Post the task's new output lines every :data:`LOG_FORWARD_INTERVAL` while it runs (the rest once
        its output has ended, before its ``job_exited``)."""
        while True:
            await asyncio.sleep(LOG_FORWARD_INTERVAL)
            self._flush_output(task)

    def _flush_output(self, task: Task) -> None:
        """Post the task's unsent output lines, at most :data:`LOG_BATCH_LINES` and :data:`LOG_BATCH_CHARS` a
        frame."""
        lines = list(task.unsent)
        task.unsent.clear()
        task.unsent_chars = 0
        if task.unsent_dropped:
            lines.insert(
                0,
                f"[hypha: {task.unsent_dropped} lines of output were not forwarded (more than "
                f"{LOG_BUFFER_LINES} lines or {LOG_BUFFER_CHARS} characters in {LOG_FORWARD_INTERVAL:g} s)]",
            )
            task.unsent_dropped = 0
        batch: list[str] = []
        chars = 0
        for line in lines:
            if batch and (len(batch) == LOG_BATCH_LINES or chars + len(line) > LOG_BATCH_CHARS):
                self.link.post(protocol.TaskLog(task_id=task.task_id, lines=batch))
                batch, chars = [], 0
            batch.append(line)
            chars += len(line)
        if batch:
            self.link.post(protocol.TaskLog(task_id=task.task_id, lines=batch))

    def _signal(self, task: Task, signal_number: signal.Signals) -> None:
        process = task.process
        if process is None:
            return
        # The process leads its own session and group (start_new_session), so the group id is its pid.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(process.pid, signal_number)

    async def _clean_up(self, task: Task) -> None:
        if task.bridge is not None:
            bridge, task.bridge = task.bridge, None
            try:
                await bridge.close()
            except Exception:
                logger.exception("closing the bridge of task %s failed", task.task_id)
        if task.backend is not None:
            backend, task.backend = task.backend, None
            try:
                await backend.close()
            except Exception:
                logger.exception("closing the backend of task %s failed", task.task_id)
        if task.socket_dir is not None:
            await asyncio.to_thread(shutil.rmtree, task.socket_dir, ignore_errors=True)
        if task.work_dir is not None:
            if os.environ.get("HYPHA_KEEP_WORK_DIRS") == "1":
                # For debugging and for the end-to-end test, which compares the parameter server's last
                # checkpoint with the model the control plane serves. The socket goes either way.
                logger.info("task %s: keeping %s (HYPHA_KEEP_WORK_DIRS=1)", task.task_id, task.work_dir)
                if task.socket_path is not None:
                    task.socket_path.unlink(missing_ok=True)
            else:
                await asyncio.to_thread(shutil.rmtree, task.work_dir, ignore_errors=True)
