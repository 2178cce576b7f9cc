"""Routes of the relay API, under ``/api/relay/jobs/<job id>/`` (hypha_site/api_urls.py)."""

from __future__ import annotations

from django.urls import path

from apps.relay.api.views import (
    ObjectReplyView,
    ObjectsView,
    ObjectWantView,
    UploadCompleteView,
    UploadsView,
    WantsView,
)

urlpatterns = [
    path("uploads/", UploadsView.as_view(), name="relay-uploads"),
    path("uploads/complete/", UploadCompleteView.as_view(), name="relay-upload-complete"),
    path("objects/", ObjectsView.as_view(), name="relay-objects"),
    path("objects/reply/", ObjectReplyView.as_view(), name="relay-object-reply"),
    path("objects/want/", ObjectWantView.as_view(), name="relay-object-want"),
    path("wants/", WantsView.as_view(), name="relay-wants"),
]
