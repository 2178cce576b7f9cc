"""Fixtures of the relay tests: the cast (:mod:`tests.apps.relay.world`), the local store in a temporary
directory with small parts, and a real S3 server on loopback (``rclone serve s3``) for the S3 store."""

from __future__ import annotations

import pytest

from tests.apps.relay.world import S3Server, make_world, start_s3_server, use_s3

#: Parts of the local store in these tests: small, so a few hundred KiB make several parts.
LOCAL_PART_SIZE = 64 << 10


@pytest.fixture
def world(db):
    return make_world()


@pytest.fixture(autouse=True)
def local_relay(settings, tmp_path):
    """Every relay test starts on the local store in its own directory, with small parts."""
    settings.HYPHA_DATA_DIR = tmp_path
    settings.HYPHA_RELAY_STORE = "local"
    settings.HYPHA_RELAY_PART_SIZE = LOCAL_PART_SIZE
    settings.HYPHA_RELAY_URL_LIFETIME = 900
    return tmp_path


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory) -> S3Server:
    yield from start_s3_server(tmp_path_factory.mktemp("s3"))


@pytest.fixture
def on_s3(settings, s3_server) -> str:
    """The relay on the test S3 server (5 MiB parts); the key prefix of this test's objects."""
    return use_s3(settings, s3_server)
