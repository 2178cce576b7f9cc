"""A data node behind NAT publishes its slices to the relay's store, and trainers download them from the control
plane (apps/datasets/publishing.py), from outside: DRF's APIClient for the publishing API and the slice and part
byte views (the local store), a real S3 server on loopback (``rclone serve s3``) for the S3 store. Every
refusal leaves no row and no file behind."""

from __future__ import annotations

import hashlib
import os
import time
import urllib.parse
import uuid
from datetime import timedelta

import httpx
import pytest
from django.utils import timezone
from rest_framework.test import APIClient

from apps.datasets import publishing, services
from apps.datasets.models import DataNode, Dataset, PublishedSlice
from apps.relay import tasks as relay_tasks
from data_node import tokens
from tests.apps.relay.world import start_s3_server, use_s3

pytestmark = pytest.mark.django_db

PART_SIZE = 64 << 10
#: Slice 0 is three parts (64, 64 and 22 KiB); slices 1 and 2 are one part each.
DATA = [bytes(range(256)) * 600, b"tiny slice one" * 70, b"\x00\x01" * 500]


def digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def announcement(name: str = "nat-text", *, reachable: bool | str = False, url: str = "http://10.1.2.3:8750"):
    return {
        "name": name,
        "url": url,
        "reachable": reachable,
        "slices": [{"index": i, "size": len(data), "sha256": digest(data)} for i, data in enumerate(DATA)],
    }


def client(token: str | None, scheme: str = "Bearer") -> APIClient:
    api = APIClient()
    if token is not None:
        api.credentials(HTTP_AUTHORIZATION=f"{scheme} {token}")
    return api


def register(token: str, body: dict):
    return client(token).post("/api/datasets/register/", body, format="json")


def begin(token: str | None, index: int, *, dataset: str = "nat-text", **override):
    data = DATA[index] if index < len(DATA) else b""
    body = {"dataset": dataset, "index": index, "size": len(data), "sha256": digest(data)}
    return client(token).post("/api/datanodes/publish/", {**body, **override}, format="json")


def complete(token: str | None, index: int, *, dataset: str = "nat-text"):
    return client(token).post(
        "/api/datanodes/publish/complete/", {"dataset": dataset, "index": index}, format="json"
    )


def put_part(url: str, data: bytes):
    return APIClient().put(url, data=data, content_type="application/octet-stream")


def publish(token: str, index: int) -> dict:
    """Begin, PUT every missing part, complete: the answer."""
    plan = begin(token, index).json()
    for part in plan["parts"]:
        if not part["done"]:
            assert (
                put_part(part["url"], DATA[index][part["offset"] : part["offset"] + part["size"]]).status_code
                == 200
            )
    answer = complete(token, index)
    assert answer.status_code == 200, answer.json()
    return answer.json()


def fetch(url: str, **headers) -> tuple[int, bytes]:
    response = APIClient().get(url, **headers)
    body = b"".join(response.streaming_content) if response.streaming else response.content
    return response.status_code, body


def stored_files(settings) -> list[str]:
    root = settings.HYPHA_DATA_DIR / publishing.PUBLISHED_DIRECTORY
    return (
        sorted(str(path.relative_to(root)) for path in root.rglob("*") if path.is_file())
        if root.exists()
        else []
    )


def rows() -> list[tuple]:
    return list(PublishedSlice.objects.order_by("pk").values_list("slice__index", "status", "size", "sha256"))


@pytest.fixture(autouse=True)
def local_store(settings, tmp_path):
    settings.HYPHA_DATA_DIR = tmp_path
    settings.HYPHA_RELAY_STORE = "local"
    settings.HYPHA_RELAY_PART_SIZE = PART_SIZE
    settings.HYPHA_RELAY_URL_LIFETIME = 900
    return tmp_path


@pytest.fixture
def behind_nat(db) -> tuple[DataNode, str]:
    """Data node "data-nat", registered through the API with ``reachable: false`` for dataset nat-text."""
    node, token = services.create_data_node(name="data-nat", url="http://10.1.2.3:8750")
    assert register(token, announcement()).status_code == 201
    node.refresh_from_db()
    return node, token


def urls(index: int, **options) -> list[str]:
    return services.slice_urls(
        Dataset.objects.get(name="nat-text"), index, job_id="job-1", peer="rig-a", **options
    )


# --- the round trip -----------------------------------------------------------------------------------------


