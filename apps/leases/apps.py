from django.apps import AppConfig


class LeasesConfig(AppConfig):
    name = "apps.leases"
    label = "leases"
    default_auto_field = "django.db.models.BigAutoField"
