"""Errors of the job bridge, and how each one is answered on the wire.

Hierarchy::

    BridgeError                 base; ``kind`` and ``status`` give the JSON error body and HTTP status
    ├── InvalidRequest          "invalid_request", 400: unsupported reference or bad argument
    │   └── PathRejected        "invalid_request", 400: absolute path, ``..`` or a path leaving the work dir
    ├── NetworkError            "network_error", 500: the control plane / peer could not be reached in time
    ├── ConnectorError          "connector_error", 500: a transfer could not be set up or the backend
    │                           answered something the bridge cannot pass on
    └── BridgeIOError           "io_error", 500: reading or writing a local file failed

A backend raises these to choose the answer; an ``OSError`` escaping a backend is answered as
``io_error``. Bodies that do not deserialise never reach this module: they get a plain-text 4xx
(400 syntax, 422 shape, 415 content type) as Hypha's bridge gives.
"""

from __future__ import annotations


class BridgeError(Exception):
    """Base of the bridge's errors; answered as ``{"error": kind, "detail": str(error)}``."""

    kind = "internal_error"
    status = 500


class InvalidRequest(BridgeError):
    kind = "invalid_request"
    status = 400


class PathRejected(InvalidRequest):
    """A path from the executor or from the network breaks the path rules (§1.5, hardened)."""


class NetworkError(BridgeError):
    kind = "network_error"
    status = 500


class ConnectorError(BridgeError):
    kind = "connector_error"
    status = 500


class BridgeIOError(BridgeError):
    kind = "io_error"
    status = 500
