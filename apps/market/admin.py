"""Operator admin for the market: advertisements and offers are records of what the services decided."""

from __future__ import annotations

from django.contrib import admin
from django.db.models import QuerySet
from django.http import HttpRequest

from apps.market.models import Advertisement, Offer
from hypha_site.admin_base import ReadOnlyModelAdmin, ReadOnlyTabularInline


class OfferInline(ReadOnlyTabularInline):
    model = Offer
    fields = [
        "worker",
        "attempt",
        "price",
        "score",
        "benchmark_score",
        "status",
        "reason",
        "lease",
        "created_at",
        "decided_at",
    ]
    readonly_fields = fields
    ordering = ["created_at"]
    show_change_link = True

    def get_queryset(self, request: HttpRequest) -> QuerySet[Offer]:
        return super().get_queryset(request).select_related("worker", "lease")


@admin.register(Advertisement)
class AdvertisementAdmin(ReadOnlyModelAdmin):
    list_display = [
        "id",
        "job",
        "role",
        "status",
        "wanted",
        "attempt",
        "bid",
        "max_price",
        "window_closes_at",
    ]
    list_filter = ["status", "role"]
    search_fields = ["=id", "=job__id", "job__name"]
    list_select_related = ["job"]
    inlines = [OfferInline]


@admin.register(Offer)
class OfferAdmin(ReadOnlyModelAdmin):
    list_display = [
        "id",
        "advertisement",
        "worker",
        "price",
        "score",
        "benchmark_score",
        "status",
        "reason",
        "created_at",
    ]
    list_filter = ["status"]
    search_fields = ["=id", "=advertisement__id", "worker__name"]
    list_select_related = ["advertisement", "worker"]
