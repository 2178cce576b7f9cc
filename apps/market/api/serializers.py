"""Serializers of the market API: advertisements (with their private maximum) and offers, read-only."""

from __future__ import annotations

from rest_framework import serializers

from apps.market.models import Advertisement, Offer
from hypha_site.api import (
    EnumField,
    ExecutorSerializer,
    NullIfInfiniteFloatField,
    ResourcesSerializer,
    status_filter,
    uuid_filter,
)
from worker_daemon.protocol import PRICE_MEANING


class AdvertisementSerializer(serializers.ModelSerializer):
    """A job role asking the market for workers. Only the job's owner and staff see it, so `max_price` too."""

    status = EnumField(Advertisement.Status, read_only=True)
    resources = ResourcesSerializer(source="*", read_only=True, help_text="minimum resources per worker")
    executors = ExecutorSerializer(many=True, read_only=True, help_text="every one must be offered")

    class Meta:
        model = Advertisement
        fields = [
            "id",
            "job",
            "role",
            "status",
            "wanted",
            "attempt",
            "bid",
            "max_price",
            "resources",
            "executors",
            "window_closes_at",
            "next_attempt_at",
            "created_at",
            "closed_at",
        ]
        read_only_fields = fields
        extra_kwargs = {
            "wanted": {"help_text": "workers the role still needs: 0 once the advertisement is filled"},
            "attempt": {"help_text": "the offer window it is in, counted from 0 (0: the first)"},
            "bid": {"help_text": f"public price per worker, {PRICE_MEANING}"},
            "max_price": {"help_text": f"private maximum, {PRICE_MEANING}"},
        }


class OfferSerializer(serializers.ModelSerializer):
    """A worker's answer to an advertisement, and what the market decided."""

    job = serializers.UUIDField(source="advertisement.job_id", read_only=True)
    worker = serializers.CharField(source="worker.name", read_only=True, help_text="the worker's name")
    status = EnumField(Offer.Status, read_only=True)
    resources = ResourcesSerializer(source="*", read_only=True, help_text="resources offered")
    score = NullIfInfiniteFloatField(
        read_only=True,
        allow_null=True,
        help_text="price ÷ weighted capacity (25·GPU GB + CPU cores + 0.1·memory GB + 0.01·storage GB, times the "
        "share its benchmark supports), lower wins; null for an offer of no capacity (it never wins)",
    )

    class Meta:
        model = Offer
        fields = [
            "id",
            "advertisement",
            "job",
            "worker",
            "attempt",
            "price",
            "resources",
            "score",
            "status",
            "reason",
            "lease",
            "expires_at",
            "created_at",
            "decided_at",
        ]
        read_only_fields = fields
        extra_kwargs = {
            "price": {"help_text": f"the price asked, {PRICE_MEANING}"},
            "attempt": {"help_text": "the advertisement's offer window it answered, counted from 0"},
        }


class AdvertisementFilterSerializer(serializers.Serializer):
    job = uuid_filter("only the advertisements of this job")
    status = status_filter(Advertisement.Status, "only advertisements in this status")


class OfferFilterSerializer(serializers.Serializer):
    advertisement = uuid_filter("only the offers on this advertisement")
    job = uuid_filter("only the offers on this job's advertisements")
    worker = uuid_filter("only the offers of this worker (its id)")
    status = status_filter(Offer.Status, "only offers in this status")
