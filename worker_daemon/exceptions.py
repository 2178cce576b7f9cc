"""Errors of the worker daemon, and the process exit codes they map to.

Hierarchy::

    WorkerDaemonError                  base of everything the daemon raises on purpose
    ├── ConfigError                    bad command line, config file, env var or value     → exit 2
    ├── BenchmarkError                 the worker benchmark failed or timed out; the daemon serves on
                                       without a score (``hypha-worker-daemon benchmark``  → exit 5)
    └── FatalConnectionError           the control plane said reconnecting cannot help
        ├── TokenRefusedError          token missing, invalid or revoked (close 4000/4001/4003,
        │                              or HTTP 401/403 on the handshake)                   → exit 3
        ├── UnsupportedVersionError    the control plane does not speak our protocol (4002) → exit 4
        └── SupersededError            another daemon connected with this worker's token and took
                                       over (4009): two daemons must not fight over one worker → exit 6

Transient network failures (refused connections, timeouts, dropped sockets, other close codes) are not
errors of this package: the connection loop catches websockets' and the OS's own exceptions and reconnects
with backoff.

This module is imported by ``__main__`` before the arguments are parsed, so it must stay free of heavy
imports (no pydantic, no websockets).
"""

from __future__ import annotations

import enum


class ExitCode(enum.IntEnum):
    """Process exit codes of ``hypha-worker-daemon`` (also listed in ``--help``)."""

    OK = 0
    """Clean shutdown after SIGTERM or SIGINT: held leases were released."""
    USAGE = 2
    """Usage or configuration error; the message names the bad flag, key or value."""
    TOKEN_REFUSED = 3
    """The control plane refused the worker token (missing, invalid or revoked)."""
    UNSUPPORTED_VERSION = 4
    """The control plane does not support this daemon's protocol version."""
    BENCHMARK_FAILED = 5
    """``hypha-worker-daemon benchmark`` could not measure (the message says why)."""
    SUPERSEDED = 6
    """Another daemon connected with this worker's token and took the worker over (close 4009)."""


class WorkerDaemonError(Exception):
    """Base class of the daemon's own errors. ``exit_code`` is the process exit code it leads to."""

    exit_code: ExitCode = ExitCode.USAGE


class ConfigError(WorkerDaemonError):
    """A configuration or usage error. The message names the flag, key or value at fault."""

    exit_code = ExitCode.USAGE


class BenchmarkError(WorkerDaemonError):
    """The worker benchmark's process failed, timed out or printed no valid result."""

    exit_code = ExitCode.BENCHMARK_FAILED


class FatalConnectionError(WorkerDaemonError):
    """The control plane closed the connection in a way that reconnecting with the same settings cannot fix.

    ``close_code`` is the websocket close code (or the HTTP status of a refused handshake) and ``reason``
    the text the control plane gave, if any.
    """

    def __init__(self, message: str, *, close_code: int | None = None, reason: str = "") -> None:
        super().__init__(message)
        self.close_code = close_code
        self.reason = reason


class TokenRefusedError(FatalConnectionError):
    """The worker token was missing, invalid or revoked."""

    exit_code = ExitCode.TOKEN_REFUSED


class UnsupportedVersionError(FatalConnectionError):
    """The control plane does not accept this daemon's protocol version."""

    exit_code = ExitCode.UNSUPPORTED_VERSION


class SupersededError(FatalConnectionError):
    """Another daemon (another process) connected with this worker's token, and the newest connection wins.

    Reconnecting would take the worker back from it, and it would take it back in turn: two daemons with one
    token would ping-pong forever, each ending the other's leases. So the superseded one stops.
    """

    exit_code = ExitCode.SUPERSEDED
