"""``manage.py create_data_node_token NAME --url URL [--owner USER]``: print a token for hypha-data-node."""

from __future__ import annotations

from django.contrib.auth import get_user_model
from django.core.exceptions import ValidationError
from django.core.management.base import BaseCommand, CommandError
from django.core.validators import URLValidator, validate_slug

from apps.datasets import services
from apps.datasets.models import DataNode


class Command(BaseCommand):
    help = "Create a data node and print its token (shown once, stored hashed) for hypha-data-node."

    def add_arguments(self, parser) -> None:
        parser.add_argument("name", help="data node name (letters, digits, - and _)")
        parser.add_argument("--url", required=True, help="the public http(s) URL the node serves slices at")
        parser.add_argument("--owner", help="username of the node's owner (created if missing)")

    def handle(self, *args, name: str, url: str, owner: str | None, **options) -> None:
        try:
            validate_slug(name)
        except ValidationError:
            raise CommandError(f"invalid data node name {name!r}: use letters, digits, '-' and '_'") from None
        try:
            URLValidator(schemes=["http", "https"])(url)
        except ValidationError:
            raise CommandError(f"invalid --url {url!r}: give an http(s) URL") from None
        if DataNode.objects.filter(name=name).exists():
            raise CommandError(f"data node {name!r} exists")
        owner_user = get_user_model().objects.get_or_create(username=owner)[0] if owner else None
        _node, token = services.create_data_node(name=name, url=url, owner=owner_user)
        self.stdout.write(token)