def test_a_node_behind_nat_publishes_a_slice_and_trainers_get_it_from_the_control_plane(behind_nat, settings):
    node, token = behind_nat
    assert node.control_plane_url == "http://testserver/"

    # when: the node begins publishing slice 0
    answer = begin(token, 0)

    # then: three parts to PUT to this server, signed
    assert answer.status_code == 200
    plan = answer.json()
    assert {
        name: plan[name]
        for name in ("dataset", "index", "size", "sha256", "part_size", "expires_in", "status")
    } == {
        "dataset": "nat-text",
        "index": 0,
        "size": 153600,
        "sha256": digest(DATA[0]),
        "part_size": PART_SIZE,
        "expires_in": 900,
        "status": "pending",
    }
    assert [(p["number"], p["offset"], p["size"], p["done"]) for p in plan["parts"]] == [
        (1, 0, 65536, False),
        (2, 65536, 65536, False),
        (3, 131072, 22528, False),
    ]
    [blob] = PublishedSlice.objects.values_list("blob", flat=True)
    for part in plan["parts"]:
        assert part["url"].startswith(
            f"http://testserver/api/datanodes/parts/{node.pk}/{blob}/{part['number']}?expires="
        )
        assert "&signature=" in part["url"]

    # when: it PUTs them and completes
    for part in plan["parts"]:
        response = put_part(part["url"], DATA[0][part["offset"] : part["offset"] + part["size"]])
        assert (response.status_code, response.json()) == (
            200,
            {"number": part["number"], "size": part["size"]},
        )
    completed = complete(token, 0)

    # then: the copy is complete, its parts on disk under the node's id
    assert (completed.status_code, completed.json()) == (
        200,
        {"dataset": "nat-text", "index": 0, "size": 153600, "sha256": digest(DATA[0]), "status": "complete"},
    )
    assert stored_files(settings) == [f"{node.pk}/{blob}/1", f"{node.pk}/{blob}/2", f"{node.pk}/{blob}/3"]

    # and: the slice's URL is the control plane's, with the token the node itself would check
    [url] = urls(0, lifetime=600)
    path, _, query = url.partition("?")
    assert path == f"http://testserver/api/datanodes/{node.pk}/datasets/nat-text/slices/0"
    token_claims = tokens.verify(
        services.download_key(node).encode(),
        urllib.parse.parse_qs(query)["token"][0],
        dataset="nat-text",
        index=0,
    )
    assert token_claims["exp"] == pytest.approx(time.time() + 600, abs=2)

    # and: downloading it gives the slice's bytes, its digest, and ranges
    response = APIClient().get(url)
    assert response.status_code == 200
    assert b"".join(response.streaming_content) == DATA[0]
    assert (response["Content-Length"], response["X-Sha256"]) == ("153600", digest(DATA[0]))
    assert fetch(url, HTTP_RANGE="bytes=65530-65545") == (206, DATA[0][65530:65546])
    assert fetch(url, HTTP_RANGE="bytes=-10") == (206, DATA[0][-10:])
    assert fetch(url, HTTP_RANGE="bytes=153600-")[0] == 416


def test_a_publication_resumes_with_the_parts_stored_already(behind_nat):
    node, token = behind_nat
    plan = begin(token, 0).json()
    first = plan["parts"][0]
    assert put_part(first["url"], DATA[0][: first["size"]]).status_code == 200

    # when: the node asks again (it restarted)
    again = begin(token, 0).json()

    # then: the same upload, part 1 done
    assert [(p["number"], p["done"], p["url"] is None) for p in again["parts"]] == [
        (1, True, True),
        (2, False, False),
        (3, False, False),
    ]
    assert PublishedSlice.objects.count() == 1

    # and once complete, asking again says so, every part done
    publish(token, 0)
    done = begin(token, 0).json()
    assert done["status"] == "complete"
    assert [p["done"] for p in done["parts"]] == [True, True, True]
    assert complete(token, 0).json()["status"] == "complete"


def test_a_slice_not_published_yet_is_503_there_while_other_replicas_serve_it(behind_nat):
    node, token = behind_nat
    reachable, reachable_token = services.create_data_node(name="data-open", url="http://open.example:8750")
    assert (
        register(reachable_token, announcement(reachable=True, url="http://open.example:8750")).status_code
        == 200
    )

    # when
    found = urls(1)

    # then: the open node's own URL and the control plane's for the node behind NAT
    assert [url.partition("?")[0] for url in found] == [
        f"http://testserver/api/datanodes/{node.pk}/datasets/nat-text/slices/1",
        "http://open.example:8750/datasets/nat-text/slices/1",
    ]
    response = APIClient().get(found[0])
    assert response.status_code == 503
    assert response["Retry-After"] == "10"
    assert response.json() == {
        "error": "not_ready",
        "detail": "slice 1 of nat-text is not in the store yet: data node data-nat (not reachable) is still "
        "publishing it",
    }

    # when it is published, the same URL serves it
    publish(token, 1)
    assert fetch(found[0]) == (200, DATA[1])


