"""REST API routes (each app contributes its viewsets from its ``api`` package)."""

from __future__ import annotations

from django.urls import path
from rest_framework.routers import DefaultRouter

from apps.datasets.api.views import DatasetViewSet
from apps.jobs.api.views import (
    JobCheckpointDownloadView,
    JobCheckpointUploadView,
    JobModelView,
    JobViewSet,
    UploadViewSet,
    job_model_download,
)
from apps.leases.api.views import LeaseViewSet
from apps.market.api.views import AdvertisementViewSet, OfferViewSet
from apps.workers.api.views import WorkerViewSet

router = DefaultRouter()
router.register("jobs", JobViewSet, basename="job")
router.register("workers", WorkerViewSet, basename="worker")
router.register("advertisements", AdvertisementViewSet, basename="advertisement")
router.register("offers", OfferViewSet, basename="offer")
router.register("leases", LeaseViewSet, basename="lease")
router.register("datasets", DatasetViewSet, basename="dataset")
router.register("uploads", UploadViewSet, basename="upload")
urlpatterns = [
    path("jobs/<uuid:pk>/model", job_model_download, name="job-model"),
    path("jobs/<uuid:pk>/model/<str:filename>", JobModelView.as_view(), name="job-model-file"),
    path(
        "jobs/<uuid:pk>/checkpoint/<int:round_number>/<str:filename>",
        JobCheckpointUploadView.as_view(),
        name="job-checkpoint-upload",
    ),
    path(
        "jobs/<uuid:pk>/checkpoint/<str:filename>",
        JobCheckpointDownloadView.as_view(),
        name="job-checkpoint-file",
    ),
    *router.urls,
]
