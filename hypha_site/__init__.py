"""The Hypha control plane's Django project: settings, ASGI entry point, URLs and the Celery app."""

from .celery import app as celery_app

__all__ = ["celery_app"]
