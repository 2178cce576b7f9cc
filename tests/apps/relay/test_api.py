"""The relay API from outside (DRF's APIClient; the local store's part and object URLs through Django's test
client): uploads, resumption, completion checks, reads, replies, wants, deletion, and every refusal —
each refusal leaving no row and no file behind."""

from __future__ import annotations

import time
from datetime import timedelta

import pytest
from django.utils import timezone
from rest_framework.test import APIClient

from apps.jobs.models import Job, Task
from apps.jobs.training.tokens import transfer_key
from apps.relay import services
from apps.relay.models import RelayObject, RelayUsage, RelayWant
from tests.apps.relay.conftest import LOCAL_PART_SIZE
from tests.apps.relay.world import digest, relay_files
from worker_daemon import protocol

pytestmark = pytest.mark.django_db

#: 150 KiB: three parts of 64, 64 and 22 KiB.
DATA = bytes(range(256)) * 600


def client(token: str | None) -> APIClient:
    api = APIClient()
    if token is not None:
        api.credentials(HTTP_AUTHORIZATION=f"Bearer {token}")
    return api


def base(world) -> str:
    return f"/api/relay/jobs/{world.job.pk}/"


def begin(world, token, key, data=DATA, **extra):
    body = {"key": key, "size": len(data), "sha256": digest(data), **extra}
    return client(token).post(base(world) + "uploads/", body, format="json")


def put_part(url: str, data: bytes):
    return APIClient().put(url, data=data, content_type="application/octet-stream")


def upload(world, token, key, data=DATA, metadata=None) -> dict:
    """Begin, PUT every part, complete: the object."""
    plan = begin(world, token, key, data, metadata=metadata or {}).json()
    for part in plan["parts"]:
        if not part["done"]:
            chunk = data[part["offset"] : part["offset"] + part["size"]]
            assert put_part(part["url"], chunk).status_code == 200
    answer = client(token).post(base(world) + "uploads/complete/", {"key": key}, format="json")
    assert answer.status_code == 200, answer.json()
    return answer.json()


def fetch(url: str, **headers) -> tuple[int, bytes]:
    response = APIClient().get(url, **headers)
    body = b"".join(response.streaming_content) if response.streaming else response.content
    return response.status_code, body


def nothing_stored(settings) -> bool:
    return not RelayObject.objects.exists() and relay_files(settings.HYPHA_DATA_DIR) == []


# --- the round trip -----------------------------------------------------------------------------------------


