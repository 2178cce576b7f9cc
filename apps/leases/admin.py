"""Operator admin for leases: read-only (activation, renewal, expiry and release go through the services)."""

from __future__ import annotations

from django.contrib import admin

from apps.leases.models import Lease, LeaseClock, LeaseEvent
from hypha_site.admin_base import ReadOnlyModelAdmin, ReadOnlyTabularInline


class LeaseEventInline(ReadOnlyTabularInline):
    model = LeaseEvent
    fields = ["at", "kind", "from_status", "to_status", "expires_at", "detail"]
    readonly_fields = fields
    ordering = ["at", "id"]


@admin.register(Lease)
class LeaseAdmin(ReadOnlyModelAdmin):
    list_display = [
        "id", "job", "role", "worker", "status", "devices", "price", "expires_at", "renewals", "created_at"
    ]  # fmt: skip
    list_filter = ["status", "role"]
    search_fields = ["=id", "=job__id", "job__name", "worker__name"]
    list_select_related = ["job", "worker"]
    inlines = [LeaseEventInline]


@admin.register(LeaseEvent)
class LeaseEventAdmin(ReadOnlyModelAdmin):
    list_display = ["at", "lease", "kind", "from_status", "to_status", "expires_at", "detail"]
    list_filter = ["kind"]
    search_fields = ["=lease__id", "detail"]
    list_select_related = ["lease"]


@admin.register(LeaseClock)
class LeaseClockAdmin(ReadOnlyModelAdmin):
    """When the lease clock last ran, and its last resume after a stop (a control-plane restart)."""

    list_display = ["ticked_at", "resumed_at", "stopped_for", "resumptions"]
