"""Serializers of the accounting API: the caller's own figures (spend and earnings), and the help texts the jobs
and workers APIs use for theirs. Every amount is a decimal string of credits (to a millionth)."""

from __future__ import annotations

from rest_framework import serializers

COST_HELP = (
    "what the job has cost so far, in credits (decimal string): each lease's agreed price (credits per hour of "
    "a lease) × its ACTIVE time, up to now while it runs (docs/architecture.md, Accounting)"
)
EARNINGS_HELP = (
    "what the worker has earned so far over all its leases, in credits (decimal string): each lease's price × "
    "its ACTIVE time; shown to its owner and staff only"
)


def credits_field() -> serializers.DecimalField:
    """The schema of an amount of credits: a decimal string to a millionth (what every figure is sent as);
    for ``@extend_schema_field`` on the jobs' and workers' method fields."""
    return serializers.DecimalField(max_digits=24, decimal_places=6, read_only=True)


class MeSerializer(serializers.Serializer):
    """The signed-in user and their figures."""

    username = serializers.CharField(read_only=True)
    is_staff = serializers.BooleanField(read_only=True)
    spend = serializers.DecimalField(
        max_digits=24,
        decimal_places=6,
        read_only=True,
        help_text="what your jobs have cost so far, in credits (each lease's price × its ACTIVE time)",
    )
    earnings = serializers.DecimalField(
        max_digits=24,
        decimal_places=6,
        read_only=True,
        help_text="what your workers have earned so far, in credits",
    )
