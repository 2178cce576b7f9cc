"""The dashboard's pages (the browsers' websockets are in ``routing.py``)."""

from __future__ import annotations

from django.urls import path

from apps.dashboard import views

app_name = "dashboard"

urlpatterns = [
    path("", views.overview, name="overview"),
    path("login/", views.LoginView.as_view(), name="login"),
    path("logout/", views.LogoutView.as_view(), name="logout"),
    path("jobs/new/", views.submit_job, name="submit"),
    path("jobs/compare/", views.compare_jobs, name="compare"),
    path("jobs/<uuid:job_id>/", views.job_detail, name="job"),
    path("jobs/<uuid:job_id>/cancel/", views.cancel_job, name="cancel"),
    path("workers/<uuid:worker_id>/", views.worker_detail, name="worker"),
]
