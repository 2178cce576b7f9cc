"""Lost authorisation: a transfer token that the parameter server keeps refusing ends the task, visibly.

A trainer's transfer token is short-lived; the control plane sends a fresh one with every renewal of the
task's lease (``transfer_token`` frames), so a refusal (401) is normally over within one renewal. One that
lasts longer than the grace means the task has lost its authorisation for good (its token is no longer
refreshed, or the job's key changed): retrying for ever would leave the job RUNNING with nothing moving, so
the task is failed with the reason instead, and the control plane fails the job with it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

logger = logging.getLogger(__name__)

#: The HTTP status of a refused transfer token (missing, malformed, wrongly signed or expired).
UNAUTHORIZED = 401
#: Seconds a refusal may last before the task is failed: many lease renewals, each bringing a fresh token.
DEFAULT_GRACE = 120.0


class AuthorisationWatch:
    """Counts how long the parameter server has refused this task's token without a break.

    ``on_lost(reason)`` is called once, when a refusal is reported ``grace`` seconds or more after the first
    of the run (an accepted request ends the run)."""

    def __init__(
        self,
        *,
        grace: float = DEFAULT_GRACE,
        on_lost: Callable[[str], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.grace = grace
        self.on_lost = on_lost
        self.clock = clock
        self.refused_since: float | None = None
        self.lost: str | None = None

    def accepted(self) -> None:
        self.refused_since = None

    def refused(self, detail: str) -> bool:
        """Note a refusal; True once the authorisation is lost (the caller stops retrying)."""
        if self.lost is not None:
            return True
        now = self.clock()
        if self.refused_since is None:
            self.refused_since = now
        refused_for = now - self.refused_since
        if refused_for < self.grace:
            return False
        self.lost = (
            f"the parameter server refused this task's transfer token for {refused_for:.0f} s "
            f"(no fresh token came from the control plane): {detail}"
        )[:1000]
        logger.error("%s", self.lost)
        if self.on_lost is not None:
            self.on_lost(self.lost)
        return True
