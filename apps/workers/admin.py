"""Operator admin for workers: tokens are issued, revoked and rotated by the code that owns them, never edited.

What a worker's daemon reports (resources, executors, price floor, strategy) and its presence are read-only:
the next connection overwrites them anyway. The operator's caps (``max_*``) are editable: the market counts
no more of each resource than its cap, whatever the daemon declares (``Worker.capacity``).
"""

from __future__ import annotations

from django.contrib import admin, messages
from django.db.models import QuerySet
from django.http import HttpRequest

from apps.jobs import services as job_services
from apps.workers import services
from apps.workers.exceptions import WorkerOffline
from apps.workers.models import UserToken, Worker


@admin.register(Worker)
class WorkerAdmin(admin.ModelAdmin):
    list_display = [
        "name",
        "owner",
        "status",
        "last_seen_at",
        "cpu",
        "memory",
        "gpu",
        "benchmark_score",
        "reliability",
        "reachable",
        "revoked",
    ]
    list_filter = ["status", "reachable", ("token_revoked_at", admin.EmptyFieldListFilter)]
    search_fields = ["name"]
    list_select_related = ["owner", "record"]
    raw_id_fields = ["owner"]
    actions = ["revoke_tokens", "rotate_tokens", "run_benchmarks"]
    readonly_fields = [
        "id",
        "status",
        "last_seen_at",
        "connected_at",
        "token_hint",
        "token_revoked_at",
        "cpu",
        "memory",
        "storage",
        "gpu",
        "devices",
        "executors",
        "price_floor",
        "strategy",
        "reachable",
        "connection_info",
        "benchmark_score",
        "benchmark",
        "counted_capacity",
        "reputation",
        "created_at",
    ]
    fieldsets = [
        (None, {"fields": ["id", "name", "owner"]}),
        ("Token", {"fields": ["token_hint", "token_revoked_at"]}),
        ("Presence", {"fields": ["status", "last_seen_at", "connected_at", "connection_info"]}),
        (
            "Reported by its daemon",
            {
                "fields": [
                    "cpu",
                    "memory",
                    "storage",
                    "gpu",
                    "devices",
                    "executors",
                    "price_floor",
                    "strategy",
                    "reachable",
                ]
            },
        ),
        (
            "Operator's cap (blank: none; the market counts no more than this)",
            {"fields": ["max_cpu", "max_memory", "max_storage", "max_gpu", "counted_capacity"]},
        ),
        ("Benchmark (samples/s, higher is faster)", {"fields": ["benchmark_score", "benchmark"]}),
        ("Reputation (moved by rounds and lease ends, never edited)", {"fields": ["reputation"]}),
        (None, {"fields": ["created_at"]}),
    ]
    add_fieldsets = [
        (None, {"fields": ["name", "owner"], "description": "The token is shown once, after saving."})
    ]

    @admin.display(boolean=True, description="revoked", ordering="token_revoked_at")
    def revoked(self, worker: Worker) -> bool:
        return worker.is_revoked

    @admin.display(description="reliability")
    def reliability(self, worker: Worker) -> str:
        return f"{worker.reliability:.3f}"

    @admin.display(description="record")
    def reputation(self, worker: Worker) -> str:
        record = getattr(worker, "record", None)
        if record is None:
            return f"none yet (reliability {worker.reliability:.3f}, the prior)"
        speed = (
            f"{record.speed_vs_benchmark:.2f}× its benchmark over {record.speed_rounds} round(s)"
            if record.speed_vs_benchmark is not None
            else "speed not measured"
        )
        return (
            f"reliability {record.reliability:.3f}; updates {record.updates_accepted} accepted, "
            f"{record.updates_down_weighted} down-weighted, {record.updates_rejected} rejected; leases "
            f"{record.leases_completed} completed, {record.leases_lost} lost; {record.jobs_served} job(s) "
            f"served; {speed}"
        )

    @admin.display(description="capacity counted (declared, capped)")
    def counted_capacity(self, worker: Worker) -> str:
        capacity = worker.capacity
        return (
            f"{capacity.cpu:g} cores, {capacity.memory:g} GB memory, {capacity.storage:g} GB storage, "
            f"{capacity.gpu:g} GB VRAM"
        )

    def get_fieldsets(self, request: HttpRequest, obj: Worker | None = None):
        return self.add_fieldsets if obj is None else self.fieldsets

    def save_model(self, request: HttpRequest, obj: Worker, form, change: bool) -> None:
        if change:
            super().save_model(request, obj, form, change)
            return
        # A new worker needs a token: the service creates it, and the admin carries on with the saved row.
        worker, token = services.create_worker(name=obj.name, owner=obj.owner)
        obj.pk = worker.pk
        obj.refresh_from_db()
        obj._state.adding = False
        messages.success(request, f"Token of worker {worker.name} (shown only this once): {token}")

    @admin.action(description="Revoke token (disconnect, end its leases)", permissions=["change"])
    def revoke_tokens(self, request: HttpRequest, queryset: QuerySet[Worker]) -> None:
        names = []
        for worker in queryset:
            job_services.revoke_worker(worker)
            names.append(worker.name)
        messages.success(request, f"Revoked the token of {len(names)} worker(s): {', '.join(names)}.")

    @admin.action(description="Rotate token (show the new one)", permissions=["change"])
    def rotate_tokens(self, request: HttpRequest, queryset: QuerySet[Worker]) -> None:
        for worker in queryset:
            token = job_services.rotate_token(worker)
            messages.success(request, f"New token of worker {worker.name} (shown only this once): {token}")

    @admin.action(
        description="Run benchmark (online workers; the score arrives in seconds)", permissions=["change"]
    )
    def run_benchmarks(self, request: HttpRequest, queryset: QuerySet[Worker]) -> None:
        asked, offline = [], []
        for worker in queryset:
            try:
                services.request_benchmark(worker)
            except WorkerOffline:
                offline.append(worker.name)
            else:
                asked.append(worker.name)
        if asked:
            messages.success(
                request, f"Asked {len(asked)} worker(s) to run their benchmark: {', '.join(asked)}."
            )
        if offline:
            messages.warning(request, f"Not asked, offline: {', '.join(offline)}.")


@admin.register(UserToken)
class UserTokenAdmin(admin.ModelAdmin):
    """Users' API tokens: issued here (the key shown once, after saving), listed by prefix and dates, deleted to
    revoke. The key itself is stored nowhere, so it cannot be shown again."""

    list_display = ["key_prefix", "user", "created_at", "last_used_at"]
    list_select_related = ["user"]
    search_fields = ["user__username", "key_prefix"]
    raw_id_fields = ["user"]
    fields = ["user", "key_prefix", "created_at", "last_used_at"]
    readonly_fields = ["key_prefix", "created_at", "last_used_at"]

    def get_readonly_fields(self, request: HttpRequest, obj: UserToken | None = None):
        return self.readonly_fields if obj is None else ["user", *self.readonly_fields]

    def save_model(self, request: HttpRequest, obj: UserToken, form, change: bool) -> None:
        if change:
            return  # nothing of a token is editable
        token, key = UserToken.issue(obj.user)
        obj.pk = token.pk
        obj.refresh_from_db()
        obj._state.adding = False
        messages.success(request, f"API token of {token.user} (shown only this once): {key}")
