"""The embedded control plane's data directory holds secrets (the SQLite database with its password and token
hashes, the secret key, uploads): created by the real ``hypha-server`` and ``manage.py``, it is readable by its
owner only, and an API token issued on it is stored there only hashed."""

from __future__ import annotations

import stat
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tests.hypha_site.server_process import free_port, running_server, server_environment

ROOT = Path(__file__).resolve().parents[2]


def modes(data_dir: Path) -> dict[str, int]:
    """The permission bits of the data dir and of everything under it, by path relative to it."""
    found = {".": stat.S_IMODE(data_dir.stat().st_mode)}
    for path in data_dir.rglob("*"):
        found[str(path.relative_to(data_dir))] = stat.S_IMODE(path.lstat().st_mode)
    return found


@pytest.fixture
def server(tmp_path: Path):
    """``hypha-server`` (embedded default) on a fresh data dir; yields its URL and the data dir."""
    data_dir = tmp_path / "data"
    port = free_port()
    with running_server(["--port", str(port)], port=port, environment=server_environment(data_dir)):
        yield f"http://127.0.0.1:{port}", data_dir


def test_the_servers_data_files_are_private_and_hold_no_token(server):
    # given: the real server on a fresh data dir, and a token issued by the real command
    url, data_dir = server
    issued = subprocess.run(
        [sys.executable, "manage.py", "create_user_token", "alice"],
        cwd=ROOT,
        env=server_environment(data_dir),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert issued.returncode == 0, issued.stderr
    key = issued.stdout.strip()

    # when: the token is used over HTTP, and an upload lands in the data dir
    listed = httpx.get(f"{url}/api/jobs/", headers={"Authorization": f"Token {key}"}, timeout=10)
    uploaded = httpx.post(
        f"{url}/api/uploads/?name=weights.bin",
        content=b"private bytes",
        headers={"Authorization": f"Token {key}", "Content-Type": "application/octet-stream"},
        timeout=10,
    )

    # then
    assert (listed.status_code, uploaded.status_code) == (200, 201), uploaded.text
    found = modes(data_dir)
    assert {"hypha.sqlite3", "secret_key"} <= found.keys()
    assert any(name.startswith("uploads") for name in found), found
    directories = {name for name in found if (data_dir / name).is_dir()}
    assert {name: mode for name, mode in found.items() if name in directories} == dict.fromkeys(
        directories, 0o700
    )
    assert {name: mode for name, mode in found.items() if name not in directories} == dict.fromkeys(
        found.keys() - directories, 0o600
    )
    for path in data_dir.glob("hypha.sqlite3*"):  # the database and its WAL
        assert key.encode() not in path.read_bytes()


def test_manage_py_creates_a_private_database(tmp_path):
    # given: a data dir that does not exist yet
    data_dir = tmp_path / "fresh"

    # when
    result = subprocess.run(
        [sys.executable, "manage.py", "migrate", "--verbosity", "0"],
        cwd=ROOT,
        env=server_environment(data_dir),
        capture_output=True,
        text=True,
        timeout=120,
    )

    # then
    assert result.returncode == 0, result.stderr
    found = modes(data_dir)
    assert (found["."], found["hypha.sqlite3"], found["secret_key"]) == (0o700, 0o600, 0o600)


def test_an_existing_database_readable_by_others_is_made_private(tmp_path):
    # given: a data dir from an older install, its database readable by everyone
    data_dir = tmp_path / "old"
    data_dir.mkdir(mode=0o755)
    database = data_dir / "hypha.sqlite3"
    database.touch()
    database.chmod(0o644)

    # when
    result = subprocess.run(
        [sys.executable, "-c", "import django; django.setup()"],
        cwd=ROOT,
        env=server_environment(data_dir),
        capture_output=True,
        text=True,
        timeout=60,
    )

    # then: the files are the owner's only; the directory the operator made is left as it was
    assert result.returncode == 0, result.stderr
    found = modes(data_dir)
    assert (found["."], found["hypha.sqlite3"], found["secret_key"]) == (0o755, 0o600, 0o600)