def test_a_node_registered_through_nothing_but_the_services_has_no_control_plane_url(db):
    # given: a node behind NAT that never registered through the API (no address of the control plane)
    node, _token = services.create_data_node(name="quiet", url="http://10.9.9.9:1")
    services.register_from_node(
        node, name="nat-text", url=node.url, slices=[(0, 10, "a" * 64)], reachable=False
    )

    # then: no URL stands for it
    assert publishing.slice_base_url(node) is None
    assert services.slice_urls(Dataset.objects.get(name="nat-text"), 0, job_id="j", peer="p") == []


@pytest.mark.parametrize(("reachable", "publishes"), [(False, True), (True, False), ("auto", False)])
def test_only_a_node_that_says_it_is_not_reachable_publishes(db, reachable, publishes):
    node, token = services.create_data_node(name="data-x", url="http://10.1.2.3:8750")
    register(token, announcement(reachable=reachable))
    node.refresh_from_db()

    assert publishing.publishes(node) is publishes
    [url] = urls(0)
    assert url.startswith(
        f"http://testserver/api/datanodes/{node.pk}/" if publishes else "http://10.1.2.3:8750/"
    )


# --- downloads that are refused -----------------------------------------------------------------------------


def test_a_download_needs_the_token_of_that_slice(behind_nat):
    node, token = behind_nat
    publish(token, 0)
    [url] = urls(0)
    path = url.partition("?")[0]
    other = urls(1)[0].partition("?")[2]
    expired = tokens.sign(
        services.download_key(node),
        dataset="nat-text",
        index=0,
        job="j",
        peer="p",
        expires=int(time.time()) - 5,
    )

    # then
    assert fetch(path)[0] == 401
    assert APIClient().get(path)["WWW-Authenticate"] == 'Bearer realm="slices"'
    assert fetch(f"{path}?{other}")[0] == 403
    assert fetch(f"{path}?token={expired}")[0] == 401
    assert fetch(path, HTTP_AUTHORIZATION=f"Bearer {url.partition('token=')[2]}") == (200, DATA[0])
    unknown = url.replace(str(node.pk), "00000000-0000-4000-8000-000000000000")
    assert fetch(unknown)[0] == 401


def test_a_node_that_became_reachable_drops_its_copies_and_its_control_plane_urls(
    behind_nat, settings, django_capture_on_commit_callbacks
):
    node, token = behind_nat
    publish(token, 0)
    [old_url] = urls(0)

    # when: the node registers again, reachable now
    with django_capture_on_commit_callbacks(execute=True):
        assert register(token, announcement(reachable=True)).status_code == 200

    # then: its copies are gone, rows and bytes; trainers get its own URL; the old URL is a 404
    assert rows() == []
    assert stored_files(settings) == []
    assert urls(0)[0].startswith("http://10.1.2.3:8750/datasets/nat-text/slices/0?token=")
    assert fetch(old_url)[0] == 404


def test_a_node_that_serves_another_dataset_now_drops_the_copies_of_the_first(
    behind_nat, settings, django_capture_on_commit_callbacks
):
    node, token = behind_nat
    publish(token, 1)

    # when
    with django_capture_on_commit_callbacks(execute=True):
        assert register(token, announcement("other-text")).status_code == 201

    # then
    assert rows() == []
    assert stored_files(settings) == []


# --- publications that are refused -------------------------------------------------------------------------


def test_publishing_needs_a_data_node_token(behind_nat, alice):
    before = rows()
    assert begin(None, 0).status_code == 401
    assert begin("hd_not-a-token", 0).status_code == 401
    assert (
        client(alice.token, scheme="Token")
        .post(
            "/api/datanodes/publish/",
            {"dataset": "nat-text", "index": 0, "size": 1, "sha256": "a" * 64},
            format="json",
        )
        .status_code
        == 401
    )
    assert complete(None, 0).status_code == 401
    assert rows() == before == []


