"""The worker gateway's per-connection rate limit: a token bucket, and a flood detector on top of it.

Pure and clock-free (callers pass ``time.monotonic()``), because it runs for every frame a daemon sends: the
admitted path is a handful of float operations and no allocation.

* The bucket holds at most ``burst`` tokens and gains ``rate`` per second; a frame takes one. A frame that
  finds less than one token is refused (the gateway answers ``rate_limited`` and drops it).
* A second bucket counts bytes the same way (``byte_rate`` per second, at most ``byte_burst``): a frame of
  ``size`` bytes takes ``size`` of them, and is refused when fewer are left. A refused frame takes nothing from
  either bucket; :attr:`FrameRateLimit.refused_for` says which bucket refused the last one.
* Refusals are counted in windows of :data:`FLOOD_WINDOW` seconds that start at the first refusal after the
  last window ended. More than ``flood_refusals`` of them in one window means the sender ignores the
  ``rate_limited`` answers: :attr:`FrameRateLimit.flooding` turns true and the gateway closes the connection.
* :meth:`FrameRateLimit.refusals_to_log` hands out the refusals not yet logged at most once per
  :data:`LOG_INTERVAL` seconds, so a flood cannot flood the log too.
"""

from __future__ import annotations

import math

#: Seconds over which refused frames are counted towards ``flood_refusals``.
FLOOD_WINDOW = 10.0
#: Seconds between two log lines about one connection's refused frames.
LOG_INTERVAL = 5.0


class FrameRateLimit:
    """One connection's token buckets (``rate`` frames/s, ``burst`` frames; ``byte_rate`` bytes/s,
    ``byte_burst`` bytes, unlimited unless given) and flood detector."""

    __slots__ = (
        "rate",
        "burst",
        "byte_rate",
        "byte_burst",
        "byte_tokens",
        "refused_for",
        "flood_refusals",
        "tokens",
        "updated",
        "window_started",
        "window_refusals",
        "unlogged",
        "logged_at",
    )

    def __init__(
        self,
        *,
        rate: float,
        burst: int,
        flood_refusals: int,
        now: float,
        byte_rate: float = math.inf,
        byte_burst: float = math.inf,
    ) -> None:
        self.rate = rate
        self.burst = float(burst)
        self.byte_rate = byte_rate
        self.byte_burst = float(byte_burst)
        self.byte_tokens = float(byte_burst)
        #: "frames" or "bytes": the bucket that refused the last refused frame.
        self.refused_for = "frames"
        self.flood_refusals = flood_refusals
        self.tokens = float(burst)  # a new connection may send its hello and catch-up frames at once
        self.updated = now
        self.window_started = now - FLOOD_WINDOW
        self.window_refusals = 0
        self.unlogged = 0
        self.logged_at = now - LOG_INTERVAL

    def admit(self, now: float, size: int = 0) -> bool:
        """Take a token (and ``size`` byte tokens) for a frame of ``size`` bytes arriving at ``now``: True to
        handle it, False to refuse it."""
        elapsed = now - self.updated
        tokens = min(self.tokens + elapsed * self.rate, self.burst)
        byte_tokens = self.byte_tokens
        if byte_tokens < self.byte_burst:  # an unlimited bucket stays full (inf * 0 would be nan)
            byte_tokens = min(byte_tokens + elapsed * self.byte_rate, self.byte_burst)
        self.updated = now
        if tokens >= 1.0 and byte_tokens >= size:
            self.tokens = tokens - 1.0
            self.byte_tokens = byte_tokens - size
            return True
        self.tokens, self.byte_tokens = tokens, byte_tokens
        self.refused_for = "frames" if tokens < 1.0 else "bytes"
        if now - self.window_started >= FLOOD_WINDOW:
            self.window_started = now
            self.window_refusals = 0
        self.window_refusals += 1
        self.unlogged += 1
        return False

    @property
    def flooding(self) -> bool:
        """More than ``flood_refusals`` frames were refused in the current window."""
        return self.window_refusals > self.flood_refusals

    def refusals_to_log(self, now: float) -> int:
        """The number of refusals to report in a log line now: 0 while the last line is recent (they are
        kept for the next one), else every refusal since the last line."""
        if self.unlogged == 0 or now - self.logged_at < LOG_INTERVAL:
            return 0
        count, self.unlogged = self.unlogged, 0
        self.logged_at = now
        return count
