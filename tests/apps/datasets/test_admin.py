"""The datasets admin: every model's pages render, and nothing can be added, changed or deleted there."""

from __future__ import annotations

import pytest
from django.test import Client

from apps.datasets import services
from apps.datasets.models import DataNode, Dataset, DatasetReplica, JobSlice, Slice, SliceEvent

MODELS = [Dataset, DataNode, DatasetReplica, Slice, JobSlice, SliceEvent]


@pytest.fixture
def admin_client(operator) -> Client:
    client = Client()
    client.force_login(operator.user)
    return client


@pytest.fixture
def claimed(prepared_job, lease_a):
    services.claim_next(prepared_job, lease_a)
    return prepared_job


def page(model, suffix: str = "") -> str:
    return f"/admin/{model._meta.app_label}/{model._meta.model_name}/{suffix}"


@pytest.mark.parametrize("model", MODELS, ids=lambda model: model.__name__)
def test_every_models_list_and_page_render(admin_client, claimed, model):
    # given
    instance = model.objects.first()

    # when
    listed = admin_client.get(page(model))
    shown = admin_client.get(page(model, f"{instance.pk}/change/"))

    # then
    assert (listed.status_code, shown.status_code) == (200, 200)
    assert "token_hash" not in shown.content.decode()


@pytest.mark.parametrize("model", MODELS, ids=lambda model: model.__name__)
def test_nothing_is_added_or_deleted_in_the_admin(admin_client, claimed, model):
    # given
    instance = model.objects.first()
    before = list(model.objects.order_by("pk").values())

    # when
    added = admin_client.get(page(model, "add/"))
    deleted = admin_client.post(page(model, f"{instance.pk}/delete/"), {"post": "yes"})

    # then
    assert (added.status_code, deleted.status_code) == (403, 403)
    assert list(model.objects.order_by("pk").values()) == before
