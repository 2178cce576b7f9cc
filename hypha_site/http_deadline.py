"""A deadline for each HTTP request's headers on daphne (slowloris).

Twisted's idle timeout (60 s) restarts with every byte received, so a client that trickles a header line now
and then would hold its connection forever, and daphne's ``http_timeout`` only starts once a request has
reached the application: a few hundred such sockets would hold every connection a server can take. With
:func:`with_header_deadline`, every HTTP connection gets ``header_timeout`` seconds (``HYPHA_HTTP_HEADER_TIMEOUT``),
from connecting or from the end of its previous response, to complete a request line and headers; otherwise
it is answered ``408 Request Timeout`` and closed. The deadline ends with the headers: request bodies
(uploads) and websockets (which upgrade right after their headers) are not limited by it; a body that stalls
is closed by Twisted's idle timeout.
"""

from __future__ import annotations

import daphne.server  # first: it installs the asyncio reactor that Twisted must use
from daphne.http_protocol import HTTPFactory
from twisted.web import http

_TIMEOUT_RESPONSE = b"HTTP/1.1 408 Request Timeout\r\nConnection: close\r\nContent-Length: 0\r\n\r\n"


class HeaderDeadlineChannel(http.HTTPChannel):
    """An ``HTTPChannel`` that closes the connection when a request's headers take too long."""

    header_timeout = 30.0
    _header_deadline = None

    def connectionMade(self):
        super().connectionMade()
        self._arm_header_deadline()

    def allHeadersReceived(self):
        self._disarm_header_deadline()
        super().allHeadersReceived()

    def requestDone(self, request):
        super().requestDone(request)
        # A kept-alive connection waits for its next request: the deadline applies to that one too.
        if self.persistent and self.transport is not None and self.transport.connected:
            self._arm_header_deadline()

    def connectionLost(self, reason):
        self._disarm_header_deadline()
        super().connectionLost(reason)

    def _arm_header_deadline(self):
        self._disarm_header_deadline()
        self._header_deadline = self.callLater(self.header_timeout, self._headers_too_slow)

    def _disarm_header_deadline(self):
        if self._header_deadline is not None and self._header_deadline.active():
            self._header_deadline.cancel()
        self._header_deadline = None

    def _headers_too_slow(self):
        self._header_deadline = None
        if self.transport is None:
            return
        self.transport.write(_TIMEOUT_RESPONSE)
        # loseConnection now, abortConnection after Twisted's abortTimeout if the client does not read.
        self.timeoutConnection()


class HeaderDeadlineFactory(HTTPFactory):
    """daphne's ``HTTPFactory`` building :class:`HeaderDeadlineChannel` channels."""

    def __init__(self, server, header_timeout: float):
        super().__init__(server)
        self.header_timeout = header_timeout

    def protocol(self):
        # What Twisted's factory builds, with our channel: a wrapper that negotiates HTTP/2 over TLS (ALPN).
        channel = HeaderDeadlineChannel()
        channel.header_timeout = self.header_timeout
        return http._GenericHTTPChannelProtocol(channel)


def with_header_deadline(server_class: type[daphne.server.Server]) -> type[daphne.server.Server]:
    """A subclass of the daphne ``server_class`` taking ``header_timeout`` (seconds) as well."""

    class HeaderDeadlineServer(server_class):
        def __init__(self, *, header_timeout: float, **options):
            super().__init__(**options)
            self.header_timeout = header_timeout

        def run(self):
            # daphne builds its factory inside run() and listens at once, with no hook between: its module's
            # HTTPFactory is ours while this server (the process's one) runs.
            original = daphne.server.HTTPFactory
            daphne.server.HTTPFactory = lambda server: HeaderDeadlineFactory(server, self.header_timeout)
            try:
                return super().run()
            finally:
                daphne.server.HTTPFactory = original

    return HeaderDeadlineServer
