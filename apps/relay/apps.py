from django.apps import AppConfig


class RelayConfig(AppConfig):
    name = "apps.relay"
    label = "relay"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        # Registers the relay's Celery tasks in every process: the embedded runner looks the beat schedule's
        # tasks up by name at start, before any request has imported the relay's views and services.
        from apps.relay import tasks  # noqa: F401
