"""The local store's byte routes, under ``/relay/`` (hypha_site/urls.py)."""

from __future__ import annotations

from django.urls import path

from apps.relay import views

urlpatterns = [
    path("<uuid:job_id>/<uuid:blob>/<int:number>", views.part, name="relay-part"),
    path("<uuid:job_id>/<uuid:blob>", views.object_bytes, name="relay-object"),
]
