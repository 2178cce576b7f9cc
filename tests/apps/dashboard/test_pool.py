"""The pool on the dashboard: a user who owns no worker sees every worker's public facts on the overview and on
its page, with the leases of their own jobs only; a job's page links the workers that serve it."""

from __future__ import annotations

import re

import pytest
from django.contrib.auth import get_user_model

from apps.workers import services as worker_services
from tests.apps.dashboard.conftest import browser, status, task_of
from tests.apps.workers.test_benchmark import result

pytestmark = pytest.mark.django_db


def worker_row(page: str, worker) -> str:
    """The overview's table row of ``worker``."""
    match = re.search(rf'<tr data-worker="{worker.pk}">(.*?)</tr>', page, re.S)
    assert match, f"no row of {worker.name}"
    return match.group(1)


# --- the overview -----------------------------------------------------------------------------------------


def test_the_overview_counts_the_pools_online_workers_for_a_user_who_owns_none(
    training_job, online_rigs, ada_browser, eve_browser
):
    # given: a fourth worker, registered and never connected
    worker_services.create_worker(name="rig-d")

    # when
    ada_page = ada_browser.get("/").content.decode()
    eve_page = eve_browser.get("/").content.decode()

    # then: both see the pool
    for page in (ada_page, eve_page):
        assert "3 online of 4" in page
        for rig in online_rigs:
            row = worker_row(page, rig)
            assert f'<a href="/workers/{rig.pk}/">{rig.name}</a>' in row
            assert '<span class="badge presence-online">online</span>' in row
            assert '<td class="num">8</td>' in row  # CPU cores its daemon declared
    # Ada sees her job's lease on each rig; Eve does not learn of it
    assert f'trainer · <a href="/jobs/{training_job.pk}/">tiny-gpt</a>' in worker_row(
        ada_page, online_rigs[0]
    )
    for rig in online_rigs:
        assert "tiny-gpt" not in worker_row(eve_page, rig)
        assert "another user" not in worker_row(eve_page, rig)
        assert "idle" not in worker_row(eve_page, rig)  # it is not: it serves Ada


def test_the_overview_shows_no_owner_or_token_state_of_another_users_worker(bob, bobs_worker, eve_browser):
    # given
    bobs_worker.revoke_token()

    # when
    row = worker_row(eve_browser.get("/").content.decode(), bobs_worker)

    # then
    assert "bobs-gpu" in row
    assert "revoked" not in row and "bob<" not in row


# --- a worker's page --------------------------------------------------------------------------------------


def test_a_user_sees_a_pool_workers_page_with_its_public_facts_and_only_their_own_jobs(
    training_job, online_rigs, ada_browser, eve_browser
):
    # given: rig-a trained three steps of 4 samples for Ada's job, and has a benchmark
    rig_a = online_rigs[0]
    rig_a.record_benchmark(result(412.5, device_name="NVIDIA H100 80GB HBM3"))
    for loss in (4.0, 3.9, 3.8):
        status(
            rig_a, task_of(training_job, rig_a), {"status": {"batch_size": 4, "loss": loss, "step_time": 0.1}}
        )

    # when
    ada = ada_browser.get(f"/workers/{rig_a.pk}/")
    eve = eve_browser.get(f"/workers/{rig_a.pk}/")

    # then: both see its public facts
    assert (ada.status_code, eve.status_code) == (200, 200)
    for html in (ada.content.decode(), eve.content.decode()):
        assert "<dt>CPU</dt><dd>8 cores</dd>" in html
        assert "<code>train/diloco-transformer</code>" in html
        assert '<dd id="benchmark"><strong>412.5 samples/s</strong>' in html
        for private in ("<dt>Owner</dt>", "<dt>Last seen</dt>", "<dt>Connected</dt>", "H100", "2.13.0"):
            assert private not in html, private
    # Ada sees her job on it; Eve sees neither it nor that there is one
    ada_html, eve_html = ada.content.decode(), eve.content.decode()
    assert f'<a href="/jobs/{training_job.pk}/">tiny-gpt</a>' in ada_html
    assert "3 steps · 12 samples" in ada_html
    assert "tiny-gpt" not in eve_html and "another user" not in eve_html
    assert "0 steps · 0 samples" in eve_html


def test_another_users_worker_page_names_no_owner(bob, bobs_worker, eve_browser):
    html = eve_browser.get(f"/workers/{bobs_worker.pk}/").content.decode()

    assert "bobs-gpu" in html
    assert ">bob<" not in html and "revoked" not in html


def test_the_owner_and_staff_still_see_the_private_facts(bob, bobs_worker, staff_browser):
    bobs_browser = browser(bob.user)

    for client in (bobs_browser, staff_browser):
        html = client.get(f"/workers/{bobs_worker.pk}/").content.decode()
        assert "<dt>Owner</dt><dd>bob</dd>" in html
        assert "<dt>Last seen</dt>" in html


def test_an_unknown_worker_is_a_404(db):
    user = get_user_model().objects.create_user(username="frank", password=None)

    assert browser(user).get("/workers/00000000-0000-0000-0000-000000000000/").status_code == 404


# --- the job page -----------------------------------------------------------------------------------------


def test_the_job_page_links_the_workers_that_serve_it(training_job, online_rigs, ada_browser):
    # when
    html = ada_browser.get(f"/jobs/{training_job.pk}/").content.decode()

    # then: each lease's and each trainer's worker is a link to its page, and the live script knows the URL
    leases = html[html.index('id="leases-card"') : html.index('id="rounds-card"')]
    trainers = html[html.index('id="trainers-card"') : html.index('id="data-card"')]
    rig_a, rig_b, rig_c = online_rigs
    for rig in online_rigs:
        assert f'<a href="/workers/{rig.pk}/">{rig.name}</a>' in leases
    for rig in (rig_a, rig_b):
        assert f'<a href="/workers/{rig.pk}/">{rig.name}</a>' in trainers
    assert 'data-worker-url="/workers/00000000-0000-0000-0000-000000000000/"' in html
    # and the page it links to opens for the job's owner
    assert ada_browser.get(f"/workers/{rig_c.pk}/").status_code == 200
