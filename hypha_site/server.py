"""``hypha-server``: migrate and start the control plane.

Embedded default (no ``DATABASE_URL``/``REDIS_URL``)::

    hypha-server                 # migrate, then daphne with the in-process task runner: one process, no servers

With the URLs set, one component per process (what docker compose runs)::

    hypha-server web             # migrate, then daphne (HTTP, REST API, admin, worker gateway)
    hypha-server worker          # a Celery worker (allocation, selection, renewals, expiry)
    hypha-server beat            # Celery beat (the market and lease clocks)
    hypha-server                 # all three as child processes, for a single machine

``web`` listens on ``--host``/``--port``, or on the Twisted endpoints given with ``--endpoint`` (repeatable), e.g.
daphne's own TLS: ``--endpoint ssl:443:privateKey=key.pem:certKey=crt.pem`` (docs/deploy.md).

Exit codes: 0 clean stop, 2 configuration error (the message names the variable), 3 a required service
(PostgreSQL, Redis) does not answer.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys

EXIT_CONFIG = 2
EXIT_SERVICE = 3


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hypha-server",
        description="Start the Hypha control plane (see the module docs for the two modes).",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="exit codes: 0 stopped cleanly · 2 configuration error · 3 PostgreSQL or Redis unreachable",
    )
    parser.add_argument(
        "component",
        nargs="?",
        choices=["web", "worker", "beat", "all"],
        default=None,
        help="one component (needs DATABASE_URL and REDIS_URL); default: everything",
    )
    parser.add_argument(
        "--host", default=os.environ.get("HYPHA_HOST", "127.0.0.1"), help="web: address to bind"
    )
    parser.add_argument(
        "--port", type=int, default=int(os.environ.get("HYPHA_PORT", "8000")), help="web: port"
    )
    parser.add_argument(
        "--endpoint",
        action="append",
        metavar="DESCRIPTION",
        help="web: a Twisted endpoint to listen on instead of --host/--port (repeatable), e.g. "
        "ssl:443:privateKey=key.pem:certKey=crt.pem for TLS, tcp:8000:interface=127.0.0.1, unix:/run/hypha.sock",
    )
    parser.add_argument(
        "--proxy-headers",
        action="store_true",
        help="web: take the client's address and scheme from X-Forwarded-For/-Port/-Proto (only behind a "
        "reverse proxy that sets them; anyone could forge them otherwise)",
    )
    parser.add_argument("--no-migrate", action="store_true", help="web: skip 'migrate' at start")
    parser.add_argument("--concurrency", type=int, default=2, help="worker: Celery worker processes")
    parser.add_argument("--log-level", default=os.environ.get("LOG_LEVEL", "INFO"))
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    # Everything the control plane writes (the SQLite database, uploads, models, checkpoints, the beat
    # schedule) is its own user's only; the components it starts as children inherit the mask.
    os.umask(0o077)
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "hypha_site.settings")
    os.environ["LOG_LEVEL"] = args.log_level.upper()
    try:
        import django
        from django.conf import settings

        django.setup()
    except Exception as error:  # ImproperlyConfigured and friends: say what is wrong, no traceback
        print(f"hypha-server: configuration error: {error}", file=sys.stderr)
        return EXIT_CONFIG

    component = args.component
    if settings.EMBEDDED_TRANSPORTS:
        if component in {"worker", "beat"}:
            print(
                f"hypha-server: '{component}' needs REDIS_URL (the embedded default runs tasks inside 'web')",
                file=sys.stderr,
            )
            return EXIT_CONFIG
        return _web(args, embedded=True)
    if not _services_answer(settings):
        return EXIT_SERVICE
    if component == "web":
        return _web(args, embedded=False)
    if component == "worker":
        return _celery(
            [
                "worker",
                "--concurrency",
                str(args.concurrency),
                "--loglevel",
                args.log_level,
                "--without-gossip",
                "--without-mingle",
            ]
        )
    if component == "beat":
        beat_dir = settings.HYPHA_DATA_DIR
        beat_dir.mkdir(parents=True, exist_ok=True)
        return _celery(
            ["beat", "--loglevel", args.log_level, "--schedule", str(beat_dir / "celerybeat-schedule")]
        )
    return _all(args)


def _web(args, *, embedded: bool) -> int:
    from django.conf import settings
    from django.core.management import call_command

    if not args.no_migrate:
        _migrate(call_command)
    from daphne.endpoints import build_endpoint_description_strings

    from hypha_site.asgi import application
    from hypha_site.http_body import Server  # daphne's, reading request bodies chunk by chunk
    from hypha_site.http_deadline import with_header_deadline  # slowloris: headers within a deadline

    mode = "embedded (SQLite, in-process tasks)" if embedded else "services (PostgreSQL, Redis)"
    if args.endpoint:
        endpoints = list(args.endpoint)
        print(f"hypha-server: control plane on {', '.join(endpoints)} — {mode}", flush=True)
    else:
        endpoints = build_endpoint_description_strings(host=args.host, port=args.port)
        print(f"hypha-server: control plane on http://{args.host}:{args.port}/ — {mode}", flush=True)
    proxy = args.proxy_headers
    with_header_deadline(Server)(
        header_timeout=settings.HYPHA_HTTP_HEADER_TIMEOUT,
        application=application,
        endpoints=endpoints,
        proxy_forwarded_address_header="X-Forwarded-For" if proxy else None,
        proxy_forwarded_port_header="X-Forwarded-Port" if proxy else None,
        proxy_forwarded_proto_header="X-Forwarded-Proto" if proxy else None,
        websocket_timeout=-1,  # daemons hold their connection for days; liveness is the ping below
        ping_interval=10,
        ping_timeout=30,
        # The consumer refuses frames above HYPHA_WS_MAX_MESSAGE_BYTES with an error frame; far larger
        # ones are cut off by the websocket layer before they are buffered.
        websocket_max_message_size=4 * settings.HYPHA_WS_MAX_MESSAGE_BYTES,
        ready_callable=(_start_runner if embedded else None),
        application_close_timeout=5,
        verbosity=0,
    ).run()
    return 0


#: The PostgreSQL advisory lock ``migrate`` runs under (any constant: only hypha-server takes it).
MIGRATE_LOCK = 0x6879_7068_61  # "hypha"


def _migrate(call_command) -> None:
    """Apply the migrations. Several web processes started at once (a scaled-out deployment) take turns on
    PostgreSQL: Django's ``migrate`` is not safe to run concurrently (both would create the same tables, and one
    process would exit); the later ones then find nothing to do."""
    from django.db import connection

    if connection.vendor != "postgresql":
        call_command("migrate", interactive=False, verbosity=0)
        return
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_advisory_lock(%s)", [MIGRATE_LOCK])
        try:
            call_command("migrate", interactive=False, verbosity=0)
        finally:
            cursor.execute("SELECT pg_advisory_unlock(%s)", [MIGRATE_LOCK])


def _start_runner() -> None:
    import asyncio

    from hypha_site.runtime import EmbeddedRunner

    EmbeddedRunner.start(asyncio.get_event_loop())


def _celery(arguments: list[str]) -> int:
    from hypha_site.celery import app

    app.start(argv=arguments)
    return 0


def _all(args) -> int:
    """Run web, worker and beat as child processes; stop all when one stops or on SIGTERM/SIGINT."""
    base = [sys.executable, "-m", "hypha_site.server", "--log-level", args.log_level]
    web = [*base, "web", "--host", args.host, "--port", str(args.port)]
    web += [f"--endpoint={endpoint}" for endpoint in args.endpoint or ()]
    web += ["--proxy-headers"] if args.proxy_headers else []
    web += ["--no-migrate"] if args.no_migrate else []
    children = [
        subprocess.Popen(web),
        subprocess.Popen([*base, "worker", "--concurrency", str(args.concurrency)]),
        subprocess.Popen([*base, "beat"]),
    ]

    def stop(*_):
        for child in children:
            if child.poll() is None:
                child.terminate()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    try:
        os.wait()  # the first child to stop brings the others down
    except ChildProcessError:
        pass
    stop()
    codes = [child.wait() for child in children]
    return max(codes, default=0) if any(codes) else 0


def _services_answer(settings) -> bool:
    from django.db import connection
    from django.db.utils import OperationalError

    try:
        connection.ensure_connection()
    except OperationalError as error:
        print(f"hypha-server: cannot reach the database at DATABASE_URL: {error}".strip(), file=sys.stderr)
        return False
    import redis

    try:
        redis.Redis.from_url(settings.REDIS_URL, socket_connect_timeout=3).ping()
    except redis.RedisError as error:
        print(f"hypha-server: cannot reach Redis at REDIS_URL: {error}", file=sys.stderr)
        return False
    return True


if __name__ == "__main__":
    sys.exit(main())
