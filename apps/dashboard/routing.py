"""The browsers' websockets (mounted by ``hypha_site/asgi.py`` behind the session middleware)."""

from __future__ import annotations

from django.urls import path

from apps.dashboard.consumers import JobConsumer, OverviewConsumer

websocket_urlpatterns = [
    path("ws/dashboard/", OverviewConsumer.as_asgi()),
    path("ws/dashboard/jobs/<uuid:job_id>/", JobConsumer.as_asgi()),
]
