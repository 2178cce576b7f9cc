"""REST API routes (each app contributes its viewsets from its ``api`` package)."""

from __future__ import annotations

from django.urls import include, path
from rest_framework.routers import DefaultRouter

from apps.accounting.api.views import MeView
from apps.datasets import views as dataset_views
from apps.datasets.api.publish import PublishCompleteView, PublishView
from apps.datasets.api.views import DatasetViewSet
from apps.jobs.api.inference import InferenceJobView, JobResultView, job_results_download
from apps.jobs.api.views import (
    JobCheckpointDownloadView,
    JobCheckpointUploadView,
    JobModelView,
    JobViewSet,
    UploadViewSet,
    job_model_download,
    job_task_log,
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
    path("me/", MeView.as_view(), name="me"),
    # Before the router's routes: its job detail route would take "inference" for a job id.
    path("jobs/inference/", InferenceJobView.as_view(), name="job-inference"),
    path("jobs/<uuid:pk>/results/", job_results_download, name="job-results"),
    path("jobs/<uuid:pk>/results/<int:index>/", JobResultView.as_view(), name="job-result"),
    path("jobs/<uuid:pk>/model", job_model_download, name="job-model"),
    path("jobs/<uuid:pk>/tasks/<uuid:task_id>/log", job_task_log, name="job-task-log"),
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
    # Data nodes behind NAT publish their slices to the relay's store; trainers download them here
    # (docs/transfers.md, "Data nodes behind NAT").
    path("datanodes/publish/", PublishView.as_view(), name="datanode-publish"),
    path("datanodes/publish/complete/", PublishCompleteView.as_view(), name="datanode-publish-complete"),
    path(
        "datanodes/parts/<uuid:node_id>/<uuid:blob>/<int:number>",
        dataset_views.published_part,
        name="datanode-published-part",
    ),
    path(
        "datanodes/<uuid:node_id>/datasets/<slug:name>/slices/<int:index>",
        dataset_views.published_slice,
        name="datanode-published-slice",
    ),
    # The relay's index and URLs, for a job's tasks (transfer tokens): docs/transfers.md.
    path("relay/jobs/<uuid:job_id>/", include("apps.relay.api.urls")),
    *router.urls,
]
