"""The relay's object stores (``HYPHA_RELAY_STORE``): :class:`LocalStore` and :class:`S3Store` behind one
interface (:class:`~apps.relay.stores.base.Store`)."""

from __future__ import annotations

import threading
from pathlib import Path

from django.conf import settings

from apps.relay.stores.base import CHUNK, Blob, Store
from apps.relay.stores.local import LocalStore
from apps.relay.stores.s3 import S3Store

__all__ = ["CHUNK", "Blob", "LocalStore", "S3Store", "Store", "get_store"]

_lock = threading.Lock()
_current: tuple[tuple, Store] | None = None


def get_store() -> Store:
    """The configured store; made again when the settings it is built from change (tests override them)."""
    global _current
    configuration = (
        settings.HYPHA_RELAY_STORE,
        str(settings.HYPHA_DATA_DIR),
        settings.SECRET_KEY,
        settings.HYPHA_RELAY_S3_ENDPOINT,
        settings.HYPHA_RELAY_S3_BUCKET,
        settings.HYPHA_RELAY_S3_REGION,
        settings.HYPHA_RELAY_S3_ACCESS_KEY_ID,
        settings.HYPHA_RELAY_S3_SECRET_ACCESS_KEY,
        settings.HYPHA_RELAY_S3_PREFIX,
    )
    with _lock:
        if _current is None or _current[0] != configuration:
            _current = (configuration, _build(configuration))
        return _current[1]


def _build(configuration: tuple) -> Store:
    kind, data_dir, secret_key, endpoint, bucket, region, access_key_id, secret_access_key, prefix = (
        configuration
    )
    if kind == "s3":
        return S3Store(
            bucket=bucket,
            endpoint=endpoint,
            region=region or "us-east-1",
            access_key_id=access_key_id,
            secret_access_key=secret_access_key,
            prefix=prefix or "",
        )
    return LocalStore(Path(data_dir) / "relay", secret_key)
