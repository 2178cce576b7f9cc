"""The market API (read-only): who sees which advertisements and offers, and validated filters."""

from __future__ import annotations

import math

import pytest

from apps.market.models import Advertisement, Offer
from tests.apps.api_helpers import iso


def ids(response) -> set[str]:
    return {item["id"] for item in response.json()["results"]}


# --- advertisements -------------------------------------------------------------------------------------


def test_the_owner_sees_the_adverts_of_her_job_with_their_private_maximum(alice, leased_job):
    # given
    trainer_ad = Advertisement.objects.get(job=leased_job, role="trainer")

    # when
    response = alice.client.get(f"/api/advertisements/{trainer_ad.pk}/")

    # then
    assert response.status_code == 200
    assert response.json() == {
        "id": str(trainer_ad.pk),
        "job": str(leased_job.pk),
        "role": "trainer",
        "status": "filled",
        "wanted": 0,
        "attempt": 0,
        "bid": 80.0,
        "max_price": 100.0,
        "resources": {"cpu": 1.0, "memory": 4.0, "storage": 0.0, "gpu": 8.0},
        "executors": [{"class": "train", "name": "diloco-transformer"}],
        "window_closes_at": iso(trainer_ad.window_closes_at),
        "next_attempt_at": None,
        "created_at": iso(trainer_ad.created_at),
        "closed_at": iso(trainer_ad.closed_at),
    }
    assert ids(alice.client.get("/api/advertisements/")) == {
        str(ad.pk) for ad in Advertisement.objects.filter(job=leased_job)
    }


def test_others_do_not_see_a_jobs_adverts_and_staff_see_all(bob, carol, operator, leased_job):
    # given
    trainer_ad = Advertisement.objects.get(job=leased_job, role="trainer")

    # when
    bobs = bob.client.get("/api/advertisements/")
    carols = carol.client.get("/api/advertisements/")
    bobs_detail = bob.client.get(f"/api/advertisements/{trainer_ad.pk}/")
    operators = operator.client.get("/api/advertisements/")

    # then
    assert (bobs.json()["count"], carols.json()["count"], bobs_detail.status_code) == (0, 0, 404)
    assert operators.json()["count"] == 2


def test_adverts_filter_by_job_and_status(alice, alices_job):
    # given
    parameter_server_ad = Advertisement.objects.get(job=alices_job, role="parameter_server")
    Advertisement.objects.filter(job=alices_job, role="trainer").update(status=Advertisement.Status.FILLED)

    # when
    open_ads = alice.client.get("/api/advertisements/", {"status": "open", "job": str(alices_job.pk)})
    other_job = alice.client.get("/api/advertisements/", {"job": "00000000-0000-0000-0000-000000000000"})
    blank = alice.client.get("/api/advertisements/", {"status": ""})

    # then
    assert ids(open_ads) == {str(parameter_server_ad.pk)}
    assert other_job.json()["count"] == 0
    assert blank.json()["count"] == 2


@pytest.mark.parametrize(
    ("query", "errors"),
    [
        ({"job": "nope"}, {"job": ["Must be a valid UUID."]}),
        ({"status": "bogus"}, {"status": ['"bogus" is not a valid choice.']}),
        (
            {"job": "1", "status": "closed"},
            {"job": ["Must be a valid UUID."], "status": ['"closed" is not a valid choice.']},
        ),
    ],
)
def test_a_bad_advert_filter_is_a_400(alice, alices_job, query, errors):
    # when
    response = alice.client.get("/api/advertisements/", query)

    # then
    assert response.status_code == 400
    assert response.json() == errors


# --- offers ---------------------------------------------------------------------------------------------


def test_an_offer_is_seen_by_the_jobs_owner_and_by_the_workers_owner(alice, bob, carol, operator, leased_job):
    # given
    offer = Offer.objects.get()

    # when
    seen = {
        persona.user.username: persona.client.get("/api/offers/").json()["count"]
        for persona in (alice, bob, carol, operator)
    }
    detail = bob.client.get(f"/api/offers/{offer.pk}/")

    # then
    assert seen == {"alice": 1, "bob": 1, "carol": 0, "operator": 1}
    assert carol.client.get(f"/api/offers/{offer.pk}/").status_code == 404
    assert detail.status_code == 200
    assert detail.json() == {
        "id": str(offer.pk),
        "advertisement": str(offer.advertisement_id),
        "job": str(leased_job.pk),
        "worker": "bobs-gpu",
        "attempt": 0,
        "price": 90.0,
        "resources": {"cpu": 1.0, "memory": 4.0, "storage": 0.0, "gpu": 8.0},
        "score": offer.score,
        "status": "accepted",
        "reason": "",
        "lease": str(offer.lease_id),
        "expires_at": iso(offer.expires_at),
        "created_at": iso(offer.created_at),
        "decided_at": iso(offer.decided_at),
    }
    assert offer.score == pytest.approx(90.0 / (25 * 8 + 1 + 0.1 * 4))


def test_an_offer_of_no_capacity_has_a_null_score(alice, leased_job):
    # given: an offer of no capacity scores infinity (it never wins); JSON has no infinity
    offer = Offer.objects.get()
    Offer.objects.filter(pk=offer.pk).update(score=math.inf)

    # when
    response = alice.client.get(f"/api/offers/{offer.pk}/")

    # then
    assert response.status_code == 200
    assert response.json()["score"] is None


def test_offers_filter_by_advertisement_job_worker_and_status(alice, bobs_worker, leased_job):
    # given
    offer = Offer.objects.get()
    matching = [
        {"advertisement": str(offer.advertisement_id)},
        {"job": str(leased_job.pk)},
        {"worker": str(bobs_worker.pk)},
        {"status": "accepted"},
    ]
    missing = [
        {"advertisement": str(Advertisement.objects.get(role="parameter_server").pk)},
        {"worker": "00000000-0000-0000-0000-000000000000"},
        {"status": "declined"},
    ]

    # when / then
    for query in matching:
        assert ids(alice.client.get("/api/offers/", query)) == {str(offer.pk)}, query
    for query in missing:
        assert alice.client.get("/api/offers/", query).json()["count"] == 0, query


def test_a_bad_offer_filter_is_a_400(alice, leased_job):
    # when
    response = alice.client.get("/api/offers/", {"worker": "bobs-gpu", "advertisement": "x", "status": "won"})

    # then
    assert response.status_code == 400
    assert response.json() == {
        "advertisement": ["Must be a valid UUID."],
        "worker": ["Must be a valid UUID."],
        "status": ['"won" is not a valid choice.'],
    }


def test_anonymous_callers_see_no_market(anonymous):
    # when
    responses = [anonymous.get("/api/advertisements/"), anonymous.get("/api/offers/")]

    # then
    assert [response.status_code for response in responses] == [401, 401]