def test_an_update_goes_up_is_read_replied_to_and_deleted(
    world, settings, django_capture_on_commit_callbacks
):
    trainer, server = world.trainers[0], world.server
    key = f"updates/1/{trainer.peer}"

    # when: the trainer begins the upload
    answer = begin(world, trainer.token, key, metadata={"samples": 96, "tags": ["a", "b"]})

    # then: a plan of three parts, none done
    assert answer.status_code == 200
    plan = answer.json()
    assert {name: plan[name] for name in ("key", "size", "sha256", "part_size", "expires_in", "status")} == {
        "key": key,
        "size": 153600,
        "sha256": digest(DATA),
        "part_size": LOCAL_PART_SIZE,
        "expires_in": 900,
        "status": "pending",
    }
    assert [(p["number"], p["offset"], p["size"], p["done"]) for p in plan["parts"]] == [
        (1, 0, 65536, False),
        (2, 65536, 65536, False),
        (3, 131072, 22528, False),
    ]
    assert all(p["url"].startswith(f"http://testserver/relay/{world.job.pk}/") for p in plan["parts"])

    # when: its parts are PUT and it is completed
    for part in plan["parts"]:
        response = put_part(part["url"], DATA[part["offset"] : part["offset"] + part["size"]])
        assert (response.status_code, response.json()) == (
            200,
            {"number": part["number"], "size": part["size"]},
        )
    completed = client(trainer.token).post(base(world) + "uploads/complete/", {"key": key}, format="json")

    # then: the object, without a reply yet
    assert completed.status_code == 200
    obj = completed.json()
    assert {
        name: obj[name] for name in ("key", "size", "sha256", "metadata", "writer", "expires_in", "reply")
    } == {
        "key": key,
        "size": 153600,
        "sha256": digest(DATA),
        "metadata": {"samples": 96, "tags": ["a", "b"]},
        "writer": trainer.peer,
        "expires_in": 900,
        "reply": None,
    }

    # when: the parameter server lists the updates and downloads the one there is
    listed = client(server.token).get(base(world) + "objects/", {"prefix": "updates/"})
    assert listed.status_code == 200
    [found] = listed.json()["objects"]
    assert found["key"] == key
    assert fetch(found["url"]) == (200, DATA)
    assert fetch(found["url"], HTTP_RANGE="bytes=65530-65545") == (206, DATA[65530:65546])

    # when: it replies, and the trainer waits for the reply
    reply = {"key": key, "status": 200, "body": {"accepted": True, "round": 1}}
    assert client(server.token).post(base(world) + "objects/reply/", reply, format="json").status_code == 200
    waited = client(trainer.token).get(base(world) + "objects/reply/", {"key": key, "wait": 5})
    assert (waited.status_code, waited.json()) == (
        200,
        {"status": 200, "body": {"accepted": True, "round": 1}},
    )

    # when: the parameter server deletes the update it is done with
    with django_capture_on_commit_callbacks(execute=True):
        deleted = client(server.token).delete(base(world) + f"objects/?key={key}")

    # then: gone for readers and from disk; the reply stays for the writer; the usage is counted
    assert deleted.status_code == 204
    assert client(server.token).get(base(world) + "objects/", {"prefix": "updates/"}).json() == {
        "objects": []
    }
    assert relay_files(settings.HYPHA_DATA_DIR) == []
    again = client(trainer.token).get(base(world) + "objects/reply/", {"key": key})
    assert again.json() == {"status": 200, "body": {"accepted": True, "round": 1}}
    assert services.job_relay_summary(world.job) == {
        "objects": 1,
        "bytes_written": 153600,
        "bytes_read": 153600,
    }


def test_asking_again_resumes_an_upload_and_sends_only_missing_parts(world, settings):
    trainer = world.trainers[0]
    key = f"updates/1/{trainer.peer}"
    plan = begin(world, trainer.token, key).json()
    for number in (1, 3):
        part = plan["parts"][number - 1]
        assert put_part(part["url"], DATA[part["offset"] : part["offset"] + part["size"]]).status_code == 200

    # when: completed too early
    early = client(trainer.token).post(base(world) + "uploads/complete/", {"key": key}, format="json")

    # then: 400 naming the missing part; nothing is lost
    assert early.status_code == 400
    assert early.json() == {"detail": "parts not uploaded yet: 2", "missing": [2]}
    blob = RelayObject.objects.get().blob
    assert relay_files(settings.HYPHA_DATA_DIR) == [f"{world.job.pk}/{blob}/1", f"{world.job.pk}/{blob}/3"]

    # when: the trainer asks again with the same content
    resumed = begin(world, trainer.token, key).json()

    # then: the same upload, parts 1 and 3 done (no URL), part 2 to send
    assert [(p["number"], p["done"], p["url"] is None) for p in resumed["parts"]] == [
        (1, True, True),
        (2, False, False),
        (3, True, True),
    ]
    assert RelayObject.objects.get().blob == blob
    part = resumed["parts"][1]
    assert put_part(part["url"], DATA[part["offset"] : part["offset"] + part["size"]]).status_code == 200
    done = client(trainer.token).post(base(world) + "uploads/complete/", {"key": key}, format="json")
    assert done.status_code == 200
    assert fetch(done.json()["url"]) == (200, DATA)


def test_a_complete_object_is_immutable_but_the_same_content_again_answers_it(world, settings):
    server = world.server
    upload(world, server.token, "results/1")

    same = begin(world, server.token, "results/1")
    other = begin(world, server.token, "results/1", DATA[:-1])

    assert same.status_code == 200
    assert same.json()["status"] == "complete"
    assert [p["done"] for p in same.json()["parts"]] == [True, True, True]
    assert other.status_code == 409
    assert other.json()["detail"].startswith("results/1 exists with other content")
    assert RelayObject.objects.get().size == len(DATA)


