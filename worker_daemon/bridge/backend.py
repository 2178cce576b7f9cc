"""What the bridge needs from the daemon: the :class:`BridgeBackend` protocol.

The bridge validates requests and paths, shapes replies and owns the socket; the backend moves bytes and
talks to the control plane and the parameter server. Every path a backend hands back is **relative to the
directory it was given** and is checked by the bridge (§1.5) before it appears in a reply. Backends raise
the errors of :mod:`worker_daemon.bridge.exceptions` to choose the error reply; an ``OSError`` is answered
as ``io_error``. Network calls inside a backend need their own timeouts; the bridge additionally bounds
``status`` and ``fetch`` (see :func:`~worker_daemon.bridge.server.serve_bridge`).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, Protocol

from worker_daemon.bridge.references import FetchReference, PeersReference

ProgressValue = dict[str, Any] | str
"""A Progress value exactly as the executor sent it (e.g. ``{"status": {...}}`` or ``"update"``)."""


class BridgeBackend(Protocol):
    async def fetch(self, *, reference: FetchReference, artifacts_dir: Path) -> list[tuple[str, int]]:
        """Download what ``reference`` names into ``artifacts_dir`` (which exists); return
        ``(path relative to artifacts_dir, size in bytes)`` per file written, in order. A ``scheduler``
        reference yields exactly one file named by the slice index (``"17"``)."""
        ...

    async def send(self, *, reference: PeersReference, path: Path) -> None:
        """Send the file at ``path`` (absolute, inside the work dir, maybe missing) to the peers.

        Runs in the background after the executor already got its 200: errors are only logged."""
        ...

    def receive(
        self, *, reference: PeersReference, directory: Path
    ) -> AsyncIterator[tuple[str, int, str] | tuple[str, int, str, dict[str, Any]]]:
        """Accept files from the peers into ``directory`` (which exists), yielding
        ``(path relative to directory, size, sender peer id)`` per completed file, until cancelled
        (the executor disconnected or the bridge closes) or until receiving cannot go on. A fourth item, a
        dict of JSON values (``{"round": r}``), adds keys to the file's event; a file must not be rewritten
        before its event was read (one file per event)."""
        ...

    async def status(self, *, job_id: str | None, progress: ProgressValue) -> dict[str, Any]:
        """Report ``progress`` (verbatim) for the job and return the scheduler's reply, such as
        ``{"type": "Continue"}`` or ``{"type": "ScheduleUpdate", "counter": 3}``."""
        ...
