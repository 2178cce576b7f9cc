"""Reachability in the market: a job's ``parameter_server.reachable`` (``prefer`` by default, ``require``,
``any``) becomes its parameter-server advert's policy; ``require`` asks and takes only workers declared
reachable, ``prefer`` ranks them first (others count 5 % dearer) and does not let an unreachable offer win by
coming first (apps.market.targeting, "Reachability")."""

from __future__ import annotations

import uuid

import pytest

from apps.jobs import services as job_services
from apps.jobs import spec as job_spec
from apps.jobs.exceptions import SpecError
from apps.jobs.models import PARAMETER_SERVER, TRAINER, Job
from apps.leases.models import Lease
from apps.market import services as market
from apps.market import targeting
from apps.market.exceptions import OfferRefused
from apps.market.models import Advertisement, Offer
from tests.apps.conftest import AGGREGATE, CAPACITY, REQUIREMENTS, TRAIN, advert, market_rows, offer_on
from tests.apps.jobs.test_training import SPEC
from worker_daemon import protocol

pytestmark = pytest.mark.django_db


def online(worker, *, reachable: bool | str) -> None:
    """Connect ``worker`` with a hello that declares ``reachable``."""
    job_services.worker_connected(
        worker=worker,
        channel_name=f"test.{worker.name}",
        hello=protocol.Hello(
            protocol_version=protocol.PROTOCOL_VERSION,
            resources=CAPACITY,
            executors=[TRAIN, AGGREGATE],
            price_floor=50.0,
            reachable=reachable,
        ),
        info={},
    )
    worker.refresh_from_db()


def submit(owner, policy: str | None) -> Job:
    """A job whose parameter server's policy is ``policy`` (None: not said, as a job stored before the key)."""
    server = dict(REQUIREMENTS[PARAMETER_SERVER])
    if policy is not None:
        server["reachable"] = policy
    job = job_services.create_job(
        owner=owner, name="tiny-gpt", num_trainers=2, requirements={**REQUIREMENTS, PARAMETER_SERVER: server}
    )
    job_services.allocate(job.pk)
    return Job.objects.get(pk=job.pk)


def offer(worker, ad: Advertisement, price: float) -> protocol.OfferReceived | protocol.OfferDeclined:
    return job_services.offer_made(worker=worker, message=offer_on(ad, price=price))


def outcome(ad: Advertisement) -> dict[str, str]:
    """Worker name → its offer's status on ``ad``."""
    return {offer.worker.name: offer.status for offer in Offer.objects.filter(advertisement=ad)}


def test_a_hello_declares_reachable_and_an_older_one_says_auto(rig_a, rig_b, rig_c):
    online(rig_a, reachable=True)
    online(rig_b, reachable=False)
    online(rig_c, reachable="auto")
    assert (rig_a.reachable, rig_b.reachable, rig_c.reachable) == ("true", "false", "auto")
    older = protocol.parse_daemon_message(
        '{"type": "hello", "protocol_version": 1, "resources": {}, "executors": []}'
    )
    assert older.reachable == "auto"


def test_require_asks_and_takes_only_a_worker_declared_reachable(job_owner, rig_a, rig_b, rig_c):
    online(rig_a, reachable=False)
    online(rig_b, reachable="auto")
    online(rig_c, reachable=True)

    # when
    job = submit(job_owner, "require")

    # then: only rig-c is asked; the trainers' advert asks everyone
    ad = advert(job, PARAMETER_SERVER)
    assert (ad.reachable, ad.targets) == ("require", [str(rig_c.pk)])
    trainers = advert(job, TRAINER)
    assert (trainers.reachable, sorted(trainers.targets)) == (
        "any",
        sorted(str(r.pk) for r in (rig_a, rig_b, rig_c)),
    )

    # when: the others offer anyway
    before = market_rows()
    for rig, declared in ((rig_a, "false"), (rig_b, "auto")):
        with pytest.raises(OfferRefused) as refused:
            offer(rig, ad, 80.0)
        assert refused.value.reason == (
            "the job requires a parameter server that accepts inbound connections; this worker declares "
            f"reachable = {declared} ([parameter_server] reachable, --reachable)"
        )

    # then: nothing was recorded, nobody is held
    assert market_rows() == before

    # when
    reply = offer(rig_c, ad, 80.0)

    # then
    assert isinstance(reply, protocol.OfferReceived)
    assert outcome(ad) == {"rig-c": Offer.Status.ACCEPTED}
    assert Lease.objects.get(job=job, role=PARAMETER_SERVER).worker_id == rig_c.pk


def test_prefer_does_not_let_an_unreachable_offer_win_by_coming_first(job_owner, rig_a, rig_c):
    online(rig_a, reachable="auto")
    online(rig_c, reachable=True)
    job = submit(job_owner, None)  # not said: prefer
    ad = advert(job, PARAMETER_SERVER)
    assert ad.reachable == "prefer"

    # when: the worker not declared reachable offers first, and cheaper (by less than 5 %)
    offer(rig_a, ad, 80.0)

    # then: the advert waits for its window, where a reachable offer may still come
    assert outcome(ad) == {"rig-a": Offer.Status.OPEN}

    # when
    offer(rig_c, ad, 83.0)

    # then: 80 × 1.05 = 84 > 83: the reachable one wins
    assert outcome(ad) == {"rig-a": Offer.Status.DECLINED, "rig-c": Offer.Status.ACCEPTED}