def test_a_pending_upload_with_other_content_is_replaced_and_its_parts_deleted(
    world, settings, django_capture_on_commit_callbacks
):
    server = world.server
    plan = begin(world, server.token, "results/2").json()
    assert put_part(plan["parts"][0]["url"], DATA[:LOCAL_PART_SIZE]).status_code == 200
    old_blob = RelayObject.objects.get().blob

    with django_capture_on_commit_callbacks(execute=True):
        replaced = begin(world, server.token, "results/2", b"short")

    assert replaced.status_code == 200
    assert [(p["number"], p["size"], p["done"]) for p in replaced.json()["parts"]] == [(1, 5, False)]
    assert RelayObject.objects.get().blob != old_blob
    assert relay_files(settings.HYPHA_DATA_DIR) == []
    # the old upload's URLs now lead nowhere
    assert put_part(plan["parts"][1]["url"], DATA[LOCAL_PART_SIZE : 2 * LOCAL_PART_SIZE]).status_code == 404


def test_an_empty_object_has_one_empty_part(world):
    obj = upload(world, world.server.token, "results/3", b"")

    assert (obj["size"], obj["sha256"]) == (0, digest(b""))
    assert fetch(obj["url"]) == (200, b"")


# --- refusals -----------------------------------------------------------------------------------------------


def _expired_token(world) -> str:
    lease = world.trainers[0].task.lease
    claims = {
        "job": str(world.job.pk),
        "peer": str(lease.worker_id),
        "lease": str(lease.pk),
        "role": "trainer",
    }
    return protocol.sign_transfer_token(transfer_key(world.job.pk), {**claims, "exp": int(time.time()) - 5})


@pytest.mark.parametrize(
    ("who", "status", "detail"),
    [
        ("nobody", 401, "a transfer token is required (Authorization: Bearer …)"),
        ("forger", 401, "transfer token signature does not match"),
        ("expired", 401, "transfer token expired"),
        ("other job", 401, "transfer token signature does not match"),
    ],
)
def test_a_caller_without_a_valid_token_of_the_job_is_refused(world, settings, who, status, detail):
    token = {
        "nobody": None,
        "forger": world.trainers[0].token[:-4] + "AAAA",
        "expired": _expired_token(world),
        "other job": world.other_token,
    }[who]
    key = f"updates/1/{world.trainers[0].peer}"

    answers = [
        begin(world, token, key),
        client(token).post(base(world) + "uploads/complete/", {"key": key}, format="json"),
        client(token).get(base(world) + "objects/", {"key": "results/1"}),
        client(token).get(base(world) + "wants/"),
    ]

    assert [(answer.status_code, answer.json()) for answer in answers] == [(status, {"detail": detail})] * 4
    assert nothing_stored(settings)


@pytest.mark.parametrize(
    ("writer", "key", "detail"),
    [
        ("trainer", "results/1", "only the job's parameter server may write results/1"),
        ("trainer", "model/1/config.json", "only the job's parameter server may write model/1/config.json"),
        ("trainer", "updates/1/{other}", "only the trainer {other} may write updates/1/{other}"),
        ("server", "updates/1/{other}", "only the trainer {other} may write updates/1/{other}"),
    ],
)
def test_a_role_that_may_not_write_a_key_is_refused_and_nothing_is_stored(
    world, settings, writer, key, detail
):
    other = world.trainers[1].peer
    token = world.trainers[0].token if writer == "trainer" else world.server.token

    answer = begin(world, token, key.format(other=other))

    assert (answer.status_code, answer.json()) == (403, {"detail": detail.format(other=other)})
    assert nothing_stored(settings)


