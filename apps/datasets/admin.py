"""Operator admin for datasets: read-only (data nodes register datasets; slices move through the services)."""

from __future__ import annotations

from django.contrib import admin
from django.db import models

from apps.datasets.models import (
    DataNode,
    Dataset,
    DatasetReplica,
    JobSlice,
    PublishedSlice,
    Slice,
    SliceEvent,
)
from hypha_site.admin_base import ReadOnlyModelAdmin, ReadOnlyTabularInline


class DatasetReplicaInline(ReadOnlyTabularInline):
    model = DatasetReplica
    fields = ["node", "registered_at"]
    readonly_fields = fields


class SliceEventInline(ReadOnlyTabularInline):
    model = SliceEvent
    fields = ["at", "kind", "from_status", "to_status", "lease", "detail"]
    readonly_fields = fields
    ordering = ["at", "id"]


@admin.register(Dataset)
class DatasetAdmin(ReadOnlyModelAdmin):
    list_display = ["name", "slice_count", "total_bytes", "created_at"]
    search_fields = ["name"]
    inlines = [DatasetReplicaInline]


@admin.register(DataNode)
class DataNodeAdmin(ReadOnlyModelAdmin):
    list_display = ["name", "owner", "url", "reachable", "online", "last_seen_at", "created_at"]
    list_filter = ["online", "reachable"]
    search_fields = ["name", "url", "owner__username"]
    list_select_related = ["owner"]
    exclude = ["token_hash"]
    # Data node URLs are HTTPS; saying so also silences Django 5's warning about the form field's default scheme.
    formfield_overrides = {models.URLField: {"assume_scheme": "https"}}


@admin.register(DatasetReplica)
class DatasetReplicaAdmin(ReadOnlyModelAdmin):
    list_display = ["dataset", "node", "registered_at"]
    search_fields = ["dataset__name", "node__name"]
    list_select_related = ["dataset", "node"]


@admin.register(Slice)
class SliceAdmin(ReadOnlyModelAdmin):
    list_display = ["dataset", "index", "size_bytes", "sha256"]
    search_fields = ["dataset__name", "sha256"]
    list_select_related = ["dataset"]


@admin.register(JobSlice)
class JobSliceAdmin(ReadOnlyModelAdmin):
    list_display = ["job", "slice", "epoch", "status", "assigned_lease", "assigned_at", "used_at"]
    list_filter = ["status"]
    search_fields = ["=job__id", "job__name", "=assigned_lease__id"]
    list_select_related = ["job", "slice__dataset", "assigned_lease__worker"]
    inlines = [SliceEventInline]


@admin.register(SliceEvent)
class SliceEventAdmin(ReadOnlyModelAdmin):
    list_display = ["at", "job_slice", "kind", "from_status", "to_status", "lease", "detail"]
    list_filter = ["kind"]
    search_fields = ["=job_slice__job__id", "=lease__id", "detail"]
    list_select_related = ["job_slice", "lease__worker"]


@admin.register(PublishedSlice)
class PublishedSliceAdmin(ReadOnlyModelAdmin):
    """Copies of slices that data nodes behind NAT published to the relay's store."""

    list_display = ["slice", "node", "status", "size", "created_at", "completed_at"]
    list_filter = ["status"]
    search_fields = ["node__name", "slice__dataset__name", "=blob"]
    list_select_related = ["node", "slice__dataset"]
