"""The Celery app. Broker: ``REDIS_URL``; without it tasks run in the daphne process (hypha_site.runtime)."""

from __future__ import annotations

import os

from celery import Celery

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "hypha_site.settings")

app = Celery("hypha")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()
