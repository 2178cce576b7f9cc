"""The market API (read-only): advertisements of the caller's jobs, and offers on them or by the caller's workers.

Staff see everything.
"""

from __future__ import annotations

from django.db.models import Q, QuerySet
from drf_spectacular.utils import extend_schema, extend_schema_view
from rest_framework import viewsets

from apps.market.api.serializers import (
    AdvertisementFilterSerializer,
    AdvertisementSerializer,
    OfferFilterSerializer,
    OfferSerializer,
)
from apps.market.models import Advertisement, Offer
from hypha_site.api import FilteredListMixin, error_responses


@extend_schema_view(
    list=extend_schema(
        summary="List advertisements of your jobs",
        parameters=[AdvertisementFilterSerializer],
        responses={200: AdvertisementSerializer, **error_responses(400, 401)},
    ),
    retrieve=extend_schema(
        summary="Show an advertisement", responses={200: AdvertisementSerializer, **error_responses(401, 404)}
    ),
)
class AdvertisementViewSet(FilteredListMixin, viewsets.ReadOnlyModelViewSet):
    """Advertisements: a job role asking the market for workers. You see those of your jobs; staff see all."""

    serializer_class = AdvertisementSerializer
    filter_serializer_class = AdvertisementFilterSerializer
    filter_lookups = {"job": "job_id"}

    def get_queryset(self) -> QuerySet[Advertisement]:
        if getattr(self, "swagger_fake_view", False):  # drf-spectacular inspecting the view
            return Advertisement.objects.none()
        advertisements = Advertisement.objects.all()
        if not self.request.user.is_staff:
            advertisements = advertisements.filter(job__owner=self.request.user)
        return advertisements


@extend_schema_view(
    list=extend_schema(
        summary="List offers on your jobs or by your workers",
        parameters=[OfferFilterSerializer],
        responses={200: OfferSerializer, **error_responses(400, 401)},
    ),
    retrieve=extend_schema(
        summary="Show an offer", responses={200: OfferSerializer, **error_responses(401, 404)}
    ),
)
class OfferViewSet(FilteredListMixin, viewsets.ReadOnlyModelViewSet):
    """Offers workers made on advertisements. You see the offers on your jobs and those your workers made;
    staff see all."""

    serializer_class = OfferSerializer
    filter_serializer_class = OfferFilterSerializer
    filter_lookups = {
        "advertisement": "advertisement_id",
        "job": "advertisement__job_id",
        "worker": "worker_id",
    }

    def get_queryset(self) -> QuerySet[Offer]:
        if getattr(self, "swagger_fake_view", False):  # drf-spectacular inspecting the view
            return Offer.objects.none()
        offers = Offer.objects.select_related("advertisement", "worker")
        if not self.request.user.is_staff:
            user = self.request.user
            offers = offers.filter(Q(advertisement__job__owner=user) | Q(worker__owner=user))
        return offers
