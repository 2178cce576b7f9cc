"""``manage.py create_worker_token NAME [--owner USER] [--rotate]``: print a worker token for a daemon."""

from __future__ import annotations

from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand, CommandError
from django.db import transaction

from apps.workers import services
from apps.workers.models import Worker


class Command(BaseCommand):
    help = "Create a worker (or rotate its token with --rotate) and print the token for hypha-worker-daemon."

    def add_arguments(self, parser) -> None:
        parser.add_argument("name", help="worker name (letters, digits, - and _)")
        parser.add_argument("--owner", help="username of the worker's owner (created if missing)")
        parser.add_argument("--rotate", action="store_true", help="issue a new token for an existing worker")

    def handle(self, *args, name: str, owner: str | None, rotate: bool, **options) -> None:
        from django.core.exceptions import ValidationError
        from django.core.validators import validate_slug

        try:
            validate_slug(name)
        except ValidationError:
            raise CommandError(f"invalid worker name {name!r}: use letters, digits, '-' and '_'") from None
        owner_user = None
        if owner:
            owner_user, _ = get_user_model().objects.get_or_create(username=owner)
        with transaction.atomic():
            existing = Worker.objects.filter(name=name).first()
            if existing is not None:
                if not rotate:
                    raise CommandError(f"worker {name!r} exists; use --rotate to issue it a new token")
                token = existing.rotate_token()
            else:
                _, token = services.create_worker(name=name, owner=owner_user)
        self.stdout.write(token)