def test_a_trainer_may_not_read_updates_nor_answer_wants(world):
    trainer = world.trainers[0]
    upload(world, world.trainers[1].token, f"updates/1/{world.trainers[1].peer}")

    listed = client(trainer.token).get(base(world) + "objects/", {"prefix": "updates/"})
    got = client(trainer.token).get(base(world) + "objects/", {"key": f"updates/1/{world.trainers[1].peer}"})
    wants = client(trainer.token).get(base(world) + "wants/")

    assert (listed.status_code, listed.json()) == (
        403,
        {"detail": "only the job's parameter server may read updates/"},
    )
    assert got.status_code == 403
    assert (wants.status_code, wants.json()) == (
        403,
        {"detail": "only the job's parameter server answers wants"},
    )
    assert RelayObject.objects.get().readers == []


def test_a_task_that_ended_or_a_job_that_ended_is_refused(world, settings):
    trainer = world.trainers[0]
    Task.objects.filter(pk=trainer.task.pk).update(status=Task.Status.EXITED)

    ended_task = begin(world, trainer.token, f"updates/1/{trainer.peer}")
    Job.objects.filter(pk=world.job.pk).update(status=Job.Status.COMPLETED)
    ended_job = begin(world, world.server.token, "results/1")

    assert (ended_task.status_code, ended_task.json()) == (
        403,
        {"detail": f"this token's task of job {world.job.pk} is not live"},
    )
    assert (ended_job.status_code, ended_job.json()) == (409, {"detail": f"job {world.job.pk} is completed"})
    assert nothing_stored(settings)


@pytest.mark.parametrize(
    ("body", "status", "errors"),
    [
        ({"key": "updates/0/{peer}"}, 400, {"key": "is not a relay key"}),
        ({"key": "updates/1/{peer}/x"}, 400, {"key": "is not a relay key"}),
        ({"key": "model/latest/config.json"}, 400, {"key": "model/latest/<filename> is read-only"}),
        ({"key": "results/1000000000"}, 400, {"key": "is not a relay key"}),
        ({"key": "model/1/.hidden"}, 400, {"key": "is not a relay key"}),
        ({"sha256": "ABC"}, 400, {"sha256": "Ensure this field has at least 64 characters."}),
        ({"sha256": "G" * 64}, 400, {"sha256": "sha256 must be 64 lower-case hexadecimal digits"}),
        ({"size": -1}, 400, {"size": "Ensure this value is greater than or equal to 0."}),
        (
            {"size": 17 << 30},
            413,
            {"detail": "size 18253611008 exceeds the relay's limit of 17179869184 bytes"},
        ),
        (
            {"size": 10_001 << 16},
            413,
            {"detail": "size 655425536 needs more than 10000 parts of 65536 bytes"},
        ),
        ({"metadata": {"nested": {"a": 1}}}, 400, {"metadata": "must be a string, a 64-bit integer"}),
        ({"metadata": {"big": "x" * 9000}}, 400, {"metadata": "bytes of JSON; at most 8192"}),
        ({"metadata": {"bad name": 1}}, 400, {"metadata": "metadata name 'bad name'"}),
        ({"extra": 1}, 400, {"extra": "Unknown field."}),
    ],
)
def test_bad_input_is_a_clear_4xx_and_stores_nothing(world, settings, body, status, errors):
    trainer = world.trainers[0]
    request = {"key": f"updates/1/{trainer.peer}", "size": 10, "sha256": "a" * 64, "metadata": {}}
    request.update(
        {name: value.format(peer=trainer.peer) if name == "key" else value for name, value in body.items()}
    )
    if body.get("key", "").startswith("model/") or body.get("key", "").startswith("results/"):
        token = world.server.token
    else:
        token = trainer.token

    answer = client(token).post(base(world) + "uploads/", request, format="json")

    assert answer.status_code == status
    found = answer.json()
    assert sorted(found) == sorted(errors)
    for name, fragment in errors.items():
        message = found[name] if isinstance(found[name], str) else found[name][0]
        assert fragment in message
    assert nothing_stored(settings)


