"""Celery tasks of the relay. Thin: each takes plain values, is idempotent, and calls the store or a service.

``sweep_relay`` runs every ``HYPHA_RELAY_SWEEP_INTERVAL`` seconds (beat, or the embedded runner); the
deletions are queued on commit by :mod:`apps.relay.services`, after the rows are gone. A store that fails is
retried with backoff under Celery (in the embedded runner a failure is logged; the local store's orphan
sweep catches what is left).
"""

from __future__ import annotations

from celery import shared_task

from apps.datasets import publishing
from apps.relay import services
from apps.relay.exceptions import StoreError
from apps.relay.stores import Blob, get_store


@shared_task(
    name="apps.relay.tasks.delete_blobs",
    autoretry_for=(StoreError,),
    retry_backoff=10,
    max_retries=5,
)
def delete_blobs(blobs: list[list[str]]) -> int:
    """Delete the bytes of these uploads (``[job, blob, upload id]`` each), pending or complete."""
    store = get_store()
    for value in blobs:
        store.delete(Blob.from_list(value))
    return len(blobs)


@shared_task(
    name="apps.relay.tasks.delete_job_bytes",
    autoretry_for=(StoreError,),
    retry_backoff=10,
    max_retries=5,
)
def delete_job_bytes(job_id: str, pending: list[list[str]]) -> None:
    """Delete every byte the relay holds for a job (``pending``: its uploads still open in the store)."""
    get_store().delete_job(job_id, [Blob.from_list(value) for value in pending])


@shared_task(name="apps.relay.tasks.sweep_relay")
def sweep_relay() -> dict:
    # Data nodes' published slices share the store and its clock (apps/datasets/publishing.py).
    return {**services.sweep(), **publishing.sweep()}
