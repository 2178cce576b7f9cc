"""Live updates for browsers: what :mod:`apps.jobs.observers` calls when something a dashboard shows changed.

Each function is called inside the transaction that made the change and must only schedule work after
commit (``hypha_site.runtime.send_on_commit``). To be filled in by the dashboard.
"""

from __future__ import annotations


def job_changed(job) -> None:
    """The job's status, reason, leases or tasks changed."""


def round_recorded(round_) -> None:
    """A round's record changed: the parameter server's report or a trainer's metrics arrived."""


def task_progress(task) -> None:
    """A trainer reported a step (called once per optimizer step: throttle)."""
