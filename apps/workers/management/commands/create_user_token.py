"""``manage.py create_user_token USERNAME [--staff] [--password-stdin]``: issue a REST API token, creating the
user if needed; with ``--password-stdin`` also set the user's dashboard password from stdin.

The password is read from stdin, never from the command line (where every user of the machine sees it in
``ps``), so that a script can give a user a dashboard login: ``changepassword`` needs a terminal. On a
terminal it is prompted for without echo; otherwise the first line is the password (its line ending removed).
"""

from __future__ import annotations

import getpass
import sys

from django.contrib.auth import get_user_model, password_validation
from django.core.exceptions import ValidationError
from django.core.management.base import BaseCommand, CommandError
from django.db import transaction

from apps.workers.models import UserToken


class Command(BaseCommand):
    help = (
        "Issue a new REST API token for USERNAME (creating the user if needed) and print it. The token is "
        "stored only hashed: this is the one time it is shown. Earlier tokens keep working until deleted "
        "in the admin. With --password-stdin, also set the user's dashboard password to the first line of "
        "stdin (checked by the password validators)."
    )
    #: ``call_command(..., stdin=StringIO(...))`` hands the command its stdin (as ``createsuperuser``'s does).
    stealth_options = ("stdin",)

    def add_arguments(self, parser) -> None:
        parser.add_argument("username")
        parser.add_argument("--staff", action="store_true", help="make the user staff (sees every job)")
        parser.add_argument(
            "--password-stdin",
            action="store_true",
            help="set the user's dashboard password to the first line of stdin (prompted for, without echo, "
            "on a terminal); never pass a password as an argument",
        )

    def handle(self, *args, username: str, staff: bool, password_stdin: bool = False, **options) -> None:
        password = self._read_password(options.get("stdin") or sys.stdin) if password_stdin else None
        with transaction.atomic():
            user, created = get_user_model().objects.get_or_create(username=username)
            if password is not None:
                try:
                    password_validation.validate_password(password, user)
                except ValidationError as error:
                    # Raised inside the transaction: a user created by this call is rolled back with it.
                    raise CommandError("the password was refused: " + " ".join(error.messages)) from None
                user.set_password(password)
            elif created:
                user.set_unusable_password()
            if staff and not user.is_staff:
                user.is_staff = True
            user.save()
            _, key = UserToken.issue(user)
        self.stdout.write(key)

    @staticmethod
    def _read_password(stream) -> str:
        """The password: prompted for without echo on a terminal, else the first line of ``stream`` without
        its line ending. An empty one is refused."""
        if stream is sys.stdin and stream.isatty():
            password = getpass.getpass("Password: ")
        else:
            password = stream.readline().rstrip("\r\n")
        if not password:
            raise CommandError(
                "--password-stdin: no password on stdin (its first line is empty); "
                "e.g. printf '%s\\n' \"$PASSWORD\" | manage.py create_user_token USER --password-stdin"
            )
        return password
