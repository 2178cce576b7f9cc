"""``manage.py create_user_token USERNAME [--staff]``: issue a REST API token, creating the user if needed."""

from __future__ import annotations

from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand

from apps.workers.models import UserToken


class Command(BaseCommand):
    help = (
        "Issue a new REST API token for USERNAME (creating the user if needed) and print it. The token is "
        "stored only hashed: this is the one time it is shown. Earlier tokens keep working until deleted "
        "in the admin."
    )

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
        _, key = UserToken.issue(user)
        self.stdout.write(key)
