"""REST API routes (each app contributes its viewsets from its ``api`` package)."""

from __future__ import annotations

from rest_framework.routers import DefaultRouter

router = DefaultRouter()
urlpatterns = router.urls
