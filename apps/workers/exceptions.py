"""Errors of the workers app.

WorkerError
├── AuthenticationFailed     no token, an unknown or revoked one, or a daemon process a newer one
│                            superseded (``code`` is the close code)
└── WorkerOffline            the worker's daemon is not connected, so it cannot be asked anything
"""

from __future__ import annotations


class WorkerError(Exception):
    """Base class of worker errors."""


class AuthenticationFailed(WorkerError):
    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


class WorkerOffline(WorkerError):
    """The worker's daemon is not connected."""