def test_a_slice_the_node_does_not_serve_is_refused(behind_nat, db):
    node, token = behind_nat
    stranger, stranger_token = services.create_data_node(name="data-far", url="http://10.7.7.7:1")
    register(stranger_token, announcement("far-text"))

    # then
    answer = begin(stranger_token, 0)
    assert (answer.status_code, answer.json()) == (
        400,
        {
            "dataset": [
                "data node data-far does not serve dataset 'nat-text' (it registers the datasets it serves)"
            ]
        },
    )
    answer = begin(token, 3, size=5, sha256="b" * 64)
    assert (answer.status_code, answer.json()) == (
        400,
        {"index": ["dataset nat-text has slices 0..2, not 3"]},
    )
    assert begin(token, 0, dataset="nope").status_code == 400
    assert complete(stranger_token, 0).status_code == 400
    assert rows() == []


def test_a_size_or_digest_that_is_not_the_registered_one_is_409(behind_nat, settings):
    node, token = behind_nat

    # when
    answer = begin(token, 1, size=999)

    # then
    assert (answer.status_code, answer.json()) == (
        409,
        {
            "detail": f"slice 1 of nat-text is registered as 980 bytes with SHA-256 {digest(DATA[1])}, not 999 "
            f"bytes with SHA-256 {digest(DATA[1])}: publish the registered bytes"
        },
    )
    assert begin(token, 1, sha256="c" * 64).status_code == 409
    assert (rows(), stored_files(settings)) == ([], [])


def test_a_reachable_node_may_not_publish(db):
    node, token = services.create_data_node(name="data-open", url="http://open.example:1")
    register(token, announcement(reachable=True, url="http://open.example:1"))

    answer = begin(token, 0)

    assert (answer.status_code, answer.json()) == (
        409,
        {
            "detail": "data node data-open registered as reachable (true): trainers download its slices from it; "
            "only a node registered with reachable false publishes them"
        },
    )
    assert rows() == []


def test_malformed_input_is_400_with_every_field(behind_nat):
    node, token = behind_nat
    answer = client(token).post(
        "/api/datanodes/publish/",
        {"dataset": "a b", "index": -1, "size": 0, "sha256": "XYZ", "extra": 1},
        format="json",
    )
    assert answer.status_code == 400
    assert sorted(answer.json()) == ["dataset", "extra", "index", "sha256", "size"]
    assert rows() == []


def test_a_part_too_long_too_short_or_unsigned_is_refused_and_nothing_is_kept(behind_nat, settings):
    node, token = behind_nat
    part = begin(token, 0).json()["parts"][0]
    chunk = DATA[0][:65536]
    unsigned = part["url"].partition("?")[0]
    forged = part["url"].replace("signature=", "signature=x")

    # then
    assert put_part(part["url"], chunk + b"!").status_code == 413
    assert put_part(part["url"], chunk[:-1]).status_code == 400
    assert put_part(unsigned, chunk).status_code == 403
    assert put_part(forged, chunk).status_code == 403
    assert APIClient().get(part["url"]).status_code == 405
    assert stored_files(settings) == []
    assert [p["done"] for p in begin(token, 0).json()["parts"]] == [False, False, False]


def test_completing_with_parts_missing_is_400_with_their_numbers(behind_nat):
    node, token = behind_nat
    part = begin(token, 0).json()["parts"][0]
    put_part(part["url"], DATA[0][:65536])

    answer = complete(token, 0)

    assert (answer.status_code, answer.json()) == (
        400,
        {"detail": "parts not uploaded yet: 2, 3", "missing": [2, 3]},
    )
    assert rows() == [(0, "pending", 153600, digest(DATA[0]))]


def test_completing_what_was_never_begun_is_404(behind_nat):
    node, token = behind_nat
    answer = complete(token, 2)
    assert (answer.status_code, answer.json()) == (
        404,
        {"detail": "no publication of slice 2 of nat-text: begin it with POST /api/datanodes/publish/"},
    )


def test_bytes_that_are_not_the_slice_are_422_and_the_upload_is_deleted(
    behind_nat, settings, django_capture_on_commit_callbacks
):
    node, token = behind_nat
    [part] = begin(token, 1).json()["parts"]
    assert put_part(part["url"], b"X" * len(DATA[1])).status_code == 200

    # when
    with django_capture_on_commit_callbacks(execute=True):
        answer = complete(token, 1)

    # then
    assert answer.status_code == 422
    assert answer.json()["detail"].startswith("slice 1 of nat-text: the parts' SHA-256 is ")
    assert answer.json()["detail"].endswith("; the upload was deleted")
    assert (rows(), stored_files(settings)) == ([], [])
    assert fetch(urls(1)[0])[0] == 503


