"""Password guessing on the dashboard's and the admin's login forms is throttled (issue 12, finding 10): after
``HYPHA_LOGIN_FAILURE_LIMIT`` wrong passwords for one username (or ``HYPHA_LOGIN_ADDRESS_FAILURE_LIMIT`` from
one client address) within ``HYPHA_LOGIN_LOCKOUT_SECONDS``, every attempt is refused with a clear message,
the right password included, until the window ends.

Each test uses its own usernames and client address, so the failures counted in the cache (shared with other
tests, and in services mode kept in Redis) never meet."""

from __future__ import annotations

import uuid

import pytest
from django.contrib.auth import get_user_model
from django.test import Client

PASSWORD = "correct horse battery staple"
LOCKED = "Too many failed logins"


@pytest.fixture(autouse=True)
def _fast_hashes(settings):
    # PBKDF2 costs ~0.3 s a guess; the throttle is what is tested here, not the hash.
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]
    settings.HYPHA_LOGIN_FAILURE_LIMIT = 5
    settings.HYPHA_LOGIN_ADDRESS_FAILURE_LIMIT = 20
    settings.HYPHA_LOGIN_LOCKOUT_SECONDS = 900


def make_user(*, staff: bool = False):
    name = f"user-{uuid.uuid4().hex[:10]}"
    return get_user_model().objects.create_user(
        username=name, password=PASSWORD, is_staff=staff, is_superuser=staff
    )


def browser() -> Client:
    """A client from an address of its own (10.x.y.z, unused by other tests)."""
    octets = uuid.uuid4().bytes[:3]
    return Client(REMOTE_ADDR="10." + ".".join(str(octet) for octet in octets))


def logged_in(client: Client) -> bool:
    return "_auth_user_id" in client.session


@pytest.mark.parametrize("login_url", ["/login/", "/admin/login/"])
@pytest.mark.django_db
def test_thirty_wrong_passwords_then_the_right_one_is_refused(login_url):
    # given
    user = make_user(staff=True)
    client = browser()

    # when: 30 guesses, then the right password
    guesses = [
        client.post(login_url, {"username": user.username, "password": f"guess-{n}"}) for n in range(30)
    ]
    right = client.post(login_url, {"username": user.username, "password": PASSWORD})

    # then: the first five were plain wrong passwords; from the limit on, and for the right one, locked out
    assert [response.status_code for response in guesses] == [200] * 30
    assert [LOCKED in response.content.decode() for response in guesses] == [False] * 5 + [True] * 25
    assert right.status_code == 200
    assert LOCKED in right.content.decode()
    assert "try again in 15 minutes" in right.content.decode()
    assert not logged_in(client)


@pytest.mark.django_db
def test_the_lockout_holds_from_another_address_and_spares_other_users():
    # given: one user locked out from one address
    victim, bystander = make_user(), make_user()
    attacker = browser()
    for n in range(5):
        attacker.post("/login/", {"username": victim.username, "password": f"guess-{n}"})

    # when: the victim (another address) logs in, and a bystander logs in from the attacker's address
    victim_browser = browser()
    victims = victim_browser.post("/login/", {"username": victim.username, "password": PASSWORD})
    bystanders = attacker.post("/login/", {"username": bystander.username, "password": PASSWORD})

    # then
    assert LOCKED in victims.content.decode() and not logged_in(victim_browser)
    assert bystanders.status_code == 302 and logged_in(attacker)


@pytest.mark.django_db
def test_one_address_guessing_many_usernames_is_locked_out():
    # given: 20 wrong guesses, each for a different (unknown) username, from one address
    client = browser()
    for n in range(20):
        client.post("/login/", {"username": f"nobody-{uuid.uuid4().hex[:8]}-{n}", "password": "x"})
    user = make_user()

    # when
    response = client.post("/login/", {"username": user.username, "password": PASSWORD})

    # then
    assert LOCKED in response.content.decode()
    assert not logged_in(client)


@pytest.mark.django_db
def test_a_success_before_the_limit_forgets_the_usernames_failures():
    # given: four wrong passwords, then the right one
    user = make_user()
    client = browser()
    for n in range(4):
        client.post("/login/", {"username": user.username, "password": f"guess-{n}"})
    assert client.post("/login/", {"username": user.username, "password": PASSWORD}).status_code == 302
    client.post("/logout/")

    # when: four more wrong ones, then the right one again
    for n in range(4):
        client.post("/login/", {"username": user.username, "password": f"again-{n}"})
    response = client.post("/login/", {"username": user.username, "password": PASSWORD})

    # then
    assert response.status_code == 302 and logged_in(client)
