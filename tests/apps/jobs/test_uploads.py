"""Uploads: a model file a user puts on the control plane, named by a job's ``upload`` source, fetched by the
job's parameter server with its transfer token."""

from __future__ import annotations

import hashlib
import uuid

import pytest
from rest_framework.test import APIClient

from apps.datasets import services as dataset_services
from apps.jobs import training
from apps.jobs.models import Job, Task, Upload
from tests.apps.jobs.test_training import SPEC

UPLOAD_SPEC = {**SPEC, "model": {**SPEC["model"], "source": {"type": "upload", "file": "tiny.zip"}}}
UPLOAD_SPEC.pop("evaluation")


def upload(persona, body: bytes = b"PK fake zip", name: str = "tiny.zip"):
    return persona.client.post(f"/api/uploads/?name={name}", body, content_type="application/octet-stream")


@pytest.fixture
def tiny_text(db):
    node, _ = dataset_services.create_data_node(name="data-east", url="http://east.example:8100")
    dataset_services.register_dataset(node, "tiny-text", [(index, 100, "a" * 64) for index in range(4)])


@pytest.mark.django_db
def test_an_upload_is_stored_with_its_digest_and_listed_for_its_owner_only(alice, bob, settings):
    # when
    response = upload(alice, b"model bytes")

    # then
    assert response.status_code == 201, response.content
    body = response.json()
    stored = Upload.objects.get(pk=body["id"])
    assert (body["name"], body["size"], body["sha256"]) == (
        "tiny.zip",
        11,
        hashlib.sha256(b"model bytes").hexdigest(),
    )
    assert stored.path.read_bytes() == b"model bytes"
    assert [entry["id"] for entry in alice.client.get("/api/uploads/").json()["results"]] == [body["id"]]
    assert bob.client.get("/api/uploads/").json()["results"] == []
    assert bob.client.get(f"/api/uploads/{body['id']}/content/").status_code == 404
    owner_download = alice.client.get(f"/api/uploads/{body['id']}/content/")
    assert b"".join(owner_download.streaming_content) == b"model bytes"


@pytest.mark.django_db
def test_an_upload_is_downloaded_as_opaque_bytes_whatever_its_name(alice):
    # given
    created = upload(alice, b"PK fake zip", name="tiny.zip").json()

    # when
    response = alice.client.get(f"/api/uploads/{created['id']}/content/")

    # then: the content type the schema documents, not one guessed from ".zip"
    assert response.status_code == 200
    assert response["Content-Type"] == "application/octet-stream"
    assert response["Content-Disposition"] == 'attachment; filename="tiny.zip"'
    assert b"".join(response.streaming_content) == b"PK fake zip"


@pytest.mark.django_db
def test_a_malformed_upload_id_is_a_404_not_a_server_error(alice):
    # when: the content route takes any path segment as the id
    response = alice.client.get("/api/uploads/null,null/content/")

    # then (it was a 500: the id went to the database as a UUID)
    assert response.status_code == 404
    assert response.json() == {"detail": "No such upload."}


@pytest.mark.django_db
def test_a_bad_upload_name_is_refused_and_nothing_is_stored(alice, settings):
    uploads = settings.HYPHA_DATA_DIR / "uploads"
    before = set(uploads.iterdir()) if uploads.exists() else set()

    response = upload(alice, name="../escape")

    assert response.status_code == 400
    assert list(response.json()) == ["name"]
    assert not Upload.objects.exists()
    assert (set(uploads.iterdir()) if uploads.exists() else set()) == before


@pytest.mark.django_db
def test_a_spec_naming_an_upload_pins_its_id_and_an_unknown_one_is_refused(alice, bob, tiny_text):
    # an upload bob does not have is refused for him
    refused = bob.client.post("/api/jobs/diloco/", UPLOAD_SPEC, format="json")
    assert refused.status_code == 400
    assert list(refused.json()) == ["model.source.file"]

    # alice's upload, named by its file name, is pinned to its id
    upload_id = upload(alice).json()["id"]
    created = alice.client.post("/api/jobs/diloco/", UPLOAD_SPEC, format="json")
    assert created.status_code == 201, created.content
    assert Job.objects.get(pk=created.json()["id"]).spec["model"]["source"] == {
        "type": "upload",
        "file": upload_id,
    }


