"""The job manager's line to the control plane: an ordered outbox and request/reply futures.

Tasks (and their bridges) talk to the control plane through one :class:`ControlLink`, whatever the state of the
websocket:

* :meth:`ControlLink.post` queues a frame (``job_started``, ``job_exited``, ``slice_ack``, …). Frames go out
  in the order they were posted, as soon as a connection is up; posted while disconnected, they wait for the
  next ``welcome`` (the connection layer calls :meth:`ControlLink.connected` then).
* :meth:`ControlLink.request` posts a frame that carries a ``request_id`` (``status``, ``fetch_slice``) and
  waits, bounded by its timeout, for the reply with that id, which the connection layer hands to
  :meth:`ControlLink.resolve`. A request whose reply was lost with its connection is sent again, with the same
  ``request_id``, after the next ``welcome``.

The link holds no websocket: :meth:`ControlLink.connected` gives it an async ``send`` hook, and
:meth:`ControlLink.disconnected` takes it away again.

The outbox is bounded (:data:`MAX_QUEUED` frames) without losing what changes state at the control plane: while
disconnected, a task's ``task_log`` frames waiting at its tail merge into one (up to :data:`LOG_MERGE_LINES`
lines and :data:`LOG_MERGE_CHARS` characters), and when it is full the oldest ``task_log`` frame goes first
(then the oldest ``transfer_problem``, a report a later one supersedes). ``job_started``, ``job_exited``, slice acks, requests and
the rest are never dropped: with nothing droppable left the outbox grows past its bound (they are few: one per
task event, and requests leave it when they time out). The dropped lines of a task are said in its log, in a
line sent before its next ``task_log`` or its ``job_exited``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections import deque
from collections.abc import Awaitable, Callable

from worker_daemon import protocol

logger = logging.getLogger(__name__)

SendHook = Callable[[protocol.DaemonMessage], Awaitable[None]]
Request = protocol.StatusReport | protocol.FetchSlice
Reply = protocol.StatusReply | protocol.SliceAssigned

#: Frames kept while disconnected; beyond it the oldest log frames are dropped (with a warning), never a frame
#: that changes state (see the module docstring).
MAX_QUEUED = 10_000
#: Bounds of a ``task_log`` frame merged from waiting ones: those of the job manager's own batches
#: (``worker_daemon.jobs.LOG_BATCH_LINES`` / ``LOG_BATCH_CHARS``; the protocol takes 200 lines of 1000).
LOG_MERGE_LINES = 100
LOG_MERGE_CHARS = 32 * 1024
#: Frames dropped to make room, in this order of preference: the oldest of the first type queued goes.
DROPPABLE = (protocol.TaskLog, protocol.TransferProblem)


class ControlLink:
    """An outbox to the control plane that survives reconnects, and the futures of pending requests."""

    def __init__(self, *, max_queued: int = MAX_QUEUED) -> None:
        self._outbox: deque[protocol.DaemonMessage] = deque()
        self._max_queued = max_queued
        self._pending: dict[uuid.UUID, tuple[asyncio.Future[Reply], Request]] = {}
        self._wake = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        self._flusher: asyncio.Task[None] | None = None
        #: Lines of ``task_log`` frames dropped for room, by task, not said in its log yet.
        self._dropped_lines: dict[uuid.UUID, int] = {}
        self._over_bound_warned = False

    @property
    def is_connected(self) -> bool:
        return self._flusher is not None and not self._flusher.done()

    @property
    def queued(self) -> list[protocol.DaemonMessage]:
        """The frames not sent yet, oldest first."""
        return list(self._outbox)

    # --- used by the connection layer --------------------------------------------------------------------

    def connected(self, send: SendHook) -> None:
        """A connection is up and welcomed: start sending the outbox through ``send``."""
        self.disconnected()
        if self._outbox:
            self._idle.clear()
        self._flusher = asyncio.create_task(self._flush_forever(send))

    def disconnected(self) -> None:
        """The connection is gone: stop sending, and queue again the requests whose replies died with it."""
        if self._flusher is not None:
            self._flusher.cancel()
            self._flusher = None
        unanswered = [
            message
            for future, message in self._pending.values()
            if not future.done() and message not in self._outbox
        ]
        # They were sent before anything still queued, so they go first again.
        self._outbox.extendleft(reversed(unanswered))
        self._idle.set()

    def resolve(self, reply: Reply) -> bool:
        """Hand a reply to the request waiting for it; False when none waits (late, or not ours)."""
        entry = self._pending.get(reply.request_id)
        if entry is None or entry[0].done():
            logger.debug("no request waits for %s %s", reply.type, reply.request_id)
            return False
        entry[0].set_result(reply)
        return True

    async def flush(self, *, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds until everything posted so far is sent; False if it is not (or if
        there is no connection to send it on)."""
        if not self.is_connected:
            return not self._outbox
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout):
                # _idle is cleared by post() and set by the sender once the outbox is empty (or it failed).
                while self.is_connected and (self._outbox or not self._idle.is_set()):
                    if self._outbox:
                        self._idle.clear()
                    await self._idle.wait()
        return not self._outbox

    # --- used by tasks -------------------------------------------------------------------------------------

    def post(self, message: protocol.DaemonMessage) -> None:
        """Queue ``message``; it is sent as soon as (and in the order that) a connection allows. A full outbox
        drops its oldest log frame for it, never a frame that changes state (see the module docstring)."""
        if not (isinstance(message, protocol.TaskLog) and self._merged(message)):
            if len(self._outbox) >= self._max_queued:
                self._make_room()
            self._outbox.append(message)
        self._idle.clear()
        self._wake.set()

    async def request(self, message: Request, *, timeout: float) -> Reply:
        """Send ``message`` and return the reply with its ``request_id``; :class:`TimeoutError` when none
        arrives within ``timeout`` seconds (waiting for a connection included)."""
        future: asyncio.Future[Reply] = asyncio.get_running_loop().create_future()
        self._pending[message.request_id] = (future, message)
        try:
            self.post(message)
            async with asyncio.timeout(timeout):
                return await future
        finally:
            self._pending.pop(message.request_id, None)
            # Not sent yet: a stale request must not reach the control plane later.
            with contextlib.suppress(ValueError):
                self._outbox.remove(message)

    # --- internals -----------------------------------------------------------------------------------------

    def _merged(self, message: protocol.TaskLog) -> bool:
        """While disconnected, append ``message``'s lines to the frame at the outbox's tail when that is the
        same task's log and the two fit one frame; True if they did. (Connected, frames go out as posted.)"""
        if self.is_connected or not self._outbox:
            return False
        tail = self._outbox[-1]
        if not isinstance(tail, protocol.TaskLog) or tail.task_id != message.task_id:
            return False
        lines = [*tail.lines, *message.lines]
        if len(lines) > LOG_MERGE_LINES or sum(map(len, lines)) > LOG_MERGE_CHARS:
            return False
        self._outbox[-1] = protocol.TaskLog(task_id=tail.task_id, lines=lines)
        return True

    def _make_room(self) -> None:
        """Drop the oldest droppable frame (:data:`DROPPABLE`); with none queued, drop nothing."""
        for kind in DROPPABLE:
            for index, queued in enumerate(self._outbox):
                if isinstance(queued, kind):
                    del self._outbox[index]
                    if isinstance(queued, protocol.TaskLog):
                        self._dropped_lines[queued.task_id] = self._dropped_lines.get(
                            queued.task_id, 0
                        ) + len(queued.lines)
                    return
        if not self._over_bound_warned:
            self._over_bound_warned = True
            logger.warning(
                "outbox full (%d frames) of frames that change state at the control plane: keeping them all",
                self._max_queued,
            )

    def _with_drops_said(self, message: protocol.DaemonMessage) -> protocol.DaemonMessage:
        """The frame to send for ``message`` (the head of the outbox, taken off it): a task's dropped log lines
        are said first, in its next ``task_log`` or just before its ``job_exited``."""
        if not isinstance(message, protocol.TaskLog | protocol.JobExited):
            return message
        dropped = self._dropped_lines.pop(message.task_id, 0)
        if not dropped:
            return message
        notice = (
            f"[hypha: {dropped} lines of output were not forwarded (the control plane was unreachable and the "
            "daemon's outbox was full)]"
        )
        if isinstance(message, protocol.TaskLog) and len(message.lines) < LOG_MERGE_LINES:
            return protocol.TaskLog(task_id=message.task_id, lines=[notice, *message.lines])
        self._outbox.appendleft(message)  # the notice goes first, on its own
        return protocol.TaskLog(task_id=message.task_id, lines=[notice])

    async def _flush_forever(self, send: SendHook) -> None:
        while True:
            if not self._outbox:
                self._idle.set()
                self._wake.clear()
                await self._wake.wait()
                continue
            self._idle.clear()
            message = self._with_drops_said(self._outbox.popleft())
            try:
                await send(message)
            except asyncio.CancelledError:
                self._outbox.appendleft(message)
                raise
            except Exception as error:
                # The connection layer sees the broken connection too and calls disconnected(); until the next
                # welcome the frame waits at the head of the outbox.
                self._outbox.appendleft(message)
                self._idle.set()
                logger.info("sending %s failed (%s); it waits for the next connection", message.type, error)
                return
