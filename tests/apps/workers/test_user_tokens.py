"""Users' REST API tokens: issued once, stored only hashed, accepted as ``Authorization: Token <key>``; the admin
shows their prefix and dates, never a key; old plaintext tokens keep working after the migration hashes them."""

from __future__ import annotations

import importlib
import io
import re

import pytest
from django.contrib.messages import get_messages
from django.core.management import call_command
from django.db import connection
from django.test import Client
from rest_framework.test import APIClient

from apps.workers.models import UserToken, hash_token

ADMIN_LIST = "/admin/workers/usertoken/"
TOKEN_IN_MESSAGE = re.compile(r"\(shown only this once\): (hu_\S+)$")


def issue(username: str, *options: str) -> str:
    output = io.StringIO()
    call_command("create_user_token", username, *options, stdout=output)
    return output.getvalue().strip()


def jobs_status(key: str) -> int:
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Token {key}")
    return client.get("/api/jobs/").status_code


def every_row_of_every_table() -> str:
    """The whole database as text (every table, every column), to look for a secret in it."""
    rows = []
    with connection.cursor() as cursor:
        for table in connection.introspection.table_names(cursor):
            cursor.execute(f"SELECT * FROM {connection.ops.quote_name(table)}")
            rows.append(repr(cursor.fetchall()))
    return "\n".join(rows)


@pytest.fixture
def admin_client(operator) -> Client:
    client = Client()
    client.force_login(operator.user)
    return client


@pytest.mark.django_db
def test_a_created_token_is_nowhere_in_the_database_but_authenticates():
    # when
    key = issue("dave")

    # then: only its hash and prefix are stored
    assert key.startswith("hu_") and len(key) == 46
    assert key not in every_row_of_every_table()
    token = UserToken.objects.get(user__username="dave")
    assert (token.key_hash, token.key_prefix) == (hash_token(key), key[:10])
    # and the key works, a changed one does not
    assert jobs_status(key) == 200
    assert jobs_status(key[:-1] + ("A" if key[-1] != "A" else "B")) == 401
    assert jobs_status("") == 401


@pytest.mark.django_db
def test_each_call_issues_a_new_token_and_the_earlier_ones_keep_working():
    # when
    first, second = issue("dave"), issue("dave", "--staff")

    # then
    assert first != second
    assert (jobs_status(first), jobs_status(second)) == (200, 200)
    assert UserToken.objects.filter(user__username="dave").count() == 2


@pytest.mark.django_db
def test_a_request_records_when_the_token_was_last_used():
    key = issue("dave")
    assert UserToken.objects.get().last_used_at is None

    assert jobs_status(key) == 200

    assert UserToken.objects.get().last_used_at is not None


@pytest.mark.django_db
def test_a_deleted_token_no_longer_authenticates():
    key = issue("dave")
    UserToken.objects.get().delete()

    assert jobs_status(key) == 401


def test_the_admin_has_no_plaintext_token_list(admin_client, alice):
    # when
    response = admin_client.get("/admin/authtoken/tokenproxy/")
    index = admin_client.get("/admin/")

    # then
    assert response.status_code == 404
    assert index.status_code == 200
    assert "authtoken" not in index.content.decode()


def test_the_admin_lists_tokens_by_prefix_and_dates_only(admin_client, alice, bob):
    # when
    listed = admin_client.get(ADMIN_LIST)
    token = UserToken.objects.get(user=alice.user)
    shown = admin_client.get(f"{ADMIN_LIST}{token.pk}/change/")

    # then
    assert (listed.status_code, shown.status_code) == (200, 200)
    for page in (listed.content.decode(), shown.content.decode()):
        assert alice.token not in page and bob.token not in page
        assert token.key_hash not in page
    assert alice.token[:10] in listed.content.decode() and bob.token[:10] in listed.content.decode()


def test_adding_a_token_in_the_admin_shows_it_once(admin_client, alice):
    # when
    response = admin_client.post(f"{ADMIN_LIST}add/", {"user": alice.user.pk}, follow=True)

    # then
    messages = [str(message) for message in get_messages(response.wsgi_request)]
    (key,) = [match.group(1) for match in map(TOKEN_IN_MESSAGE.search, messages) if match]
    assert response.redirect_chain == [(ADMIN_LIST, 302)]
    assert jobs_status(key) == 200
    assert UserToken.objects.filter(user=alice.user).count() == 2
    assert key not in admin_client.get(ADMIN_LIST).content.decode()


@pytest.mark.django_db(transaction=True)
def test_the_migration_hashes_old_plaintext_tokens_and_they_keep_working(django_user_model):
    # given: rest_framework.authtoken's table as an older install has it, with a plaintext key
    user = django_user_model.objects.create_user(username="olduser", password=None)
    legacy_key = "0123456789abcdef0123456789abcdef01234567"
    with connection.cursor() as cursor:
        cursor.execute(
            "CREATE TABLE authtoken_token (key varchar(40) PRIMARY KEY, created timestamp NOT NULL, "
            "user_id integer NOT NULL UNIQUE)"
        )
        cursor.execute(
            "INSERT INTO authtoken_token (key, created, user_id) VALUES (%s, %s, %s)",
            [legacy_key, "2024-01-02 03:04:05", user.pk],
        )
    migration = importlib.import_module("apps.workers.migrations.0004_user_tokens")
    try:
        # when
        from django.apps import apps

        with connection.schema_editor() as schema_editor:
            migration.hash_plaintext_tokens(apps, schema_editor)

        # then: the plaintext is gone, the key still works
        assert legacy_key not in every_row_of_every_table()
        token = UserToken.objects.get(user=user)
        assert (token.key_hash, token.key_prefix, token.created_at.year) == (
            hash_token(legacy_key),
            legacy_key[:10],
            2024,
        )
        assert jobs_status(legacy_key) == 200
    finally:
        with connection.cursor() as cursor:
            cursor.execute("DROP TABLE authtoken_token")
