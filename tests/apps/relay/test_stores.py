"""The same store tests on both backends, over real HTTP: the local store served by pytest-django's live
server, and S3 on a real S3 server on loopback (``rclone serve s3``). Upload, resume, completion checks,
ranged reads, deletion and a job's end — and afterwards no bytes left in the store."""

from __future__ import annotations

import time

import httpx
import pytest

from apps.relay import services
from apps.relay.exceptions import PartsMissing
from apps.relay.models import RelayObject
from apps.relay.stores import Blob, S3Store, get_store
from tests.apps.relay.world import digest, make_world, relay_files

#: 5 MiB + 1000 bytes: two parts on S3 (5 MiB parts, S3's minimum) and on the local store (set alike here).
DATA = (bytes(range(251)) * 20900)[: (5 << 20) + 1000]


@pytest.fixture(params=["local", "s3"])
def backend(request, settings):
    """``(base URL for the local store's URLs, a function listing what the store holds)``."""
    if request.param == "local":
        live_server = request.getfixturevalue("live_server")
        settings.HYPHA_RELAY_PART_SIZE = 5 << 20
        return live_server.url, lambda: relay_files(settings.HYPHA_DATA_DIR)
    prefix = request.getfixturevalue("on_s3")
    server = request.getfixturevalue("s3_server")
    return "http://unused.example", lambda: server.keys(prefix)


@pytest.fixture
def world(transactional_db):
    return make_world()


def caller(world, peer) -> services.Caller:
    return services.authorise(world.job.pk, peer.token)


def put(plan: dict, numbers: list[int]) -> None:
    for part in plan["parts"]:
        if part["number"] in numbers:
            body = DATA[part["offset"] : part["offset"] + part["size"]]
            answer = httpx.put(part["url"], content=body, timeout=30)
            assert answer.status_code == 200, answer.text


def ranged(url: str, header: str) -> tuple[str, bytes]:
    """The Content-Range and body of a ranged GET (rclone answers 200 with Content-Range, S3 and we 206)."""
    answer = httpx.get(url, headers={"Range": header}, timeout=30)
    assert answer.status_code in (200, 206), answer.text
    return answer.headers["Content-Range"], answer.content


def test_an_object_goes_up_in_parts_resumes_and_reads_back(world, backend):
    base_url, stored = backend
    server = caller(world, world.server)

    # when: begun, one part sent, then begun again
    plan = services.begin_upload(
        server, key="results/1", size=len(DATA), sha256=digest(DATA), metadata={"round": 1}, base_url=base_url
    )
    assert [(p["number"], p["size"], p["done"]) for p in plan["parts"]] == [
        (1, 5 << 20, False),
        (2, 1000, False),
    ]
    put(plan, [1])
    resumed = services.begin_upload(
        server, key="results/1", size=len(DATA), sha256=digest(DATA), metadata={"round": 1}, base_url=base_url
    )

    # then: part 1 is done; completing now names part 2 as missing
    assert [(p["number"], p["done"]) for p in resumed["parts"]] == [(1, True), (2, False)]
    with pytest.raises(PartsMissing) as missing:
        services.complete_upload(server, key="results/1", base_url=base_url)
    assert missing.value.missing == [2]

    # when: the last part is sent and the upload completed
    put(resumed, [2])
    obj = services.complete_upload(server, key="results/1", base_url=base_url)

    # then: readers get it whole and in ranges
    assert (obj["size"], obj["sha256"], obj["metadata"]) == (len(DATA), digest(DATA), {"round": 1})
    url = services.get_object(caller(world, world.trainers[0]), key="results/1", base_url=base_url)["url"]
    whole = httpx.get(url, timeout=30)
    assert (whole.status_code, whole.content == DATA) == (200, True)
    assert ranged(url, "bytes=5242870-5242889") == ("bytes 5242870-5242889/5243880", DATA[5242870:5242890])
    assert ranged(url, "bytes=-10") == ("bytes 5243870-5243879/5243880", DATA[-10:])
    assert stored() != []

    # when: deleted (the bytes go after commit: at once here, outside a transaction)
    services.delete_object(server, key="results/1")

    # then: nothing is left in the store
    assert stored() == []
    assert httpx.get(url, timeout=30).status_code in (403, 404)


def test_a_job_forgotten_mid_upload_leaves_no_bytes(world, backend):
    base_url, stored = backend
    server = caller(world, world.server)
    plan = services.begin_upload(
        server, key="results/1", size=len(DATA), sha256=digest(DATA), metadata={}, base_url=base_url
    )
    put(plan, [1])
    services.begin_upload(
        server, key="results/2", size=3, sha256=digest(b"abc"), metadata={}, base_url=base_url
    )
    small = services.begin_upload(
        server, key="results/3", size=3, sha256=digest(b"xyz"), metadata={}, base_url=base_url
    )
    assert httpx.put(small["parts"][0]["url"], content=b"xyz", timeout=30).status_code == 200
    services.complete_upload(server, key="results/3", base_url=base_url)
    pending = [
        Blob(str(o.job_id), str(o.blob), o.upload_id) for o in RelayObject.objects.filter(status="pending")
    ]

    assert services.forget_job(world.job.pk) == 3

    assert not RelayObject.objects.exists()
    assert stored() == []
    store = get_store()
    if isinstance(store, S3Store):  # the open multipart uploads were aborted too
        for blob in pending:
            with pytest.raises(Exception, match="NoSuchUpload"):
                store.client.list_parts(
                    Bucket=store.bucket, Key=store.key(blob.job_id, blob.blob), UploadId=blob.upload_id
                )


def test_a_wrong_size_never_completes(world, backend):
    base_url, stored = backend
    server = caller(world, world.server)
    plan = services.begin_upload(
        server, key="results/1", size=len(DATA), sha256=digest(DATA), metadata={}, base_url=base_url
    )
    put(plan, [1])
    short = httpx.put(plan["parts"][1]["url"], content=DATA[-999:], timeout=30)

    # the local store refuses the short part itself; S3 stores it, and it does not count as done
    assert short.status_code == (400 if base_url.startswith("http://localhost") else 200)
    with pytest.raises(PartsMissing) as missing:
        services.complete_upload(server, key="results/1", base_url=base_url)
    assert missing.value.missing == [2]
    assert RelayObject.objects.get().status == "pending"


def test_an_expired_part_url_is_refused_by_the_store(world, backend, settings):
    base_url, stored = backend
    settings.HYPHA_RELAY_URL_LIFETIME = 1
    server = caller(world, world.server)
    plan = services.begin_upload(
        server, key="results/1", size=3, sha256=digest(b"abc"), metadata={}, base_url=base_url
    )
    time.sleep(2.1)

    answer = httpx.put(plan["parts"][0]["url"], content=b"abc", timeout=30)

    assert answer.status_code in (400, 403)  # rclone answers an expired presigned URL 400, AWS and we 403
    assert "xpired" in answer.text or "exceeds the maximum allowed" in answer.text  # ours/AWS, rclone
    with pytest.raises(PartsMissing):
        services.complete_upload(server, key="results/1", base_url=base_url)
