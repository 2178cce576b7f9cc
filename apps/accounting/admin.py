"""Operator admin for accruals: read-only (only the lease clock and the end of a lease write them)."""

from __future__ import annotations

from django.contrib import admin

from apps.accounting.models import Accrual
from hypha_site.admin_base import ReadOnlyModelAdmin


@admin.register(Accrual)
class AccrualAdmin(ReadOnlyModelAdmin):
    """What each lease accrued per period: amounts in credits, at the lease's price in credits per hour."""

    list_display = [
        "period_end", "job", "worker", "lease", "price", "period_start", "active_seconds", "amount",
        "lease_total", "final",
    ]  # fmt: skip
    list_filter = ["final"]
    search_fields = ["=lease__id", "=job__id", "job__name", "worker__name", "job__owner__username"]
    list_select_related = ["job", "worker", "lease"]
    date_hierarchy = "period_end"
