"""Settings come from the environment and refuse bad values at start, naming the variable.

Each case starts a fresh Python process: settings are read once per process.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from worker_daemon.link import MAX_QUEUED

ROOT = Path(__file__).resolve().parents[2]
SECRET = "s" * 50
#: Everything the settings read; each case starts from none of them (the embedded default).
SETTINGS_VARIABLES = (
    "DATABASE_URL",
    "REDIS_URL",
    "SECRET_KEY",
    "SECRET_KEY_FILE",
    "DEBUG",
    "ALLOWED_HOSTS",
    "CSRF_TRUSTED_ORIGINS",
    "LOG_LEVEL",
    "SECURE_PROXY_SSL_HEADER",
    "SESSION_COOKIE_SECURE",
    "CSRF_COOKIE_SECURE",
)


def run(arguments: list[str], tmp_path: Path, **variables: str) -> subprocess.CompletedProcess:
    environment = {
        name: value
        for name, value in os.environ.items()
        if name not in SETTINGS_VARIABLES and not name.startswith("HYPHA_")
    }
    environment.update(
        DJANGO_SETTINGS_MODULE="hypha_site.settings", HYPHA_DATA_DIR=str(tmp_path), **variables
    )
    return subprocess.run(
        [sys.executable, *arguments], cwd=ROOT, env=environment, capture_output=True, text=True, timeout=60
    )


def django_setup(tmp_path: Path, **variables: str) -> subprocess.CompletedProcess:
    return run(["-c", "import django; django.setup()"], tmp_path, **variables)


BAD_VALUES = {
    "database scheme": (
        {"DATABASE_URL": "mysql://x", "SECRET_KEY": SECRET},
        "DATABASE_URL scheme 'mysql' is not supported",
    ),
    "redis scheme": (
        {"REDIS_URL": "http://x", "SECRET_KEY": SECRET},
        "REDIS_URL scheme 'http' is not supported",
    ),
    "lease ttl not a number": ({"HYPHA_LEASE_TTL": "abc"}, "HYPHA_LEASE_TTL='abc' is not a number"),
    "lease ttl zero": ({"HYPHA_LEASE_TTL": "0"}, "HYPHA_LEASE_TTL='0' must be between 1.0 and 3600.0"),
    "debug not a boolean": ({"DEBUG": "maybe"}, "DEBUG='maybe' is not a boolean"),
    "secret key too short": ({"SECRET_KEY": "short"}, "SECRET_KEY must be at least 32 characters long"),
    "database without a secret key": (
        {"DATABASE_URL": "postgresql://postgres@127.0.0.1:5432/hypha"},
        "SECRET_KEY (or SECRET_KEY_FILE) must be set when DATABASE_URL or REDIS_URL is set",
    ),
    "offer ttl not longer than the window": (
        {"HYPHA_OFFER_TTL": "1.0", "HYPHA_OFFER_WINDOW": "1.0"},
        "HYPHA_OFFER_TTL (1.0) must be longer than HYPHA_OFFER_WINDOW (1.0)",
    ),
    "frame limit not an integer": (
        {"HYPHA_WS_MAX_MESSAGE_BYTES": "1.5"},
        "HYPHA_WS_MAX_MESSAGE_BYTES='1.5' is not an integer",
    ),
    "rate limit zero": ({"HYPHA_WS_RATE": "0"}, "HYPHA_WS_RATE='0' must be between 0.1 and 1000000.0"),
    "burst zero": ({"HYPHA_WS_BURST": "0"}, "HYPHA_WS_BURST='0' must be between 1 and 10000000"),
    "flood refusals not an integer": (
        {"HYPHA_WS_FLOOD_REFUSALS": "many"},
        "HYPHA_WS_FLOOD_REFUSALS='many' is not an integer",
    ),
    "backlog zero": ({"HYPHA_WS_BACKLOG": "0"}, "HYPHA_WS_BACKLOG='0' must be between 1 and 10000000"),
    "byte burst below the largest frame": (
        {"HYPHA_WS_BYTES_BURST": "100000", "HYPHA_WS_MAX_MESSAGE_BYTES": "200000"},
        "HYPHA_WS_BYTES_BURST (100000) must be at least HYPHA_WS_MAX_MESSAGE_BYTES (200000)",
    ),
    "backlog bytes below the largest frame": (
        {"HYPHA_WS_BACKLOG_BYTES": "100000", "HYPHA_WS_MAX_MESSAGE_BYTES": "200000"},
        "HYPHA_WS_BACKLOG_BYTES (100000) must be at least HYPHA_WS_MAX_MESSAGE_BYTES (200000)",
    ),
    "proxy header not a header name": (
        {"SECURE_PROXY_SSL_HEADER": "X-Forwarded-Proto: https"},
        "SECURE_PROXY_SSL_HEADER='X-Forwarded-Proto: https' is not an HTTP header name",
    ),
    "secure cookies not a boolean": (
        {"SESSION_COOKIE_SECURE": "sure"},
        "SESSION_COOKIE_SECURE='sure' is not a boolean",
    ),
}


@pytest.mark.parametrize("case", list(BAD_VALUES))
def test_a_bad_value_stops_django_naming_the_variable(tmp_path, case):
    # given
    variables, message = BAD_VALUES[case]

    # when
    result = django_setup(tmp_path, **variables)

    # then
    assert result.returncode != 0
    assert "django.core.exceptions.ImproperlyConfigured: " in result.stderr
    assert message in result.stderr


def test_hypha_server_exits_2_with_a_configuration_error_line(tmp_path):
    # when
    result = run(["-m", "hypha_site.server"], tmp_path, HYPHA_LEASE_TTL="abc")

    # then
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "hypha-server: configuration error: HYPHA_LEASE_TTL='abc' is not a number"
    ]
    assert result.stdout == ""


def test_the_embedded_defaults_pass_the_system_checks(tmp_path):
    # when
    result = run(["manage.py", "check"], tmp_path)

    # then
    assert result.returncode == 0, result.stderr
    assert "System check identified no issues" in result.stdout
    assert (tmp_path / "secret_key").stat().st_mode & 0o777 == 0o600


def test_the_redis_channel_layer_outwaits_its_blocking_receive(tmp_path):
    """redis-py 8 times socket reads out after 5 s by default, which is channels_redis's blocking receive:
    without a longer socket timeout every idle websocket consumer dies within 5 s."""
    # given
    script = (
        "import django; django.setup()\n"
        "from channels.layers import get_channel_layer\n"
        "from channels_redis.utils import create_pool\n"
        "layer = get_channel_layer()\n"
        "print(create_pool(layer.hosts[0]).make_connection().socket_timeout, layer.brpop_timeout)\n"
    )

    # when: settings only; no Redis is contacted
    result = run(["-c", script], tmp_path, REDIS_URL="redis://127.0.0.1:6379/14", SECRET_KEY=SECRET)

    # then
    assert result.returncode == 0, result.stderr
    socket_timeout, receive_timeout = (float(value) for value in result.stdout.split())
    assert socket_timeout > receive_timeout


PRINT_SECURITY_SETTINGS = (
    "import django; django.setup()\n"
    "from django.conf import settings as s\n"
    "print(repr((s.SECURE_PROXY_SSL_HEADER, s.SESSION_COOKIE_SECURE, s.CSRF_COOKIE_SECURE,"
    " s.ALLOWED_HOSTS, s.CSRF_TRUSTED_ORIGINS, s.HYPHA_WS_RATE, s.HYPHA_WS_BURST, s.HYPHA_WS_FLOOD_REFUSALS)))\n"
)


def test_the_defaults_trust_no_proxy_and_allow_plain_http_cookies(tmp_path):
    # when
    result = run(["-c", PRINT_SECURITY_SETTINGS], tmp_path)

    # then
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == repr(
        (
            None,
            False,
            False,
            ["localhost", "127.0.0.1", "[::1]", "testserver"],
            ["http://localhost:8000", "http://127.0.0.1:8000"],
            200.0,
            MAX_QUEUED,  # a reconnecting daemon's whole outbox fits in the burst
            1000,
        )
    )


def test_settings_behind_a_tls_proxy(tmp_path):
    # when: what docs/deploy.md sets behind nginx
    result = run(
        ["-c", PRINT_SECURITY_SETTINGS],
        tmp_path,
        SECURE_PROXY_SSL_HEADER="X-Forwarded-Proto",
        SESSION_COOKIE_SECURE="true",
        CSRF_COOKIE_SECURE="1",
        ALLOWED_HOSTS="hypha.example.org",
        CSRF_TRUSTED_ORIGINS="https://hypha.example.org",
        HYPHA_WS_RATE="50.5",
        HYPHA_WS_BURST="200",
        HYPHA_WS_FLOOD_REFUSALS="10",
    )

    # then
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == repr(
        (
            ("HTTP_X_FORWARDED_PROTO", "https"),
            True,
            True,
            ["hypha.example.org"],
            ["https://hypha.example.org"],
            50.5,
            200,
            10,
        )
    )
