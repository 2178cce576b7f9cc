"""The job bridge: a Hypha-compatible HTTP/1.1 API on a Unix socket for one job's executor.

Start it with :func:`serve_bridge`; the daemon supplies a :class:`BridgeBackend` that does the actual
fetching, sending, receiving and progress reporting.
"""

from __future__ import annotations

from worker_daemon.bridge.backend import BridgeBackend
from worker_daemon.bridge.server import BridgeServer, serve_bridge

__all__ = ["BridgeBackend", "BridgeServer", "serve_bridge"]
