"""daphne's ``Server``, handing a request's body to the application a chunk at a time.

Why: daphne 4.2 lets Twisted receive a request's whole body into ``Request.content`` (a ``BytesIO`` under
100 kB, else an unnamed temporary file), then copies all of it at once, in 8 KiB messages, into the
application's unbounded ``asyncio.Queue``. A 2.5 GB upload so sat in the server's memory until Django had
read it, and the allocator kept most of it afterwards (RSS 1.25 → 2.74 GB, issue 12).

:class:`Server` leaves the body in Twisted's file and reads the next :data:`BODY_CHUNK` bytes from it each time
the application calls ``receive()``: a request costs one chunk of memory whatever its size. It closes the file
once the body is read or the application ends. WebSocket connections and everything else are daphne's own.
"""

from __future__ import annotations

import asyncio
import io
from functools import partial

from daphne.http_protocol import WebRequest
from daphne.server import Server as DaphneServer

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


class Server(DaphneServer):
    """daphne's server with :class:`_BodyReceiver` as the ``receive`` of HTTP requests (see the module)."""

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
        application_instance = self.application(
            scope=scope, receive=receiver.receive, send=partial(self.handle_reply, protocol)
        )
        if protocol not in self.connections:
            receiver.close()
            application_instance.close()  # a coroutine never started: no 'never awaited' warning
            return None
        future = asyncio.ensure_future(application_instance, loop=asyncio.get_event_loop())
        future.add_done_callback(receiver.close)
        self.connections[protocol]["application_instance"] = future
        return input_queue