def test_a_checksum_mismatch_at_completion_deletes_the_upload(
    world, settings, django_capture_on_commit_callbacks
):
    server = world.server
    plan = begin(world, server.token, "results/1").json()
    tampered = bytearray(DATA)
    tampered[70000] ^= 1
    for part in plan["parts"]:
        assert (
            put_part(part["url"], bytes(tampered[part["offset"] : part["offset"] + part["size"]])).status_code
            == 200
        )

    with django_capture_on_commit_callbacks(execute=True):
        answer = client(server.token).post(
            base(world) + "uploads/complete/", {"key": "results/1"}, format="json"
        )

    assert answer.status_code == 422
    assert answer.json()["detail"].startswith(f"results/1: the parts' SHA-256 is {digest(bytes(tampered))}")
    assert answer.json()["detail"].endswith("; the upload was deleted")
    assert nothing_stored(settings)
    assert services.job_relay_summary(world.job) == {"objects": 0, "bytes_written": 0, "bytes_read": 0}


def test_a_malformed_body_or_method_is_answered_cleanly(world, settings):
    token = world.server.token

    malformed = client(token).post(base(world) + "uploads/", b"{not json", content_type="application/json")
    wrong_method = client(token).put(base(world) + "uploads/", {}, format="json")
    options = client(None).options(base(world) + "uploads/")

    assert (malformed.status_code, malformed.json()["detail"].startswith("JSON parse error")) == (400, True)
    assert (wrong_method.status_code, wrong_method.json()) == (405, {"detail": 'Method "PUT" not allowed.'})
    assert options.status_code == 200
    assert nothing_stored(settings)


def test_completing_an_upload_that_never_began_is_a_404(world, settings):
    answer = client(world.server.token).post(
        base(world) + "uploads/complete/", {"key": "results/4"}, format="json"
    )

    assert (answer.status_code, answer.json()) == (
        404,
        {"detail": "no upload of results/4: begin it with POST uploads/"},
    )
    assert nothing_stored(settings)


def test_an_unknown_job_is_a_404(world):
    answer = client(world.server.token).get("/api/relay/jobs/00000000-0000-4000-8000-000000000000/wants/")

    assert (answer.status_code, answer.json()) == (404, {"detail": "No such job."})


# --- reading and waiting ------------------------------------------------------------------------------------


def test_a_missing_object_is_a_204_after_the_wait(world):
    started = time.monotonic()
    answer = client(world.trainers[0].token).get(base(world) + "objects/", {"key": "results/1", "wait": 0.3})

    assert answer.status_code == 204
    assert time.monotonic() - started >= 0.3


@pytest.mark.parametrize(
    ("query", "errors"),
    [
        ({"key": "results/1", "wait": 31}, {"wait": ["Ensure this value is less than or equal to 30.0."]}),
        ({"key": "results/1", "prefix": "results/"}, {"key": ["Give either key or prefix."]}),
        ({}, {"key": ["Give either key or prefix."]}),
        (
            {"prefix": "secrets/"},
            {"prefix": ["'secrets/' is not a relay prefix: it starts with updates/, results/ or model/"]},
        ),
    ],
)
def test_a_bad_query_is_a_400(world, query, errors):
    answer = client(world.server.token).get(base(world) + "objects/", query)

    assert (answer.status_code, answer.json()) == (400, errors)


def test_listing_is_oldest_first_and_counts_each_reader_once(world):
    server = world.server
    for round_number in (2, 1, 3):
        upload(world, server.token, f"results/{round_number}", DATA[: 1000 * round_number])
    trainer = world.trainers[0]

    first = client(trainer.token).get(base(world) + "objects/", {"prefix": "results/"}).json()["objects"]
    again = client(trainer.token).get(base(world) + "objects/", {"prefix": "results/"}).json()["objects"]
    by_server = client(server.token).get(base(world) + "objects/", {"key": "results/3"}).json()

    assert [o["key"] for o in first] == ["results/2", "results/1", "results/3"]
    assert [o["key"] for o in again] == ["results/2", "results/1", "results/3"]
    assert by_server["key"] == "results/3"
    assert RelayUsage.objects.get(job=world.job).bytes_read == 6000 + 3000