# --- the sweep ----------------------------------------------------------------------------------------------


def test_the_sweep_drops_stale_uploads_copies_of_deleted_nodes_and_orphaned_bytes(
    behind_nat, settings, django_capture_on_commit_callbacks
):
    node, token = behind_nat
    publish(token, 1)
    plan = begin(token, 0).json()
    put_part(plan["parts"][0]["url"], DATA[0][:65536])
    PublishedSlice.objects.filter(slice__index=0).update(created_at=timezone.now() - timedelta(hours=2))
    # a part written while its upload was being deleted: a directory no row knows, two hours old
    stray = settings.HYPHA_DATA_DIR / publishing.PUBLISHED_DIRECTORY / str(node.pk) / str(uuid.uuid4())
    stray.mkdir(parents=True)
    (stray / "1").write_bytes(b"left over")
    os.utime(stray, (time.time() - 7200, time.time() - 7200))

    # when: the relay's sweep runs (it sweeps published slices too)
    with django_capture_on_commit_callbacks(execute=True):
        swept = relay_tasks.sweep_relay()

    # then: the stale upload and the stray directory went; the complete copy stayed
    assert (swept["published_slices"], swept["published_orphans"]) == (1, 1)
    assert rows() == [(1, "complete", 980, digest(DATA[1]))]
    [blob] = PublishedSlice.objects.values_list("blob", flat=True)
    assert stored_files(settings) == [f"{node.pk}/{blob}/1"]

    # when: the node is deleted (its copies' rows lose it), and the sweep runs again
    DataNode.objects.filter(pk=node.pk).delete()
    with django_capture_on_commit_callbacks(execute=True):
        assert publishing.sweep() == {"published_slices": 1, "published_orphans": 0}

    # then
    assert (rows(), stored_files(settings)) == ([], [])


# --- S3 -------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def s3_server(tmp_path_factory):
    yield from start_s3_server(tmp_path_factory.mktemp("s3"))


def test_on_s3_the_parts_go_to_the_bucket_and_downloads_are_redirected_there(
    behind_nat, settings, s3_server, django_capture_on_commit_callbacks
):
    node, token = behind_nat
    prefix = use_s3(settings, s3_server)

    # when: the node publishes slice 0 to presigned URLs of the bucket
    plan = begin(token, 0).json()
    [part] = plan["parts"]
    assert part["url"].startswith(f"{s3_server.endpoint}/{s3_server.bucket}/{prefix}node-{node.pk}/")
    assert httpx.put(part["url"], content=DATA[0]).status_code == 200
    assert begin(token, 0).json()["parts"][0]["done"] is True
    assert complete(token, 0).json()["status"] == "complete"

    # then: the object is in the node's namespace, and the control plane's URL redirects to it
    [blob] = PublishedSlice.objects.values_list("blob", flat=True)
    assert s3_server.keys(prefix) == [f"{prefix}node-{node.pk}/{blob}"]
    response = APIClient().get(urls(0)[0])
    assert response.status_code == 302
    assert response["Location"].startswith(
        f"{s3_server.endpoint}/{s3_server.bucket}/{prefix}node-{node.pk}/{blob}?"
    )
    downloaded = httpx.get(response["Location"])
    assert (downloaded.status_code, downloaded.content) == (200, DATA[0])

    # and: dropping the node's copies deletes the object
    with django_capture_on_commit_callbacks(execute=True):
        register(token, announcement(reachable=True))
    assert s3_server.keys(prefix) == []


def test_on_s3_a_part_of_another_size_is_found_missing_at_completion(
    behind_nat, settings, s3_server, django_capture_on_commit_callbacks
):
    node, token = behind_nat
    prefix = use_s3(settings, s3_server)
    [part] = begin(token, 2).json()["parts"]
    assert httpx.put(part["url"], content=DATA[2][:-1]).status_code == 200

    # when
    with django_capture_on_commit_callbacks(execute=True):
        answer = complete(token, 2)

    # then: S3 keeps parts of any size, so the control plane finds the part missing (not whole)
    assert (answer.status_code, answer.json()) == (
        400,
        {"detail": "parts not uploaded yet: 1", "missing": [1]},
    )
    assert rows() == [(2, "pending", 1000, digest(DATA[2]))]
    assert s3_server.keys(prefix) == []
