"""The worker gateway: the websocket that worker daemons connect to, outbound, at ``/ws/worker/``.

Authentication is the ``Authorization: Bearer <token>`` header of the handshake. A refused token still gets
the connection accepted so that an :class:`~worker_daemon.protocol.Error` frame can say why before the close
(daphne drops close reasons); the close code says it too (:class:`~worker_daemon.protocol.CloseCode`).
The ``Hypha-Daemon-Instance`` header names the daemon process: the newest connection of a worker wins (the
older one is closed with 4009), and a process a newer one superseded is refused with 4009 when it comes back
(:func:`apps.workers.services.record_connection`). A revoked token's connection is closed with 4003, frames
still in flight are dropped, and whatever lease the worker won meanwhile ends when the connection closes.

The consumer validates frames and calls :mod:`apps.jobs.services`; it holds no market logic.

Limits, per connection, checked as each frame *arrives* (:meth:`WorkerGatewayConsumer.__call__`): channels
hands a consumer its next frame only once it has handled the previous one, and daphne queues the rest without
bound, so a limit applied when a frame is handled would see a flood only after it had queued up. Here a reader
task takes every frame from daphne as it comes and applies token buckets of frames and bytes
(``HYPHA_WS_RATE``/``HYPHA_WS_BURST``, ``HYPHA_WS_BYTES_RATE``/``HYPHA_WS_BYTES_BURST``; see
:mod:`apps.workers.ratelimit`): a frame over them is answered with a ``rate_limited`` error frame and dropped,
and a connection that goes on regardless (more than ``HYPHA_WS_FLOOD_REFUSALS`` refused frames in 10 s) is
closed with 4008. Admitted frames wait in the connection's backlog; one more than ``HYPHA_WS_BACKLOG`` frames
or ``HYPHA_WS_BACKLOG_BYTES`` bytes received but not yet handled closes the connection with 4008 too, and a
closed connection's backlog is dropped unhandled. A frame over ``HYPHA_WS_MAX_MESSAGE_BYTES`` gets
``too_large``. All are logged (refusals at most once per 5 s per connection).

Other connections are not affected: a connection's frames are handled one at a time, so it has at most one
database call waiting in asgiref's single database thread, whose queue is first come, first served — however
much one daemon sends, every other connection's next call waits behind at most one of its calls.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections import deque

from channels.db import database_sync_to_async
from channels.generic.websocket import AsyncWebsocketConsumer
from django.conf import settings

from apps.datasets.exceptions import DatasetError
from apps.jobs import services as job_services
from apps.jobs.exceptions import TaskRefused
from apps.market.exceptions import OfferRefused
from apps.workers import services as worker_services
from apps.workers.exceptions import AuthenticationFailed
from apps.workers.models import Worker
from apps.workers.ratelimit import FLOOD_WINDOW, FrameRateLimit
from hypha_site import metrics, telemetry
from worker_daemon import protocol

logger = logging.getLogger(__name__)

#: Adverts whose offer windows a connection remembers (the oldest are forgotten first).
MAX_KNOWN_WINDOWS = 1000
#: An offer is declined by the gateway itself only this many seconds after its window closed by the gateway's
#: clock (the market's own check, on the database's clock, decides the close calls).
WINDOW_SLACK = 0.25
#: Seconds between ``last_seen_at`` writes for a busy connection.
TOUCH_INTERVAL = 5.0
#: channels_redis forgets group members after a day (its ``group_expiry``); a daemon connected for weeks
#: re-joins its group well before that.
GROUP_REFRESH_INTERVAL = 3600.0
#: The handshake header naming the daemon process (``worker_daemon.connection.INSTANCE_HEADER``), and what
#: a value must look like to be kept (the daemon sends 32 hex digits; anything else is ignored).
INSTANCE_HEADER = b"hypha-daemon-instance"
INSTANCE_PATTERN = re.compile(r"[A-Za-z0-9_-]{1,64}")


class WorkerGatewayConsumer(AsyncWebsocketConsumer):
    worker = None
    greeted = False
    #: Set once the connection started joining its channel-layer group (left again on disconnect).
    joined = False
    #: Set once the gateway closed the connection itself: frames still in flight are ignored.
    closing = False
    #: Set when the connection is closed because the worker's token was revoked.
    revoked = False
    #: The daemon process's id from the handshake ("" when it sent none or an invalid one).
    instance = ""

    # --- arrivals: limits applied as frames come in, before they wait to be handled -----------------------

    async def __call__(self, scope, receive, send) -> None:
        """Run the consumer with channels' dispatch loop reading from this connection's bounded backlog, which
        a reader task fills from daphne's ``receive`` as frames arrive (see the module docstring)."""
        self.scope = scope
        #: Messages from daphne admitted but not yet dispatched, and how many frames and bytes they hold.
        self.backlog: deque[dict] = deque()
        self.backlog_frames = self.backlog_bytes = 0
        self.backlog_ready = asyncio.Event()
        self.rate_limit = FrameRateLimit(
            rate=settings.HYPHA_WS_RATE,
            burst=settings.HYPHA_WS_BURST,
            flood_refusals=settings.HYPHA_WS_FLOOD_REFUSALS,
            now=time.monotonic(),
            byte_rate=settings.HYPHA_WS_BYTES_RATE,
            byte_burst=settings.HYPHA_WS_BYTES_BURST,
        )
        self.reader = asyncio.create_task(self._read_arrivals(receive))
        try:
            await super().__call__(scope, self._next_arrival, send)
        finally:
            self.reader.cancel()
            await asyncio.gather(self.reader, return_exceptions=True)

    async def _read_arrivals(self, receive) -> None:
        while True:
            message = await receive()
            if message["type"] == "websocket.receive":
                size = _frame_size(message)
                if not await self._admit(size):
                    continue
                self.backlog_frames += 1
                self.backlog_bytes += size
            self.backlog.append(message)
            self.backlog_ready.set()

    async def _next_arrival(self) -> dict:
        """The next message to dispatch (channels' ``receive``); raises what ended the reader task, if it did."""
        while not self.backlog:
            self.backlog_ready.clear()
            waiter = asyncio.ensure_future(self.backlog_ready.wait())
            try:
                await asyncio.wait((waiter, self.reader), return_when=asyncio.FIRST_COMPLETED)
            finally:
                waiter.cancel()
            if not self.backlog and self.reader.done():
                self.reader.result()  # raises its exception
                raise RuntimeError("the websocket reader stopped")
        message = self.backlog.popleft()
        if message["type"] == "websocket.receive":
            self.backlog_frames -= 1
            self.backlog_bytes -= _frame_size(message)
        return message

    async def _admit(self, size: int) -> bool:
        """Whether a frame of ``size`` bytes that just arrived joins the backlog: not once the connection is
        closing, not over the buckets (answered ``rate_limited``), and not over the backlog's bound (which
        closes the connection)."""
        if self.closing:
            return False
        if not self.rate_limit.admit(time.monotonic(), size):
            await self._rate_limited()
            return False
        if (
            self.backlog_frames + 1 > settings.HYPHA_WS_BACKLOG
            or self.backlog_bytes + size > settings.HYPHA_WS_BACKLOG_BYTES
        ):
            text = (
                f"more than {settings.HYPHA_WS_BACKLOG} frames (or {settings.HYPHA_WS_BACKLOG_BYTES} bytes) "
                "sent and not yet handled; closing the connection"
            )
            logger.warning("worker %s from %s: %s", self._name(), self._peer(), text)
            await self._close_with(protocol.CloseCode.FLOODING, protocol.ErrorCode.RATE_LIMITED, text)
            return False
        return True

    def _drop_backlog(self) -> None:
        """Forget the frames not yet handled (the connection is closing); daphne's own messages stay."""
        self.backlog = deque(message for message in self.backlog if message["type"] != "websocket.receive")
        self.backlog_frames = self.backlog_bytes = 0

    # --- the connection ------------------------------------------------------------------------------------

    async def connect(self) -> None:
        #: advert id → (attempt, when its offer window closes, Unix time): see :meth:`_late`.
        self.windows: dict[str, tuple[int, float]] = {}
        await self.accept()
        self.instance = self._instance()
        try:
            self.worker = await database_sync_to_async(worker_services.authenticate)(
                self._bearer_token(), instance=self.instance
            )
        except AuthenticationFailed as error:
            logger.warning("worker connection refused from %s: %s", self._peer(), error.message)
            await self._close_with(error.code, protocol.ErrorCode.REFUSED, error.message)
            return
        self.last_touch = self.last_group_join = time.monotonic()

    async def disconnect(self, code) -> None:
        if self.worker is None:
            return
        if self.joined:  # also after a hello that failed half-way through joining
            await self.channel_layer.group_discard(
                worker_services.worker_group(self.worker.pk), self.channel_name
            )
        if not self.greeted:
            return
        if self.revoked:
            await database_sync_to_async(_end_leases_of_revoked)(self.worker)
        await database_sync_to_async(job_services.worker_disconnected)(
            worker=self.worker, channel_name=self.channel_name
        )

    async def receive(self, text_data=None, bytes_data=None) -> None:
        if self.worker is None or self.closing:
            return
        if text_data is None:
            await self._error(protocol.ErrorCode.MALFORMED, "binary frames are not part of the protocol")
            return
        limit = settings.HYPHA_WS_MAX_MESSAGE_BYTES
        size = len(text_data)
        if size * 4 > limit:  # a character is 1–4 UTF-8 bytes: only a long frame needs encoding to be sure
            size = len(text_data.encode("utf-8", "surrogatepass"))
        if size > limit:
            logger.warning(
                "worker %s sent a %d-byte frame; refused (limit %d)", self.worker.name, size, limit
            )
            await self._error(protocol.ErrorCode.TOO_LARGE, f"frame of {size} bytes exceeds {limit}")
            return
        try:
            message = protocol.parse_daemon_message(text_data)
        except protocol.ProtocolError as error:
            metrics.DAEMON_MESSAGES.labels(type="invalid").inc()
            await self.send(text_data=protocol.encode(error.to_frame()))
            return
        metrics.DAEMON_MESSAGES.labels(type=message.type).inc()
        try:
            with telemetry.span(f"gateway {message.type}", **{"hypha.worker": self.worker.name}):
                await self._handle(message)
        except Exception:
            logger.exception("worker %s: handling %s failed", self.worker.name, message.type)
            await self._error(
                protocol.ErrorCode.INTERNAL, f"could not handle {message.type!r}", ref=message.type
            )

    async def _handle(self, message) -> None:
        if not self.greeted:
            if not isinstance(message, protocol.Hello):
                await self._close_with(
                    protocol.CloseCode.HELLO_EXPECTED,
                    protocol.ErrorCode.REFUSED,
                    f"the first message must be 'hello', not {message.type!r}",
                )
                return
            await self._hello(message)
            return
        await self._touch()
        match message:
            case protocol.Hello():
                await self._error(
                    protocol.ErrorCode.REFUSED, "already greeted on this connection", ref="hello"
                )
            case protocol.Offer():
                late = self._late(message)
                if late is not None:
                    # Most offers of a large fleet come after their advert filled: keep them off the
                    # database thread, which the renewals and the winning offers need.
                    decline = protocol.OfferDeclined(advertisement_id=message.advertisement_id, reason=late)
                    await self.send(text_data=protocol.encode(decline))
                    return
                try:
                    reply = await database_sync_to_async(job_services.offer_made)(
                        worker=self.worker, message=message
                    )
                except OfferRefused as refused:
                    reply = protocol.OfferDeclined(
                        advertisement_id=message.advertisement_id, reason=refused.reason
                    )
                await self.send(text_data=protocol.encode(reply))
            case protocol.LeaseRenewed():
                found = await database_sync_to_async(job_services.renewal_confirmed)(
                    worker=self.worker, lease_id=message.lease_id
                )
                if not found:
                    await self._unknown_lease(message)
            case protocol.RenewRefused() | protocol.ReleaseLease():
                found = await database_sync_to_async(job_services.lease_given_back)(
                    worker=self.worker, lease_id=message.lease_id, reason=message.reason
                )
                if not found:
                    await self._unknown_lease(message)
            case protocol.StatusReport():
                await self._status(message)
            case protocol.BenchmarkReport():
                await database_sync_to_async(worker_services.benchmark_reported)(
                    worker=self.worker, message=message
                )
            case protocol.FetchSlice():
                reply = await database_sync_to_async(job_services.slice_requested)(
                    worker=self.worker, message=message
                )
                await self.send(text_data=protocol.encode(reply))
            case (
                protocol.SliceAck()
                | protocol.JobStarted()
                | protocol.JobExited()
                | protocol.TaskLog()
                | protocol.TransferProblem()
                | protocol.TransferOk()
            ):
                handler = {
                    "slice_ack": job_services.slice_acknowledged,
                    "job_started": job_services.task_started,
                    "job_exited": job_services.task_exited,
                    "task_log": job_services.task_output,
                    "transfer_problem": job_services.transfer_problem_reported,
                    "transfer_ok": job_services.transfer_recovered,
                }[message.type]
                try:
                    await database_sync_to_async(handler)(worker=self.worker, message=message)
                except (TaskRefused, DatasetError) as refused:
                    await self._error(protocol.ErrorCode.REFUSED, str(refused), ref=message.type)

    async def _status(self, message: protocol.StatusReport) -> None:
        kind = metrics.status_kind(message.progress)
        outcome = "failed"  # unless the reply is ready: an exception propagates to receive()'s error frame
        started = time.perf_counter()
        try:
            try:
                reply = await database_sync_to_async(job_services.status_reported)(
                    worker=self.worker, message=message
                )
                outcome = "error" if reply.reply.get("type") == "Error" else "ok"
            except TaskRefused as refused:
                outcome = "refused"
                # The bridge waits for a reply: answer Error (as Hypha's scheduler does) and say why.
                await self._error(protocol.ErrorCode.REFUSED, str(refused), ref=message.type)
                reply = protocol.StatusReply(request_id=message.request_id, reply={"type": "Error"})
        finally:
            metrics.status_handled(kind=kind, outcome=outcome, seconds=time.perf_counter() - started)
        await self.send(text_data=protocol.encode(reply))

    async def _hello(self, hello: protocol.Hello) -> None:
        if hello.protocol_version not in protocol.SUPPORTED_VERSIONS:
            await self._close_with(
                protocol.CloseCode.UNSUPPORTED_VERSION,
                protocol.ErrorCode.REFUSED,
                f"protocol version {hello.protocol_version} is not supported; "
                f"this control plane speaks {sorted(protocol.SUPPORTED_VERSIONS)}",
            )
            return
        # Join the worker's group first, so no advert or lease message falls between the welcome and the join.
        self.joined = True
        await self._join_group()
        self.greeted = True
        info = {
            "peer": self._peer(),
            "daemon_version": hello.daemon_version,
            "protocol_version": hello.protocol_version,
            "instance": self.instance,
        }
        welcome = await database_sync_to_async(job_services.worker_connected)(
            worker=self.worker, channel_name=self.channel_name, hello=hello, info=info
        )
        logger.info("worker %s connected from %s", self.worker.name, info["peer"])
        for advertisement in welcome.advertisements:
            self._note_window(worker_services.window_note(advertisement))
        await self.send(text_data=protocol.encode(welcome))
        # After the welcome: the daemon may have missed a dispatch while it was away.
        for dispatch in await database_sync_to_async(job_services.pending_dispatches)(worker=self.worker):
            await self.send(text_data=protocol.encode(dispatch))

    # --- channel-layer events ---------------------------------------------------------------------------

    async def gateway_frame(self, event: dict) -> None:
        if self.closing:
            return  # the error frame before the close is the last thing a closed connection is told
        self._note_window(event)
        await self.send(text_data=event["text"])

    def _note_window(self, event: dict) -> None:
        """Remember when the offer windows of the adverts this connection was told about close."""
        window, closed = event.get("window"), event.get("closed")
        if window is not None:
            self.windows[window["id"]] = (window["attempt"], window["closes_at"])
        elif closed is not None and closed in self.windows:
            self.windows[closed] = (self.windows[closed][0], 0.0)
        else:
            return
        while len(self.windows) > MAX_KNOWN_WINDOWS:
            self.windows.pop(next(iter(self.windows)))

    def _late(self, offer: protocol.Offer) -> str | None:
        """Why ``offer`` is declined without asking the database — it answers an advert attempt whose window
        this connection knows has closed — or None (the market decides)."""
        known = self.windows.get(str(offer.advertisement_id))
        if known is None or known[0] != offer.attempt or time.time() < known[1] + WINDOW_SLACK:
            return None
        return f"the offer window of attempt {offer.attempt} is closed"

    async def gateway_close(self, event: dict) -> None:
        if event.get("keep_channel") == self.channel_name or self.closing:
            return
        self.revoked = event["code"] == protocol.CloseCode.TOKEN_REVOKED
        logger.info(
            "closing the connection of worker %s from %s (%d): %s",
            self.worker.name if self.worker is not None else "?",
            self._peer(),
            event["code"],
            event["message"],
        )
        await self._close_with(event["code"], protocol.ErrorCode.REFUSED, event["message"])

    # --- helpers ------------------------------------------------------------------------------------------

    async def _join_group(self) -> None:
        self.last_group_join = time.monotonic()
        await self.channel_layer.group_add(worker_services.worker_group(self.worker.pk), self.channel_name)

    async def _touch(self) -> None:
        now = time.monotonic()
        if now - self.last_touch >= TOUCH_INTERVAL:
            self.last_touch = now
            await database_sync_to_async(self.worker.touch)()
        if now - self.last_group_join >= GROUP_REFRESH_INTERVAL:
            await self._join_group()

    async def _rate_limited(self) -> None:
        limit = self.rate_limit
        if limit.flooding:
            logger.warning(
                "worker %s from %s: more than %d frames over the rate limit in %g s; closing the connection",
                self._name(),
                self._peer(),
                limit.flood_refusals,
                FLOOD_WINDOW,
            )
            await self._close_with(
                protocol.CloseCode.FLOODING,
                protocol.ErrorCode.RATE_LIMITED,
                f"more than {limit.flood_refusals} frames over the rate limit in {FLOOD_WINDOW:g} s",
            )
            return
        rate, burst = (
            (limit.rate, limit.burst)
            if limit.refused_for == "frames"
            else (limit.byte_rate, limit.byte_burst)
        )
        refused = limit.refusals_to_log(time.monotonic())
        if refused:
            logger.warning(
                "worker %s: %d frame(s) over the rate limit (%g %s/s, burst %d) refused",
                self._name(),
                refused,
                rate,
                limit.refused_for,
                burst,
            )
        await self._error(
            protocol.ErrorCode.RATE_LIMITED,
            f"over the rate limit of {rate:g} {limit.refused_for}/s (burst {burst:g}); frame dropped",
        )

    async def _unknown_lease(self, message) -> None:
        await self._error(
            protocol.ErrorCode.UNKNOWN_LEASE,
            f"lease {message.lease_id} is not a lease of this worker",
            ref=message.type,
            lease_id=message.lease_id,
        )

    async def _error(
        self, code: protocol.ErrorCode, text: str, *, ref: str | None = None, lease_id=None
    ) -> None:
        frame = protocol.Error(code=code, message=text, ref=ref, lease_id=lease_id)
        await self.send(text_data=protocol.encode(frame))

    async def _close_with(self, close_code: int, error_code: protocol.ErrorCode, text: str) -> None:
        # Frames the daemon sent before it heard of the close are dropped from now on: a revoked or superseded
        # daemon no longer speaks for the worker.
        self.closing = True
        self._drop_backlog()
        await self._error(error_code, text)
        await self.close(code=int(close_code), reason=text[:120])

    def _bearer_token(self) -> str | None:
        for name, value in self.scope.get("headers", []):
            if name.lower() == b"authorization":
                scheme, _, token = value.decode("latin-1").partition(" ")
                if scheme.lower() == "bearer" and token.strip():
                    return token.strip()
        return None

    def _instance(self) -> str:
        for name, value in self.scope.get("headers", []):
            if name.lower() == INSTANCE_HEADER:
                instance = value.decode("latin-1").strip()
                return instance if INSTANCE_PATTERN.fullmatch(instance) else ""
        return ""

    def _name(self) -> str:
        """The worker's name for a log line ("?" while the connection is not yet authenticated)."""
        return self.worker.name if self.worker is not None else "?"

    def _peer(self) -> str:
        client = self.scope.get("client") or ("?", 0)
        return f"{client[0]}:{client[1]}"


def _frame_size(message: dict) -> int:
    """The size of a ``websocket.receive`` message's frame for the byte limits: a text frame's characters, not
    its UTF-8 bytes (encoding every frame to count it exactly would cost more than admitting it; the protocol's
    frames are ASCII JSON but for free text)."""
    text = message.get("text")
    return len(text) if text is not None else len(message.get("bytes") or b"")


def _end_leases_of_revoked(worker) -> None:
    """End what a revoked worker still holds when its connection closes.

    ``revoke_worker`` ended its leases, but a frame handled between the revocation's commit and the close
    reaching this consumer (an offer that settled at once) may have won it another: end that one too, unless
    the token was rotated meanwhile (the worker is trusted again, and must not be revoked a second time).
    """
    worker = Worker.objects.get(pk=worker.pk)
    if worker.is_revoked:
        job_services.revoke_worker(worker)
