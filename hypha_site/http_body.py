"""daphne's ``Server``, handing a request's body to the application a chunk at a time.

Why: daphne 4.2 lets Twisted receive a request's whole body into ``Request.content`` (a ``BytesIO`` under
100 kB, else an unnamed temporary file), then copies all of it at once, in 8 KiB messages, into the
application's unbounded ``asyncio.Queue``. A 2.5 GB upload so sat in the server's memory until Django had
read it, and the allocator kept most of it afterwards (RSS 1.25 → 2.74 GB, issue 12).

:class:`Server` leaves the body in Twisted's file and reads the next :data:`BODY_CHUNK` bytes from it each time
the application calls ``receive()``: a request costs one chunk of memory whatever its size. It closes the file
once the body is read or the application ends. WebSocket connections and everything else are daphne's own.

Responses, the other way: daphne's ``send()`` never waits, so a body the client reads slower than the server
produces it (a relay download of a model on a thin link) piled up in Twisted's transport buffer — 1 GiB down
through ``/relay/`` grew the server by 1122 MiB. :class:`Server` registers a push producer on the request when
its response starts; Twisted pauses it when the transport's buffer is full and resumes it once drained, and
``send()`` waits for that after each body chunk (measured: 10 MiB for the same GiB, at the same speed).
"""

from __future__ import annotations

import asyncio
import io

from daphne.http_protocol import WebRequest
from daphne.server import Server as DaphneServer
from twisted.internet.interfaces import IPushProducer
from zope.interface import implementer

#: Bytes per ``http.request`` message: small against any memory bound, large enough to keep the loop cheap.
BODY_CHUNK = 256 << 10


class _BodyReceiver:
    """The ``receive`` of one HTTP request: body chunks read from ``body`` on demand, then daphne's own
    messages (``http.disconnect``) from ``queue``."""

    def __init__(self, body, queue: asyncio.Queue) -> None:
        self.body = body
        self.queue = queue

    async def receive(self) -> dict:
        if self.body is not None:
            # A local file (or BytesIO) Twisted has finished writing: a read of one chunk does not block
            # the loop for long, and daphne read all of it on the loop before.
            chunk = self.body.read(BODY_CHUNK)
            more_body = len(chunk) == BODY_CHUNK
            if not more_body:
                self.close()
            return {"type": "http.request", "body": chunk, "more_body": more_body}
        while True:
            message = await self.queue.get()
            # daphne's own copy of the body, from the empty stand-in: already delivered above.
            if message["type"] != "http.request":
                return message

    def close(self, *_) -> None:
        if self.body is not None:
            self.body.close()
            self.body = None


@implementer(IPushProducer)
class _Drain:
    """A response's flow control: Twisted pauses it while the transport's send buffer is full."""

    def __init__(self) -> None:
        self.ready = asyncio.Event()
        self.ready.set()

    def pauseProducing(self) -> None:
        self.ready.clear()

    def resumeProducing(self) -> None:
        self.ready.set()

    def stopProducing(self) -> None:  # the connection is going away: never block the application
        self.ready.set()


class Server(DaphneServer):
    """daphne's server with :class:`_BodyReceiver` as the ``receive`` of HTTP requests and a ``send`` that
    waits while the client's connection is full (see the module)."""

    def _send_with_backpressure(self, protocol: WebRequest):
        drain = _Drain()
        registered: list[bool] = []

        def release(*_) -> None:
            # Unregistered with the last body message and when the application ends: a keep-alive
            # connection's next request must be able to register its own producer.
            if registered and protocol.producer is drain and protocol.channel is not None:
                protocol.unregisterProducer()
            registered.clear()

        async def send(message: dict) -> None:
            kind = message.get("type")
            if (
                kind == "http.response.start"
                and not registered
                and protocol.channel is not None
                and not protocol.finished
            ):
                protocol.registerProducer(drain, True)
                registered.append(True)
                if getattr(protocol.channel, "_waitingForTransport", False):
                    drain.pauseProducing()
            if kind == "http.response.body" and not message.get("more_body", False):
                release()
            await self.handle_reply(protocol, message)
            if kind == "http.response.body" and message.get("more_body") and registered:
                await drain.ready.wait()

        return send, release

    def create_application(self, protocol, scope):
        if scope.get("type") != "http" or not isinstance(protocol, WebRequest):
            return super().create_application(protocol, scope)
        # Same steps as daphne's own, but the body stays in Twisted's file; daphne's copy loop, which runs
        # right after this returns, finds an empty stand-in and queues one empty final message.
        assert "application_instance" not in self.connections[protocol]
        input_queue = asyncio.Queue()
        receiver = _BodyReceiver(protocol.content, input_queue)
        protocol.content = io.BytesIO()
        scope.setdefault("asgi", {"version": "3.0"})
        send, release = self._send_with_backpressure(protocol)
        application_instance = self.application(scope=scope, receive=receiver.receive, send=send)
        if protocol not in self.connections:
            receiver.close()
            application_instance.close()  # a coroutine never started: no 'never awaited' warning
            return None
        future = asyncio.ensure_future(application_instance, loop=asyncio.get_event_loop())
        future.add_done_callback(receiver.close)
        future.add_done_callback(release)
        self.connections[protocol]["application_instance"] = future
        return input_queue
