"""Login throttling for the dashboard's and the admin's password forms.

Failed logins are counted in the cache (Redis in services mode, so every daphne process sees the same
counts) per username and per client address, each in a fixed window of ``HYPHA_LOGIN_LOCKOUT_SECONDS`` that
starts at its first failure. Once a username has ``HYPHA_LOGIN_FAILURE_LIMIT`` failures, or an address
``HYPHA_LOGIN_ADDRESS_FAILURE_LIMIT``, every login of that username or from that address is refused — the
right password included, and before the password is even checked — until the window ends. A successful login
forgets its username's failures (not its address's: one valid account must not reset the count of an
address guessing others).

The address is ``REMOTE_ADDR``: behind a reverse proxy run ``hypha-server --proxy-headers`` so that it is the
client's, not the proxy's (docs/deploy.md).
"""

from __future__ import annotations

import hashlib
import math

from django import forms
from django.conf import settings
from django.contrib.admin.forms import AdminAuthenticationForm
from django.contrib.auth.forms import AuthenticationForm
from django.core.cache import cache


def _key(kind: str, value: str) -> str:
    # Hashed: usernames are user input, and cache keys must be short and free of control characters.
    return f"login-failures:{kind}:{hashlib.sha256(value.encode('utf-8', 'replace')).hexdigest()}"


def _keys(username: str, address: str) -> list[tuple[str, int]]:
    return [
        (_key("username", username.strip().lower()), settings.HYPHA_LOGIN_FAILURE_LIMIT),
        (_key("address", address), settings.HYPHA_LOGIN_ADDRESS_FAILURE_LIMIT),
    ]


def locked_out(username: str, address: str) -> bool:
    """True while ``username`` or ``address`` has reached its limit of failures."""
    counts = cache.get_many([key for key, _ in _keys(username, address)])
    return any(counts.get(key, 0) >= limit for key, limit in _keys(username, address))


def record_failure(username: str, address: str) -> None:
    for key, _ in _keys(username, address):
        # add() starts the window (only when the key is absent); incr() is atomic in Redis.
        cache.add(key, 0, timeout=settings.HYPHA_LOGIN_LOCKOUT_SECONDS)
        try:
            cache.incr(key)
        except ValueError:  # the key expired between add() and incr(): this failure starts a new window
            cache.add(key, 1, timeout=settings.HYPHA_LOGIN_LOCKOUT_SECONDS)


def record_success(username: str) -> None:
    cache.delete(_key("username", username.strip().lower()))


class ThrottledLoginMixin:
    """For an ``AuthenticationForm``: refuse while locked out, count each wrong password."""

    def clean(self):
        username = str(self.data.get("username", ""))
        request = getattr(self, "request", None)
        address = (request.META.get("REMOTE_ADDR") if request is not None else None) or "unknown"
        if locked_out(username, address):
            minutes = math.ceil(settings.HYPHA_LOGIN_LOCKOUT_SECONDS / 60)
            raise forms.ValidationError(
                f"Too many failed logins for this account or from this address; try again in {minutes} "
                f"minute{'s' if minutes != 1 else ''}.",
                code="locked_out",
            )
        try:
            cleaned = super().clean()
        except forms.ValidationError as error:
            if any(getattr(item, "code", None) == "invalid_login" for item in error.error_list):
                record_failure(username, address)
            raise
        record_success(username)
        return cleaned


class ThrottledAuthenticationForm(ThrottledLoginMixin, AuthenticationForm):
    """The dashboard's login form."""


class ThrottledAdminAuthenticationForm(ThrottledLoginMixin, AdminAuthenticationForm):
    """The admin's login form (``admin.site.login_form``)."""
