"""Operator admin for the relay: read-only (uploads, replies and deletions go through the services)."""

from __future__ import annotations

from django.contrib import admin

from apps.relay.models import RelayObject, RelayUsage, RelayWant
from hypha_site.admin_base import ReadOnlyModelAdmin


@admin.register(RelayObject)
class RelayObjectAdmin(ReadOnlyModelAdmin):
    list_display = ["key", "job", "status", "size", "writer_role", "writer", "reply_status", "created_at"]
    list_filter = ["status", "writer_role"]
    search_fields = ["=job__id", "key", "=blob", "writer"]
    list_select_related = ["job"]


@admin.register(RelayWant)
class RelayWantAdmin(ReadOnlyModelAdmin):
    list_display = ["key", "job", "requested_at", "handed_at"]
    search_fields = ["=job__id", "key"]
    list_select_related = ["job"]


@admin.register(RelayUsage)
class RelayUsageAdmin(ReadOnlyModelAdmin):
    list_display = ["job", "objects_written", "bytes_written", "bytes_read", "updated_at"]
    search_fields = ["=job__id"]
    list_select_related = ["job"]
