"""``create_user_token --password-stdin``: a scriptable dashboard login. The password comes from stdin (never
the command line), is checked by Django's password validators, works for a new and an existing user, and the
user then logs in through the dashboard's real login form and sees the dashboard."""

from __future__ import annotations

import io
import re
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from django.contrib.auth import get_user_model
from django.core.management import CommandError, call_command
from django.test import Client

from tests.hypha_site.server_process import free_port, running_server, server_environment

ROOT = Path(__file__).resolve().parents[3]
PASSWORD = "correct horse battery staple"
CSRF_FIELD = re.compile(r'name="csrfmiddlewaretoken" value="([^"]+)"')


def issue(username: str, *options: str, stdin: str) -> str:
    output = io.StringIO()
    call_command("create_user_token", username, *options, stdin=io.StringIO(stdin), stdout=output)
    return output.getvalue().strip()


def log_in(username: str, password: str) -> tuple[Client, object]:
    """POST the dashboard's login form (CSRF checked, as a browser's), following the redirect."""
    client = Client(enforce_csrf_checks=True)
    page = client.get("/login/")
    token = CSRF_FIELD.search(page.content.decode()).group(1)
    response = client.post(
        "/login/",
        {"username": username, "password": password, "csrfmiddlewaretoken": token},
        follow=True,
    )
    return client, response


def sees_the_dashboard(response, username: str) -> bool:
    page = response.content.decode()
    return response.status_code == 200 and "<h1>Overview</h1>" in page and username in page


@pytest.mark.django_db
def test_a_new_user_with_a_password_from_stdin_logs_in_to_the_dashboard():
    # when
    key = issue("erin", "--password-stdin", stdin=PASSWORD + "\n")
    _, response = log_in("erin", PASSWORD)

    # then: the login lands on the overview, and the token works too
    assert key.startswith("hu_")
    assert response.redirect_chain == [("/", 302)]
    assert sees_the_dashboard(response, "erin")


@pytest.mark.django_db
def test_an_existing_user_gets_a_password_and_keeps_her_tokens():
    # given: a user made by the token command alone cannot log in
    first = issue("erin", stdin="")
    _, refused = log_in("erin", PASSWORD)
    assert "<h1>Overview</h1>" not in refused.content.decode()

    # when
    second = issue("erin", "--password-stdin", "--staff", stdin=PASSWORD + "\r\n")

    # then
    _, response = log_in("erin", PASSWORD)
    assert sees_the_dashboard(response, "erin") and "(staff)" in response.content.decode()
    assert first != second
    assert get_user_model().objects.get(username="erin").api_tokens.count() == 2


@pytest.mark.django_db
def test_only_the_first_line_is_the_password_and_spaces_in_it_are_kept():
    issue("erin", "--password-stdin", stdin=f" {PASSWORD} \nsecond line\n")

    assert sees_the_dashboard(log_in("erin", f" {PASSWORD} ")[1], "erin")
    assert not sees_the_dashboard(log_in("erin", PASSWORD)[1], "erin")


@pytest.mark.django_db
@pytest.mark.parametrize("stdin", ["", "\n", "\r\n"])
def test_an_empty_password_is_refused_and_no_user_is_made(stdin):
    with pytest.raises(CommandError, match="no password on stdin"):
        issue("erin", "--password-stdin", stdin=stdin)

    assert not get_user_model().objects.filter(username="erin").exists()


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("password", "message"),
    [
        ("short", "This password is too short. It must contain at least 8 characters."),
        ("password123", "This password is too common."),
    ],
)
def test_the_password_validators_refuse_weak_passwords_with_their_messages(password, message):
    # given: an existing user whose password must stay as it was
    issue("frank", "--password-stdin", stdin=PASSWORD + "\n")

    # when
    with pytest.raises(CommandError) as refused:
        issue("frank", "--password-stdin", stdin=password + "\n")
    with pytest.raises(CommandError):
        issue("erin", "--password-stdin", stdin=password + "\n")

    # then: the validators' message; no user made, no password changed, no token issued, nothing echoed
    assert message in str(refused.value) and password not in str(refused.value).replace(message, "")
    assert not get_user_model().objects.filter(username="erin").exists()
    assert get_user_model().objects.get(username="frank").api_tokens.count() == 1
    assert sees_the_dashboard(log_in("frank", PASSWORD)[1], "frank")


def test_the_real_command_reads_the_password_from_stdin_and_the_real_server_logs_the_user_in(tmp_path):
    """From outside: ``python manage.py create_user_token alice --password-stdin`` with the password piped in,
    then the dashboard's login form of a real ``hypha-server`` over HTTP."""
    # given: the real server on a fresh data dir
    data_dir = tmp_path / "data"
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with running_server(["--port", str(port)], port=port, environment=server_environment(data_dir)):
        # when: the password goes in on stdin only
        issued = subprocess.run(
            [sys.executable, "manage.py", "create_user_token", "alice", "--password-stdin"],
            cwd=ROOT,
            env=server_environment(data_dir),
            input=PASSWORD + "\n",
            capture_output=True,
            text=True,
            timeout=60,
        )
        refused = subprocess.run(
            [sys.executable, "manage.py", "create_user_token", "bob", "--password-stdin"],
            cwd=ROOT,
            env=server_environment(data_dir),
            input="\n",
            capture_output=True,
            text=True,
            timeout=60,
        )
        with httpx.Client(base_url=url, timeout=10, follow_redirects=True) as browser:
            form = browser.get("/login/")
            csrf = CSRF_FIELD.search(form.text).group(1)
            response = browser.post(
                "/login/", data={"username": "alice", "password": PASSWORD, "csrfmiddlewaretoken": csrf}
            )
            listed = httpx.get(
                f"{url}/api/jobs/", headers={"Authorization": f"Token {issued.stdout.strip()}"}, timeout=10
            )

    # then: the token is printed (and works), the password is nowhere in the output, and the login shows the
    # dashboard; an empty password is a clear error
    assert issued.returncode == 0, issued.stderr
    assert PASSWORD not in issued.stdout + issued.stderr
    assert listed.status_code == 200
    assert response.status_code == 200 and str(response.url) == f"{url}/"
    assert "<h1>Overview</h1>" in response.text and "alice" in response.text
    assert refused.returncode == 1 and "no password on stdin" in refused.stderr
