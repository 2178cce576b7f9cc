"""Errors of the ``hypha`` CLI, and the process exit codes they map to.

Hierarchy::

    CLIError                        base of everything the CLI raises on purpose             → its exit_code
    ├── UsageError                  bad flags or arguments, unreadable file, no server set   → exit 64
    ├── RefusedError                the server refused the request: 400 (with the field
    │                               errors in ``errors``), 409, 415                           → exit 1
    ├── AuthenticationError         no token, or the server refused it (401/403)             → exit 3
    ├── JobNotFoundError            404 for a job: no such job, or not one of yours          → exit 4
    ├── WrongServerError            cannot connect, timed out, or the answer is not a Hypha
    │                               control plane's (a 404 page, HTML, a non-JSON body)       → exit 5
    └── ServerError                 the server failed (5xx) or answered an unexpected shape  → exit 6

``hypha watch`` ends with the job's outcome instead: 0 completed, 1 failed, 2 cancelled. Exit code 2 is
therefore not argparse's here: usage errors exit 64 (``EX_USAGE`` of sysexits.h).

This module is imported before the arguments are parsed, so it must stay free of heavy imports.
"""

from __future__ import annotations

import enum


class ExitCode(enum.IntEnum):
    """Process exit codes of ``hypha`` (also listed in ``hypha --help`` and docs/cli.md)."""

    OK = 0
    """Success; for ``watch``: the job completed."""
    REFUSED = 1
    """The server refused the request (invalid spec, job not cancellable, no model yet); ``watch``: the job
    failed."""
    CANCELLED = 2
    """``watch`` only: the job was cancelled."""
    AUTHENTICATION = 3
    """No API token, or the server refused it (HTTP 401/403)."""
    NOT_FOUND = 4
    """No such job, or not one the token's user may see (HTTP 404)."""
    WRONG_SERVER = 5
    """The server cannot be reached (refused, DNS, TLS, timeout) or is not a Hypha control plane."""
    SERVER_ERROR = 6
    """The server failed (HTTP 5xx) or answered something this CLI does not understand."""
    USAGE = 64
    """Usage error: bad flags or arguments, an unreadable file, no server configured."""
    INTERRUPTED = 130
    """Interrupted (Ctrl-C)."""


#: The outcome of ``hypha watch`` by final job status.
WATCH_EXIT_CODES = {
    "completed": ExitCode.OK,
    "failed": ExitCode.REFUSED,
    "cancelled": ExitCode.CANCELLED,
}


class CLIError(Exception):
    """Base class of the CLI's own errors; ``exit_code`` is the process exit code it leads to."""

    exit_code: ExitCode = ExitCode.USAGE


class UsageError(CLIError):
    """A usage or configuration error; the message names the flag, file or value at fault."""

    exit_code = ExitCode.USAGE


class RefusedError(CLIError):
    """The server refused the request. ``errors`` holds ``(field path, message)`` pairs of a 400 body
    (empty for a 409), and ``body`` the decoded body as the API sent it."""

    exit_code = ExitCode.REFUSED

    def __init__(
        self,
        message: str,
        *,
        status: int,
        errors: list[tuple[str, str]] | None = None,
        body: object = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.errors = errors or []
        self.body = body


class AuthenticationError(CLIError):
    """No token to send, or the server refused it."""

    exit_code = ExitCode.AUTHENTICATION


class JobNotFoundError(CLIError):
    """The server has no job with this id that the caller may see."""

    exit_code = ExitCode.NOT_FOUND


class WrongServerError(CLIError):
    """The server cannot be reached, or what answered is not a Hypha control plane."""

    exit_code = ExitCode.WRONG_SERVER


class ServerError(CLIError):
    """The server failed (5xx) or answered in a shape this CLI does not know."""

    exit_code = ExitCode.SERVER_ERROR