def test_model_latest_is_the_newest_round_and_wants_are_handed_out_once(world):
    server, trainer = world.server, world.trainers[0]
    upload(world, server.token, "model/2/config.json", b'{"round": 2}')
    upload(world, server.token, "model/10/config.json", b'{"round": 10}')

    latest = client(trainer.token).get(base(world) + "objects/", {"key": "model/latest/config.json"})
    assert latest.json()["key"] == "model/10/config.json"

    wanted = client(trainer.token).post(
        base(world) + "objects/want/", {"key": "model/latest/config.json"}, format="json"
    )
    assert (wanted.status_code, wanted.json()) == (202, {"key": "model/latest/config.json"})
    assert client(server.token).get(base(world) + "wants/").json() == {"wants": ["model/latest/config.json"]}
    assert client(server.token).get(base(world) + "wants/").json() == {"wants": []}

    # a reader that still waits asks again; the parameter server answers by publishing a newer round
    client(trainer.token).post(
        base(world) + "objects/want/", {"key": "model/latest/config.json"}, format="json"
    )
    upload(world, server.token, "model/11/config.json", b'{"round": 11}')
    assert RelayWant.objects.count() == 0
    assert client(server.token).get(base(world) + "wants/").json() == {"wants": []}

    # or by publishing the same round again (the same content: the same object)
    client(trainer.token).post(
        base(world) + "objects/want/", {"key": "model/latest/config.json"}, format="json"
    )
    again = upload(world, server.token, "model/11/config.json", b'{"round": 11}')
    assert again["key"] == "model/11/config.json"
    assert RelayWant.objects.count() == 0


def test_only_model_latest_keys_can_be_wanted(world):
    answer = client(world.trainers[0].token).post(
        base(world) + "objects/want/", {"key": "results/1"}, format="json"
    )

    assert (answer.status_code, answer.json()) == (
        400,
        {"key": ["only model/latest/<filename> can be wanted"]},
    )
    assert RelayWant.objects.count() == 0


def test_a_reply_is_set_once(world):
    trainer, server = world.trainers[0], world.server
    key = f"updates/1/{trainer.peer}"
    upload(world, trainer.token, key)
    reply = {"key": key, "status": 409, "body": {"detail": "late"}}

    first = client(server.token).post(base(world) + "objects/reply/", reply, format="json")
    same = client(server.token).post(base(world) + "objects/reply/", reply, format="json")
    other = client(server.token).post(base(world) + "objects/reply/", {**reply, "status": 200}, format="json")
    by_trainer = client(trainer.token).post(base(world) + "objects/reply/", reply, format="json")
    missing = client(server.token).post(
        base(world) + "objects/reply/", {**reply, "key": f"updates/2/{trainer.peer}"}, format="json"
    )

    assert (first.status_code, first.json()) == (200, {"status": 409, "body": {"detail": "late"}})
    assert same.status_code == 200
    assert (other.status_code, other.json()) == (409, {"detail": f"{key} has another reply already"})
    assert by_trainer.status_code == 403
    assert missing.status_code == 404
    assert RelayObject.objects.get().reply_status == 409


def test_no_reply_yet_is_a_204(world):
    trainer = world.trainers[0]
    key = f"updates/1/{trainer.peer}"
    upload(world, trainer.token, key)

    answer = client(trainer.token).get(base(world) + "objects/reply/", {"key": key, "wait": 0})

    assert answer.status_code == 204


def test_a_trainer_deletes_only_its_own_objects(world):
    trainer = world.trainers[0]
    upload(world, world.server.token, "results/1")
    upload(world, trainer.token, f"updates/1/{trainer.peer}")

    results = client(trainer.token).delete(base(world) + "objects/?key=results/1")
    own = client(trainer.token).delete(base(world) + f"objects/?key=updates/1/{trainer.peer}")
    missing = client(trainer.token).delete(base(world) + f"objects/?key=updates/1/{trainer.peer}")

    assert (results.status_code, results.json()) == (
        403,
        {"detail": "only the writer or the parameter server may delete results/1"},
    )
    assert own.status_code == 204
    assert (missing.status_code, missing.json()) == (404, {"detail": f"no object updates/1/{trainer.peer}"})
    assert list(RelayObject.objects.values_list("key", flat=True)) == ["results/1"]


