"""The operator admin: every model's pages render; tokens are issued, revoked and rotated through the services;
state that only the services change is read-only."""

from __future__ import annotations

import re

import pytest
from django.contrib.messages import get_messages
from django.test import Client

from apps.jobs.models import Job, JobEvent
from apps.leases.models import Lease, LeaseEvent
from apps.market.models import Advertisement, Offer
from apps.workers import services
from apps.workers.exceptions import AuthenticationFailed
from apps.workers.models import Worker
from worker_daemon.protocol import CloseCode

MODELS = [Worker, Job, JobEvent, Advertisement, Offer, Lease, LeaseEvent]
TOKEN_IN_MESSAGE = re.compile(r"\(shown only this once\): (hw_\S+)$")


@pytest.fixture
def admin_client(operator) -> Client:
    client = Client()
    client.force_login(operator.user)
    return client


def messages_of(response) -> list[str]:
    return [str(message) for message in get_messages(response.wsgi_request)]


def url(model, page: str = "changelist", *args) -> str:
    return f"/admin/{model._meta.app_label}/{model._meta.model_name}/" + {
        "changelist": "",
        "add": "add/",
        "change": "{}/change/",
    }[page].format(*args)


@pytest.mark.parametrize("model", MODELS, ids=lambda model: model.__name__)
def test_every_models_list_and_page_render(admin_client, leased_job, model):
    # given
    instance = model.objects.first()

    # when
    listed = admin_client.get(url(model))
    shown = admin_client.get(url(model, "change", instance.pk))

    # then
    assert (listed.status_code, shown.status_code) == (200, 200)


def test_the_lists_search_and_filter(admin_client, leased_job):
    # when
    responses = [
        admin_client.get(url(Worker), {"q": "bobs"}),
        admin_client.get(url(Job), {"status__exact": "allocating", "q": "demo"}),
        admin_client.get(url(Lease), {"q": str(Lease.objects.get().pk)}),
        admin_client.get(url(Offer), {"status__exact": "accepted"}),
    ]

    # then
    assert [response.status_code for response in responses] == [200, 200, 200, 200]
    assert [response.context["cl"].result_count for response in responses] == [1, 1, 1, 1]


def test_adding_a_worker_shows_its_token_once(admin_client, bob):
    # when
    response = admin_client.post(url(Worker, "add"), {"name": "admin-box", "owner": bob.user.pk}, follow=True)

    # then
    assert response.status_code == 200
    worker = Worker.objects.get()
    (token,) = [m.group(1) for m in map(TOKEN_IN_MESSAGE.search, messages_of(response)) if m]
    assert services.authenticate(token) == worker
    assert (worker.name, worker.owner, worker.token_hint) == ("admin-box", bob.user, token[:10])
    assert response.redirect_chain == [(url(Worker), 302)]


def test_adding_a_worker_with_a_taken_name_shows_the_error_and_creates_nothing(admin_client, bobs_worker):
    # when
    response = admin_client.post(url(Worker, "add"), {"name": "bobs-gpu"})

    # then
    assert response.status_code == 200
    assert response.context["adminform"].form.errors == {"name": ["Worker with this Name already exists."]}
    assert Worker.objects.count() == 1


def test_the_revoke_action_refuses_the_token_and_ends_the_leases(admin_client, leased_job):
    # given
    worker = Worker.objects.get(name="bobs-gpu")
    token = worker.rotate_token()

    # when
    response = admin_client.post(
        url(Worker), {"action": "revoke_tokens", "_selected_action": [worker.pk]}, follow=True
    )

    # then
    assert response.status_code == 200
    assert messages_of(response) == ["Revoked the token of 1 worker(s): bobs-gpu."]
    with pytest.raises(AuthenticationFailed) as refused:
        services.authenticate(token)
    assert refused.value.code == CloseCode.TOKEN_REVOKED
    assert Lease.objects.get().status == Lease.Status.RELEASED


def test_the_rotate_action_shows_new_tokens(admin_client, bobs_worker):
    # given
    old_token = bobs_worker.rotate_token()

    # when
    response = admin_client.post(
        url(Worker), {"action": "rotate_tokens", "_selected_action": [bobs_worker.pk]}, follow=True
    )

    # then
    (message,) = messages_of(response)
    new_token = TOKEN_IN_MESSAGE.search(message).group(1)
    assert message.startswith("New token of worker bobs-gpu")
    assert services.authenticate(new_token) == bobs_worker
    with pytest.raises(AuthenticationFailed):
        services.authenticate(old_token)


def test_the_cancel_action_cancels_through_the_service_and_skips_ended_jobs(admin_client, leased_job, alice):
    # given
    ended = Job.objects.create(
        owner=alice.user, name="old", requirements=leased_job.requirements, status=Job.Status.COMPLETED
    )

    # when
    response = admin_client.post(
        url(Job), {"action": "cancel_jobs", "_selected_action": [leased_job.pk, ended.pk]}, follow=True
    )

    # then
    assert sorted(messages_of(response)) == [
        "Already ended, not cancelled: old (completed).",
        "Cancelled 1 job(s): demo.",
    ]
    leased_job.refresh_from_db()
    assert (leased_job.status, leased_job.status_reason) == (
        "cancelled",
        "CANCELLED: cancelled by operator in the admin",
    )
    assert Lease.objects.get().status == Lease.Status.RELEASED
    ended.refresh_from_db()
    assert ended.status == Job.Status.COMPLETED


def test_state_is_read_only_in_the_admin(admin_client, leased_job):
    # given
    lease = Lease.objects.get()
    before = Lease.objects.values().get()

    # when
    changed = admin_client.post(url(Lease, "change", lease.pk), {"status": "expired"})
    added_job = admin_client.get(url(Job, "add"))
    added_lease = admin_client.get(url(Lease, "add"))
    deleted = admin_client.post(f"/admin/leases/lease/{lease.pk}/delete/", {"post": "yes"})
    job_page = admin_client.get(url(Job, "change", leased_job.pk))

    # then
    assert (changed.status_code, added_job.status_code, added_lease.status_code, deleted.status_code) == (
        403,
        403,
        403,
        403,
    )
    assert Lease.objects.values().get() == before
    form_fields = set(job_page.context["adminform"].form.fields)
    assert form_fields == {"name"}


def test_the_job_status_cannot_be_changed_in_the_admin(admin_client, leased_job):
    # given: what the browser posts, plus a status it should not be able to set
    events = leased_job.events.count()
    form = {
        "name": "renamed",
        "status": "completed",
        "events-TOTAL_FORMS": events,
        "events-INITIAL_FORMS": events,
    }

    # when
    response = admin_client.post(url(Job, "change", leased_job.pk), form)

    # then
    assert response.status_code == 302
    leased_job.refresh_from_db()
    assert (leased_job.name, leased_job.status) == ("renamed", "allocating")


def test_only_staff_reach_the_admin(alice, leased_job):
    # given
    client = Client()
    client.force_login(alice.user)

    # when
    response = client.get(url(Worker))

    # then
    assert response.status_code == 302
    assert response["Location"].startswith("/admin/login/")
