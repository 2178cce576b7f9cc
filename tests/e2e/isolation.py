"""Keeping test and benchmark runs apart from each other and from the machine: used by tests/e2e/conftest.py
and bench/harness.py.

* :func:`stop_with_parent` — children die with the process that started them, even when it is SIGKILLed.
* :func:`free_port` — a loopback port for a control plane.
* :func:`throwaway_database` / :func:`claimed_redis_database` — a private PostgreSQL database and Redis
  database number per run, cleaned up at the end, and after a run that was killed, by the next one.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import socket
from collections.abc import Iterator
from urllib.parse import urlsplit, urlunsplit

from worker_daemon.jobs import die_with_parent


def stop_with_parent() -> None:
    """Run in each child between fork and exec: the kernel SIGKILLs it if the process that started it dies.

    Children lead their own sessions, so nothing else would reach them when the parent is killed outright
    (SIGKILL, an OOM kill, a CI job cancelled): without this they outlive it, holding ports and databases.
    The daemon's own mechanism for its tasks, with SIGKILL.
    """
    die_with_parent(signal.SIGKILL)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _with_path(url: str, path: str) -> str:
    parts = urlsplit(url)
    return urlunsplit(parts._replace(path=path))


def _owner() -> str:
    """Who holds a throw-away database or a claimed Redis database: this host and process."""
    return f"{socket.gethostname()} {os.getpid()}"


def _abandoned(owner: str | None) -> bool:
    """True if ``owner`` (see :func:`_owner`) is a process of this host that no longer runs.

    A run killed outright (SIGKILL) cannot drop its database or flush its Redis database; the next run does.
    """
    host, _, pid = (owner or "").partition(" ")
    if host != socket.gethostname() or not pid.isdigit():
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


@contextlib.contextmanager
def throwaway_database(database_url: str, *, prefix: str = "hypha_e2e") -> Iterator[str]:
    """A fresh database ``<prefix>_<random>`` on the server of ``database_url``; yields its URL, drops it.

    The database's comment names its owner; databases of owners that died are dropped first.
    """
    import psycopg
    from psycopg import sql

    name = f"{prefix}_{secrets.token_hex(4)}"
    maintenance = _with_path(database_url, "/postgres")
    with psycopg.connect(maintenance, autocommit=True, connect_timeout=5) as connection:
        pattern = prefix.replace("_", "\\_") + "\\_%"
        leftovers = connection.execute(
            "SELECT datname, shobj_description(oid, 'pg_database') FROM pg_database WHERE datname LIKE %s",
            (pattern,),
        ).fetchall()
        for leftover, owner in leftovers:
            if _abandoned(owner):
                connection.execute(f'DROP DATABASE IF EXISTS "{leftover}" WITH (FORCE)')
        connection.execute(f'CREATE DATABASE "{name}"')
        connection.execute(
            sql.SQL("COMMENT ON DATABASE {} IS {}").format(sql.Identifier(name), sql.Literal(_owner()))
        )
    try:
        yield _with_path(database_url, f"/{name}")
    finally:
        with psycopg.connect(maintenance, autocommit=True, connect_timeout=5) as connection:
            # FORCE: a connection a killed child left half-open must not keep the database alive.
            connection.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


#: One key for every run (e2e tests and benchmarks alike), so two runs never claim the same database.
CLAIM_KEY = "hypha:claimed-by-a-run"


@contextlib.contextmanager
def claimed_redis_database(redis_url: str) -> Iterator[str]:
    """An empty Redis database number for this run (not the one ``redis_url`` names, not 0); yields its URL.

    The claim is a key set with NX in an empty database, so two concurrent runs never pick the same one; its
    value names the owner, and a database claimed by an owner that died is flushed and claimed again. The
    database is flushed at the end. When every database is in use, the one of ``redis_url`` is flushed and
    used instead.
    """
    import redis

    parts = urlsplit(redis_url)
    configured = int(parts.path.strip("/") or 0)
    admin = redis.Redis.from_url(redis_url, socket_connect_timeout=5)
    try:
        count = int(admin.config_get("databases").get("databases", 16))
    except redis.RedisError:
        count = 16
    chosen = None
    for number in [n for n in range(count - 1, 0, -1) if n != configured]:
        client = redis.Redis.from_url(_with_path(redis_url, f"/{number}"), socket_connect_timeout=5)
        try:
            claim = client.get(CLAIM_KEY)
            if claim is not None and _abandoned(claim.decode(errors="replace")):
                client.flushdb()
            if client.dbsize() == 0 and client.set(CLAIM_KEY, _owner(), nx=True):
                if client.dbsize() == 1:
                    chosen = number
                    break
                client.delete(CLAIM_KEY)  # someone else started using it meanwhile
        finally:
            client.close()
    if chosen is None:
        chosen = configured
        admin.flushdb()
    admin.close()
    url = _with_path(redis_url, f"/{chosen}")
    try:
        yield url
    finally:
        client = redis.Redis.from_url(url, socket_connect_timeout=5)
        with contextlib.suppress(redis.RedisError):
            client.flushdb()
        client.close()