def test_prefer_takes_an_unreachable_worker_more_than_5_percent_cheaper(job_owner, rig_a, rig_c):
    online(rig_a, reachable=False)
    online(rig_c, reachable=True)
    job = submit(job_owner, "prefer")
    ad = advert(job, PARAMETER_SERVER)

    # when
    offer(rig_a, ad, 80.0)
    offer(rig_c, ad, 84.5)

    # then: 80 × 1.05 = 84 < 84.5
    assert outcome(ad) == {"rig-a": Offer.Status.ACCEPTED, "rig-c": Offer.Status.DECLINED}


def test_prefer_with_no_reachable_worker_asked_settles_as_before(job_owner, rig_a, rig_b):
    online(rig_a, reachable="auto")
    online(rig_b, reachable=False)
    job = submit(job_owner, "prefer")
    ad = advert(job, PARAMETER_SERVER)

    # when
    offer(rig_a, ad, 80.0)

    # then: nothing to wait for
    assert outcome(ad) == {"rig-a": Offer.Status.ACCEPTED}


def test_any_ignores_reachability(job_owner, rig_a, rig_c):
    online(rig_a, reachable=False)
    online(rig_c, reachable=True)
    job = submit(job_owner, "any")
    ad = advert(job, PARAMETER_SERVER)

    # when
    offer(rig_a, ad, 83.0)

    # then
    assert outcome(ad) == {"rig-a": Offer.Status.ACCEPTED}


def test_the_window_close_ranks_under_prefer(job_owner, rig_a, rig_b, rig_c):
    online(rig_a, reachable=False)
    online(rig_b, reachable="auto")
    online(rig_c, reachable=True)
    job = submit(job_owner, "prefer")
    ad = advert(job, PARAMETER_SERVER)
    offer(rig_a, ad, 80.0)
    offer(rig_b, ad, 80.0)

    # when: no reachable offer came; the window closes
    market.settle(ad.pk, closing=True)

    # then: at equal ranks "auto" comes before "false"
    assert outcome(ad) == {"rig-a": Offer.Status.DECLINED, "rig-b": Offer.Status.ACCEPTED}


# --- targeting (pure) -----------------------------------------------------------------------------------------


def candidate(name: str, reachable: str) -> targeting.Candidate:
    return targeting.Candidate(
        worker_id=uuid.uuid5(uuid.NAMESPACE_DNS, name),
        capacity=CAPACITY,
        free=CAPACITY,
        executors=frozenset({("aggregate", "parameter-server")}),
        price_floor=50.0,
        strategy="whole",
        reachable=reachable,
    )


@pytest.mark.parametrize(
    ("policy", "expected"),
    [
        ("require", ["yes"]),
        ("prefer", ["yes", "unsaid", "no"]),
    ],
)
def test_an_advert_goes_to_reachable_workers_first_or_only(policy, expected):
    workers = [candidate("no", "false"), candidate("unsaid", "auto"), candidate("yes", "true")]
    names = {worker.worker_id: name for worker, name in zip(workers, ["no", "unsaid", "yes"], strict=True)}

    # when
    chosen = targeting.choose_targets(
        workers,
        resources=CAPACITY,
        executors=[("aggregate", "parameter-server")],
        bid=80.0,
        limit=None,
        reachable=policy,
    )

    # then
    assert [names[worker_id] for worker_id in chosen] == expected


def test_reachability_ranks_only_under_prefer():
    assert targeting.reachability_rank(0.5, "false", "any") == (0.5, 0)
    assert targeting.reachability_rank(0.5, "false", "require") == (0.5, 0)
    assert targeting.reachability_rank(0.5, "true", "prefer") == (0.5, 0)
    assert targeting.reachability_rank(0.5, "auto", "prefer") == (0.525, 1)
    assert targeting.reachability_rank(0.5, "false", "prefer") == (0.525, 2)


# --- the job's spec -----------------------------------------------------------------------------------------


def test_the_spec_carries_the_policy_into_the_requirements():
    parsed = job_spec.parse_json({**SPEC, "parameter_server": {"reachable": "require"}})
    assert job_spec.to_requirements(parsed)[PARAMETER_SERVER]["reachable"] == "require"
    assert job_spec.to_requirements(job_spec.parse_json(SPEC))[PARAMETER_SERVER]["reachable"] == "prefer"
    assert "reachable" not in job_spec.to_requirements(parsed)[TRAINER]


def test_an_unknown_policy_is_refused_with_its_field():
    with pytest.raises(SpecError) as refused:
        job_spec.parse_json({**SPEC, "parameter_server": {"reachable": "always"}})
    assert refused.value.errors == [
        {"field": "parameter_server.reachable", "message": "Input should be 'prefer', 'require' or 'any'"}
    ]
    # a trainer has no such key
    with pytest.raises(SpecError) as refused:
        job_spec.parse_json({**SPEC, "trainer": {"reachable": "require"}})
    assert refused.value.errors == [{"field": "trainer.reachable", "message": "Unknown key."}]


def test_the_jobs_api_takes_and_shows_the_policy(alice):
    # when
    response = alice.client.post(
        "/api/jobs/",
        {"name": "r", "num_trainers": 1, "parameter_server": {"reachable": "require"}},
        format="json",
    )
    refused = alice.client.post("/api/jobs/", {"parameter_server": {"reachable": "maybe"}}, format="json")

    # then
    assert response.status_code == 201
    assert response.json()["parameter_server"]["reachable"] == "require"
    assert Job.objects.get().requirements[PARAMETER_SERVER]["reachable"] == "require"
    assert (refused.status_code, Job.objects.count()) == (400, 1)
