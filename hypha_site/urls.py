from __future__ import annotations

from django.contrib import admin
from django.http import JsonResponse
from django.urls import include, path
from django.views.defaults import page_not_found
from drf_spectacular.views import SpectacularAPIView, SpectacularSwaggerView

from apps.dashboard.login import ThrottledAdminAuthenticationForm
from hypha_site.metrics import metrics_view

# The admin's password form counts failures and locks out guessers, as the dashboard's does.
admin.site.login_form = ThrottledAdminAuthenticationForm


def healthz(request):
    """Liveness and database check for load balancers and docker compose."""
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute("SELECT 1")
    return JsonResponse({"status": "ok"})


def not_found(request, exception):
    """A 404 under /api/ is JSON like every other API error (``{"detail": ...}``), also when no route matched
    (a malformed id such as ``/api/jobs/0.5/``); elsewhere Django's page."""
    if request.path.startswith("/api/"):
        return JsonResponse({"detail": "Not found."}, status=404)
    return page_not_found(request, exception)


handler404 = not_found

urlpatterns = [
    path("", include("apps.dashboard.urls")),
    path("healthz", healthz, name="healthz"),
    # Prometheus scrapes with a bearer token (or staff with their session); a plain view, not in the schema.
    path("metrics", metrics_view, name="metrics"),
    # The local relay store's bytes, behind signed URLs (apps/relay/views.py); 404 with the S3 store.
    path("relay/", include("apps.relay.urls")),
    path("admin/", admin.site.urls),
    path("api/", include("hypha_site.api_urls")),
    path("api/schema/", SpectacularAPIView.as_view(), name="schema"),
    path("api/docs/", SpectacularSwaggerView.as_view(url_name="schema"), name="api-docs"),
]
