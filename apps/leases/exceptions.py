"""Errors of the leases app.

LeaseError
├── LeaseTransitionRefused   the lease's state machine does not allow this transition now
└── CapacityExceeded         the worker's free resources cannot hold another lease
"""

from __future__ import annotations


class LeaseError(Exception):
    """Base class of lease errors."""


class LeaseTransitionRefused(LeaseError):
    def __init__(self, lease, transition: str, message: str) -> None:
        super().__init__(f"lease {lease.pk}: {transition} refused: {message}")
        self.lease = lease
        self.transition = transition


class CapacityExceeded(LeaseError):
    """The worker is already leased up to its capacity."""