@pytest.mark.django_db
def test_the_parameter_server_of_a_job_built_from_an_upload_may_download_it(
    alice, tiny_text, online_rigs, sent, django_capture_on_commit_callbacks
):
    # given: a job on alice's upload, allocated, its parameter server dispatched
    from apps.jobs import services as job_services
    from apps.jobs.models import PARAMETER_SERVER, TRAINER
    from tests.apps.conftest import advert, offer_on
    from tests.apps.jobs.test_training import dispatches

    upload_id = upload(alice, b"the model").json()["id"]
    with django_capture_on_commit_callbacks(execute=True):
        job_id = alice.client.post("/api/jobs/diloco/", UPLOAD_SPEC, format="json").json()["id"]
    job = Job.objects.get(pk=job_id)
    rig_a, rig_b, rig_c = online_rigs
    with django_capture_on_commit_callbacks(execute=True):
        job_services.offer_made(worker=rig_a, message=offer_on(advert(job, TRAINER), price=120.0))
        job_services.offer_made(worker=rig_b, message=offer_on(advert(job, TRAINER), price=125.0))
        job_services.offer_made(worker=rig_c, message=offer_on(advert(job, PARAMETER_SERVER), price=100.0))
    dispatch = dispatches(sent)[PARAMETER_SERVER]
    source = dispatch.spec["executor"]["config"]["model"]["source"]
    assert source == {"type": "uri", "value": f"/api/uploads/{upload_id}/content/"}

    anonymous = APIClient()

    def fetch(token: str | None):
        headers = {"HTTP_AUTHORIZATION": f"Bearer {token}"} if token else {}
        return anonymous.get(source["value"], **headers)

    # then: the parameter server's token reads it; a trainer's token, a forged one or none do not
    allowed = fetch(dispatch.transfer_token)
    assert allowed.status_code == 200 and b"".join(allowed.streaming_content) == b"the model"
    trainer_lease = job.leases.get(worker=rig_a)
    assert fetch(training.transfer_token(trainer_lease)).status_code == 403
    assert fetch(dispatch.transfer_token[:-4] + "AAAA").status_code == 401
    assert fetch(None).status_code == 401
    assert Task.objects.filter(job=job).count() == 3  # the parameter server and both trainers


# --- delete and quotas (issue 12, finding 6) -------------------------------------------------------------


def stored_files(settings) -> set[str]:
    """Every file under the uploads directory, partial ones included."""
    uploads = settings.HYPHA_DATA_DIR / "uploads"
    return {path.name for path in uploads.iterdir()} if uploads.exists() else set()


@pytest.mark.django_db
def test_an_owner_deletes_an_upload_and_its_file_goes_with_it(
    alice, settings, django_capture_on_commit_callbacks
):
    # given
    created = upload(alice, b"model bytes").json()
    path = Upload.objects.get(pk=created["id"]).path

    # when
    with django_capture_on_commit_callbacks(execute=True):
        response = alice.client.delete(f"/api/uploads/{created['id']}/")

    # then
    assert response.status_code == 204, response.content
    assert not Upload.objects.filter(pk=created["id"]).exists()
    assert not path.exists()
    assert alice.client.get(f"/api/uploads/{created['id']}/").status_code == 404


@pytest.mark.django_db
def test_a_stranger_cannot_delete_an_upload_and_nothing_changes(alice, bob, settings):
    # given
    created = upload(alice, b"model bytes").json()
    files = stored_files(settings)

    # when
    response = bob.client.delete(f"/api/uploads/{created['id']}/")

    # then: as for downloads, someone else's upload is not disclosed
    assert response.status_code == 404
    assert response.json() == {"detail": "No such upload."}
    assert Upload.objects.get(pk=created["id"]).path.read_bytes() == b"model bytes"
    assert stored_files(settings) == files
    assert bob.client.delete("/api/uploads/not-a-uuid/").status_code == 404


@pytest.mark.django_db
def test_staff_may_delete_anyones_upload(alice, operator, django_capture_on_commit_callbacks):
    created = upload(alice, b"model bytes").json()
    path = Upload.objects.get(pk=created["id"]).path

    with django_capture_on_commit_callbacks(execute=True):
        response = operator.client.delete(f"/api/uploads/{created['id']}/")

    assert response.status_code == 204
    assert not Upload.objects.filter(pk=created["id"]).exists()
    assert not path.exists()


