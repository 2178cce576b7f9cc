"""Accruals: what a lease has cost its job (and earned its worker) so far, one row per lease per period.

A lease accrues at its agreed ``price`` (credits per hour of a lease, ``worker_daemon.protocol.PRICE_MEANING``)
for every second it is ACTIVE: from ``Lease.activated_at`` to ``Lease.ended_at`` (or now, while it runs). A
TEMPORARY lease (an open offer) costs nothing. The rows of one lease are contiguous periods starting at its
activation; the lease clock writes one every ``HYPHA_ACCRUAL_INTERVAL`` seconds while the lease runs, and its
end writes the last one (``final``).

Each row stores ``lease_total``, the lease's cost from its activation to ``period_end`` rounded to
:data:`QUANTUM`, and ``amount`` is the difference from the row before; so the amounts of a lease add up to
exactly ``price × active time`` (rounded once, never a sum of rounded parts), and the rows of an ended lease
add up to its whole cost.

Written only by :mod:`apps.accounting.services`, under the lease's row lock; ``(lease, period_start)`` is unique
and a lease has at most one ``final`` row, so a repeated tick or two racing writers never count a period twice.
"""

from __future__ import annotations

from decimal import Decimal

from django.db import models
from django.db.models import F, Q

#: Accrued amounts are kept to a millionth of a credit.
QUANTUM = Decimal("0.000001")


class Accrual(models.Model):
    lease = models.ForeignKey("leases.Lease", on_delete=models.CASCADE, related_name="accruals")
    # Copies of the lease's job and worker: the job's cost, the worker's earnings and the owner's spend are
    # sums over an index, with no join through the leases.
    job = models.ForeignKey("jobs.Job", on_delete=models.CASCADE, related_name="accruals")
    worker = models.ForeignKey("workers.Worker", on_delete=models.CASCADE, related_name="accruals")
    price = models.FloatField(help_text="the lease's agreed price, credits per hour of a lease")
    period_start = models.DateTimeField()
    period_end = models.DateTimeField()
    active_seconds = models.DecimalField(
        max_digits=18, decimal_places=6, help_text="seconds of the period the lease was ACTIVE"
    )
    amount = models.DecimalField(max_digits=24, decimal_places=6, help_text="credits accrued in this period")
    lease_total = models.DecimalField(
        max_digits=24,
        decimal_places=6,
        help_text="credits the lease accrued from its activation to period_end",
    )
    final = models.BooleanField(default=False, help_text="the lease's last accrual, written when it ended")
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["lease", "period_start"]
        constraints = [
            models.UniqueConstraint(fields=["lease", "period_start"], name="accrual_one_row_per_period"),
            models.UniqueConstraint(fields=["lease"], condition=Q(final=True), name="accrual_one_final_row"),
            models.CheckConstraint(
                condition=Q(period_end__gte=F("period_start")), name="accrual_period_order"
            ),
        ]
        indexes = [
            models.Index(fields=["job"]),
            models.Index(fields=["worker"]),
            models.Index(fields=["lease", "-period_end"]),
        ]

    def __str__(self) -> str:
        return f"{self.amount} credits for lease {self.lease_id} ({self.period_start:%H:%M:%S}–{self.period_end:%H:%M:%S})"
