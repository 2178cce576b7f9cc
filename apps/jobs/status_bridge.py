"""Hypha's AIM status bridge (reference §8): one POST per metric to ``http://<bridge>/status``.

To be filled in with observability: called by :mod:`apps.jobs.observers` inside the transaction that recorded
the metrics; must only schedule work after commit and never let an unreachable bridge fail anything.
"""

from __future__ import annotations


def trainer_metrics(*, worker_id: str, round_number: int, metrics: dict[str, float]) -> None:
    """A trainer's metrics for one round (``{"loss": …, …}``)."""
