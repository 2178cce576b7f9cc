"""Celery tasks of the datasets app. Thin: each takes plain values, is idempotent, and calls the store or a
service. The deletions are queued on commit by :mod:`apps.datasets.publishing`, after the rows are gone; the
sweep runs with the relay's (``apps.relay.tasks.sweep_relay``), whose store the published slices share."""

from __future__ import annotations

from celery import shared_task

from apps.datasets import publishing
from apps.relay.exceptions import StoreError
from apps.relay.stores import Blob


@shared_task(
    name="apps.datasets.tasks.delete_published_blobs",
    autoretry_for=(StoreError,),
    retry_backoff=10,
    max_retries=5,
)
def delete_published_blobs(blobs: list[list[str]]) -> int:
    """Delete the bytes of these published slices (``[namespace, blob, upload id]`` each), pending or complete."""
    target = publishing.store()
    for value in blobs:
        target.delete(Blob.from_list(value))
    return len(blobs)


@shared_task(name="apps.datasets.tasks.sweep_published_slices")
def sweep_published_slices() -> dict:
    return publishing.sweep()