# --- lifecycle ----------------------------------------------------------------------------------------------


def test_forget_job_deletes_rows_now_and_bytes_after_commit(
    world, settings, django_capture_on_commit_callbacks
):
    upload(world, world.server.token, "results/1")
    begin(world, world.server.token, "results/2")
    client(world.trainers[0].token).post(
        base(world) + "objects/want/", {"key": "model/latest/a.bin"}, format="json"
    )
    assert relay_files(settings.HYPHA_DATA_DIR) != []

    with django_capture_on_commit_callbacks(execute=False) as callbacks:
        assert services.forget_job(world.job.pk) == 2
    assert not RelayObject.objects.exists() and not RelayWant.objects.exists()
    assert relay_files(settings.HYPHA_DATA_DIR) != []  # not before the commit
    for callback in callbacks:
        callback()

    assert relay_files(settings.HYPHA_DATA_DIR) == []
    assert services.job_relay_summary(world.job.pk) == {
        "objects": 1,
        "bytes_written": len(DATA),
        "bytes_read": 0,
    }


def test_the_sweep_deletes_stale_uploads_delivered_rows_ended_jobs_and_orphans(
    world, settings, django_capture_on_commit_callbacks
):
    server = world.server
    begin(world, server.token, "results/1")  # pending, will be stale
    plan = begin(world, server.token, "results/2").json()  # pending, fresh
    assert put_part(plan["parts"][0]["url"], DATA[:LOCAL_PART_SIZE]).status_code == 200
    trainer = world.trainers[0]
    key = f"updates/1/{trainer.peer}"
    upload(world, trainer.token, key)
    client(server.token).post(
        base(world) + "objects/reply/", {"key": key, "status": 200, "body": {}}, format="json"
    )
    with django_capture_on_commit_callbacks(execute=True):
        client(server.token).delete(base(world) + f"objects/?key={key}")
    long_ago = timezone.now() - timedelta(seconds=settings.HYPHA_RELAY_PENDING_TTL + 1)
    RelayObject.objects.filter(key="results/1").update(created_at=long_ago)
    RelayObject.objects.filter(key=key).update(deleted_at=long_ago)
    orphan = settings.HYPHA_DATA_DIR / "relay" / str(world.job.pk) / "00000000-0000-4000-8000-000000000001"
    orphan.mkdir(parents=True)
    (orphan / "1").write_bytes(b"left over")
    import os

    os.utime(orphan, (long_ago.timestamp(), long_ago.timestamp()))

    with django_capture_on_commit_callbacks(execute=True):
        swept = services.sweep()

    assert swept == {"pending": 1, "delivered": 1, "jobs": 0, "orphans": 1}
    assert list(RelayObject.objects.values_list("key", flat=True)) == ["results/2"]
    blob = RelayObject.objects.get().blob
    assert relay_files(settings.HYPHA_DATA_DIR) == [f"{world.job.pk}/{blob}/1"]

    # when the job ends, the next sweep deletes the rest (one job, however many objects it has)
    upload(world, server.token, "results/5")
    Job.objects.filter(pk=world.job.pk).update(status=Job.Status.FAILED)
    with django_capture_on_commit_callbacks(execute=True):
        assert services.sweep() == {"pending": 0, "delivered": 0, "jobs": 1, "orphans": 0}
    assert nothing_stored(settings)


def test_the_sweep_is_registered_with_beat(settings):
    from hypha_site.celery import app

    assert settings.CELERY_BEAT_SCHEDULE["relay-sweep"] == {
        "task": "apps.relay.tasks.sweep_relay",
        "schedule": settings.HYPHA_RELAY_SWEEP_INTERVAL,
    }
    # registered at start (apps.relay's ready), where the embedded runner looks the clocks' tasks up
    assert "apps.relay.tasks.sweep_relay" in app.tasks
