"""``manage.py create_user_token USERNAME [--staff]``: print an API token, creating the user if needed."""

from __future__ import annotations

from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand
from rest_framework.authtoken.models import Token


class Command(BaseCommand):
    help = "Print the REST API token of USERNAME (creating the user and the token if needed)."

    def add_arguments(self, parser) -> None:
        parser.add_argument("username")
        parser.add_argument("--staff", action="store_true", help="make the user staff (sees every job)")

    def handle(self, *args, username: str, staff: bool, **options) -> None:
        user, created = get_user_model().objects.get_or_create(username=username)
        if created:
            user.set_unusable_password()
        if staff and not user.is_staff:
            user.is_staff = True
        user.save()
        token, _ = Token.objects.get_or_create(user=user)
        self.stdout.write(token.key)
