"""Operator admin for jobs: read-only state (transitions go through the services), and a Cancel action."""

from __future__ import annotations

from django.contrib import admin, messages
from django.db.models import QuerySet
from django.http import HttpRequest

from apps.jobs import services
from apps.jobs.exceptions import JobNotCancellable
from apps.jobs.models import Job, JobEvent
from hypha_site.admin_base import ReadOnlyModelAdmin, ReadOnlyTabularInline


class JobEventInline(ReadOnlyTabularInline):
    model = JobEvent
    fields = ["at", "from_status", "to_status", "reason"]
    readonly_fields = fields
    ordering = ["at", "id"]


@admin.register(Job)
class JobAdmin(admin.ModelAdmin):
    list_display = ["__str__", "owner", "status", "status_reason", "num_trainers", "created_at"]
    list_filter = ["status"]
    search_fields = ["name", "owner__username", "=id"]
    list_select_related = ["owner"]
    date_hierarchy = "created_at"
    inlines = [JobEventInline]
    actions = ["cancel_jobs"]
    fields = [
        "id",
        "name",
        "owner",
        "status",
        "status_reason",
        "num_trainers",
        "requirements",
        "spec",
        "created_at",
        "updated_at",
        "allocated_at",
        "ended_at",
    ]
    # Jobs are submitted through the API (which validates them and queues the allocation); everything but the
    # name is state or a commitment already advertised to the market.
    readonly_fields = [field for field in fields if field != "name"]

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj=None) -> bool:
        return False

    @admin.action(description="Cancel (close adverts, release leases)", permissions=["change"])
    def cancel_jobs(self, request: HttpRequest, queryset: QuerySet[Job]) -> None:
        cancelled, refused = [], []
        for job in queryset:
            try:
                services.cancel_job(job, reason=f"cancelled by {request.user} in the admin")
                cancelled.append(str(job))
            except JobNotCancellable:
                refused.append(f"{job} ({job.status})")
        if cancelled:
            messages.success(request, f"Cancelled {len(cancelled)} job(s): {', '.join(cancelled)}.")
        if refused:
            messages.warning(request, f"Already ended, not cancelled: {', '.join(refused)}.")


@admin.register(JobEvent)
class JobEventAdmin(ReadOnlyModelAdmin):
    list_display = ["at", "job", "from_status", "to_status", "reason"]
    list_filter = ["to_status"]
    search_fields = ["=job__id", "job__name", "reason"]
    list_select_related = ["job"]
