"""Transfer problems of one task's bridge, said to the control plane: a peer (the parameter server, a data node)
that a transfer keeps failing to reach is reported in a ``transfer_problem`` frame (where, why, how many
attempts, since when), again with each further failure while the bridge waits, and cleared with one
``transfer_ok`` once the peer answers again. The control plane shows them on the job
(``GET /api/jobs/<id>/``, ``transfer_problems``) and names the latest as the cause when the task fails.

A mixin of :class:`~worker_daemon.bridge.remote.RemoteBackend` (via
:class:`~worker_daemon.bridge.remote.slices.SliceFetching`); it keeps only which peers it reported.
"""

from __future__ import annotations

import logging
import urllib.parse
import uuid
from datetime import UTC, datetime
from typing import Literal

from worker_daemon import protocol
from worker_daemon.bridge.peer_http import without_query
from worker_daemon.link import ControlLink

logger = logging.getLogger(__name__)


def peer_host(url: str) -> str:
    """A data node's name in a report: the ``host:port`` of its URL (its query holds a download token)."""
    return urllib.parse.urlsplit(url).netloc or without_query(url)


def now() -> datetime:
    return datetime.now(UTC)


class TransferProblemReports:
    """Reports of peers a task's transfers cannot reach (the attributes are :class:`RemoteBackend`'s)."""

    task_id: uuid.UUID
    link: ControlLink
    #: Peer → when its reported problem began; ``None`` until the first report (no ``__init__`` here).
    _reported_problems: dict[str, datetime] | None = None

    @staticmethod
    def problem_clock() -> datetime:
        """Now, as a report's ``since`` (UTC)."""
        return now()

    def report_transfer_problem(
        self,
        *,
        peer: str,
        role: Literal["parameter_server", "data_node"],
        url: str,
        operation: str,
        cause: str,
        attempts: int,
        since: datetime,
    ) -> None:
        """Tell the control plane that ``operation`` at ``peer`` (``url``: no query is sent) has failed
        ``attempts`` times in a row since ``since``, the last time because of ``cause``."""
        if self._reported_problems is None:
            self._reported_problems = {}
        first = self._reported_problems.setdefault(peer, since)
        self.link.post(
            protocol.TransferProblem(
                task_id=self.task_id,
                peer=peer[:200],
                role=role,
                url=without_query(url)[:500],
                operation=operation[:200] or "transfer",
                cause=cause[:1000] or "failed",
                attempts=max(1, attempts),
                since=min(first, since),
            )
        )

    def report_transfer_ok(self, *peers: str) -> None:
        """``peers`` answered: drop each one's reported problem (nothing is sent for one never reported)."""
        if not self._reported_problems:
            return
        for peer in peers:
            if self._reported_problems.pop(peer, None) is not None:
                logger.info("task %s: %s answers again", self.task_id, peer)
                self.link.post(protocol.TransferOk(task_id=self.task_id, peer=peer[:200]))
