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

#: Frames kept while disconnected; beyond it the oldest are dropped (with a warning). A daemon that is offline
#: this long has lost its leases anyway, and the control plane has failed their jobs.
MAX_QUEUED = 10_000


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
        """Queue ``message``; it is sent as soon as (and in the order that) a connection allows."""
        if len(self._outbox) >= self._max_queued:
            dropped = self._outbox.popleft()
            logger.warning(
                "outbox full (%d frames): dropping the oldest, a %s", self._max_queued, dropped.type
            )
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

    async def _flush_forever(self, send: SendHook) -> None:
        while True:
            if not self._outbox:
                self._idle.set()
                self._wake.clear()
                await self._wake.wait()
                continue
            self._idle.clear()
            message = self._outbox.popleft()
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