@pytest.mark.django_db
def test_an_upload_an_unfinished_job_is_built_from_cannot_be_deleted(
    alice, tiny_text, settings, django_capture_on_commit_callbacks
):
    # given: a pending job on alice's upload
    upload_id = upload(alice, b"the model").json()["id"]
    job_id = alice.client.post("/api/jobs/diloco/", UPLOAD_SPEC, format="json").json()["id"]
    files = stored_files(settings)

    # when
    refused = alice.client.delete(f"/api/uploads/{upload_id}/")

    # then
    assert refused.status_code == 409
    assert refused.json() == {"detail": f"job {job_id} (pending) is built from this upload; it can be deleted "
                              "once that job has ended"}  # fmt: skip
    assert Upload.objects.get(pk=upload_id).path.read_bytes() == b"the model"
    assert stored_files(settings) == files

    # and once the job has ended, it can
    Job.objects.filter(pk=job_id).update(status=Job.Status.CANCELLED)
    with django_capture_on_commit_callbacks(execute=True):
        assert alice.client.delete(f"/api/uploads/{upload_id}/").status_code == 204
    assert not Upload.objects.filter(pk=upload_id).exists()


@pytest.mark.django_db
def test_an_upload_past_the_byte_quota_is_refused_and_nothing_is_stored(
    alice, bob, settings, django_capture_on_commit_callbacks
):
    # given: a quota of 20 bytes, 11 of them used
    settings.HYPHA_UPLOAD_QUOTA_BYTES = 20
    first = upload(alice, b"model bytes").json()
    files = stored_files(settings)

    # when
    refused = upload(alice, b"more bytes!")

    # then
    assert refused.status_code == 413
    assert refused.json() == {
        "detail": "this upload would exceed your upload quota of 20 bytes (11 used); delete uploads you no "
        "longer need with DELETE /api/uploads/<id>/"
    }
    assert list(Upload.objects.values_list("id", flat=True)) == [uuid.UUID(first["id"])]
    assert stored_files(settings) == files

    # the quota is per user, and deleting frees it
    assert upload(bob, b"bobs bytes!").status_code == 201
    with django_capture_on_commit_callbacks(execute=True):
        assert alice.client.delete(f"/api/uploads/{first['id']}/").status_code == 204
    assert upload(alice, b"more bytes!").status_code == 201


@pytest.mark.django_db
def test_an_upload_past_the_count_quota_is_refused_and_nothing_is_stored(alice, settings):
    settings.HYPHA_UPLOAD_QUOTA_COUNT = 1
    upload(alice, b"model bytes")
    files = stored_files(settings)

    refused = upload(alice, b"x")

    assert refused.status_code == 413
    assert refused.json() == {
        "detail": "you have 1 upload, the most allowed; delete uploads you no longer need with "
        "DELETE /api/uploads/<id>/"
    }
    assert Upload.objects.count() == 1
    assert stored_files(settings) == files


@pytest.mark.django_db
def test_an_upload_past_the_file_cap_is_refused_and_nothing_is_stored(alice, settings):
    settings.HYPHA_MAX_UPLOAD_BYTES = 10
    files = stored_files(settings)

    refused = upload(alice, b"model bytes")

    assert refused.status_code == 413
    assert refused.json() == {"detail": "the file exceeds 10 bytes"}
    assert not Upload.objects.exists()
    assert stored_files(settings) == files


@pytest.mark.django_db
def test_a_body_of_unknown_length_is_stopped_at_the_quota_while_it_streams(alice, settings):
    # given: 9 bytes of room left, and a body without a declared length (a chunked request)
    from apps.jobs.exceptions import TransferRefused

    settings.HYPHA_UPLOAD_QUOTA_BYTES = 20
    upload(alice, b"model bytes")
    files = stored_files(settings)
    sent = []

    def chunks():
        for chunk in (b"12345", b"67890", b"never read"):
            sent.append(chunk)
            yield chunk

    # when
    with pytest.raises(TransferRefused) as refused:
        training.store_upload(alice.user, "more.bin", chunks(), limit=1 << 20)

    # then: refused at the chunk that passed the quota, in the quota's words
    assert refused.value.status == 413
    assert str(refused.value) == (
        "this upload would exceed your upload quota of 20 bytes (11 used); delete uploads you no longer "
        "need with DELETE /api/uploads/<id>/"
    )
    assert sent == [b"12345", b"67890"]
    assert Upload.objects.count() == 1
    assert stored_files(settings) == files
