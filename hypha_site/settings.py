"""Settings for the Hypha control plane, read from the environment in this one file.

Two shapes of the same code:

* **Embedded default** — neither ``DATABASE_URL`` nor ``REDIS_URL`` set: SQLite in ``HYPHA_DATA_DIR``, the
  in-memory channel layer, and Celery tasks run by the in-process runner of the daphne process
  (:mod:`hypha_site.runtime`). ``hypha-server`` starts everything in one command, no servers needed.
* **Services** — ``DATABASE_URL`` (PostgreSQL through psycopg 3) and ``REDIS_URL`` (Celery broker and
  channels_redis): separate daphne, Celery worker and Celery beat processes (``hypha-server web|worker|beat``).

Every invalid value raises ``ImproperlyConfigured`` naming the variable, at start.
Secrets can also be given as ``<NAME>_FILE`` (a path whose contents are the value).
"""

from __future__ import annotations

import os
import re
import secrets
from pathlib import Path
from urllib.parse import urlparse

from django.core.exceptions import ImproperlyConfigured

BASE_DIR = Path(__file__).resolve().parent.parent


def env_str(name: str, default: str | None = None) -> str | None:
    """The value of ``name``, or of the file named by ``name_FILE``, or ``default``."""
    file_name = os.environ.get(f"{name}_FILE")
    if file_name:
        try:
            return Path(file_name).read_text().strip()
        except OSError as error:
            raise ImproperlyConfigured(f"{name}_FILE={file_name!r} cannot be read: {error}") from None
    value = os.environ.get(name)
    if value is None or value == "":
        return default
    return value


def env_bool(name: str, default: bool) -> bool:
    value = env_str(name)
    if value is None:
        return default
    lowered = value.strip().lower()
    if lowered in {"1", "true", "yes", "on"}:
        return True
    if lowered in {"0", "false", "no", "off"}:
        return False
    raise ImproperlyConfigured(f"{name}={value!r} is not a boolean (use true/false, 1/0, yes/no, on/off)")


def env_float(name: str, default: float, *, minimum: float, maximum: float) -> float:
    value = env_str(name)
    if value is None:
        return default
    try:
        number = float(value)
    except ValueError:
        raise ImproperlyConfigured(f"{name}={value!r} is not a number") from None
    if not minimum <= number <= maximum:
        raise ImproperlyConfigured(f"{name}={value!r} must be between {minimum} and {maximum}")
    return number


def env_int(name: str, default: int, *, minimum: int, maximum: int) -> int:
    value = env_str(name)
    if value is None:
        return default
    try:
        number = int(value)
    except ValueError:
        raise ImproperlyConfigured(f"{name}={value!r} is not an integer") from None
    if not minimum <= number <= maximum:
        raise ImproperlyConfigured(f"{name}={value!r} must be between {minimum} and {maximum}")
    return number


def env_list(name: str, default: list[str]) -> list[str]:
    value = env_str(name)
    if value is None:
        return default
    items = [item.strip() for item in value.split(",") if item.strip()]
    if not items:
        raise ImproperlyConfigured(f"{name}={value!r} is empty; give a comma-separated list")
    return items


#: IMMEDIATE transactions take SQLite's write lock at BEGIN, so two writers queue instead of failing with
#: "database is locked" when both upgrade from a read. WAL with synchronous=NORMAL commits without an fsync
#: per transaction (durable across a process crash; a power cut may lose the last commits), which keeps
#: the market's many small transactions fast (docs/benchmarks.md).
SQLITE_OPTIONS = {
    "transaction_mode": "IMMEDIATE",
    "timeout": 20,
    "init_command": "PRAGMA journal_mode=WAL; PRAGMA synchronous=NORMAL;",
}


def database_from_url(url: str) -> dict:
    """A Django DATABASES entry for a ``postgres://`` / ``postgresql://`` or ``sqlite:///`` URL."""
    import dj_database_url

    scheme = urlparse(url).scheme
    if scheme not in {"postgres", "postgresql", "pgsql", "sqlite"}:
        raise ImproperlyConfigured(
            f"DATABASE_URL scheme {scheme!r} is not supported; use postgresql://user@host:5432/name "
            "(or sqlite:////absolute/path.sqlite3)"
        )
    try:
        config = dj_database_url.parse(url, conn_max_age=60, conn_health_checks=True)
    except ValueError as error:
        raise ImproperlyConfigured(f"DATABASE_URL is not a valid database URL: {error}") from None
    if config["ENGINE"] == "django.db.backends.postgresql" and not config.get("NAME"):
        raise ImproperlyConfigured("DATABASE_URL names no database (add /<name> to the URL)")
    if config["ENGINE"] == "django.db.backends.sqlite3":
        config["OPTIONS"] = SQLITE_OPTIONS
        config["CONN_MAX_AGE"] = 0
    return config


def redis_url_checked(url: str) -> str:
    parsed = urlparse(url)
    if parsed.scheme not in {"redis", "rediss", "unix"}:
        raise ImproperlyConfigured(
            f"REDIS_URL scheme {parsed.scheme!r} is not supported; use redis://host:6379/0"
        )
    if parsed.scheme != "unix" and not parsed.hostname:
        raise ImproperlyConfigured(f"REDIS_URL={url!r} names no host")
    try:
        parsed.port  # noqa: B018 - raises ValueError on a bad port
    except ValueError:
        raise ImproperlyConfigured(f"REDIS_URL={url!r} has an invalid port") from None
    return url


# --- mode ---------------------------------------------------------------------------------------------

DATABASE_URL = env_str("DATABASE_URL")
REDIS_URL = env_str("REDIS_URL")
if REDIS_URL:
    REDIS_URL = redis_url_checked(REDIS_URL)
#: True when Celery tasks and websocket fan-out stay inside the daphne process (no Redis).
EMBEDDED_TRANSPORTS = not REDIS_URL

HYPHA_DATA_DIR = Path(env_str("HYPHA_DATA_DIR", str(Path.cwd() / ".hypha"))).expanduser().resolve()
try:  # the SQLite database, uploads, models and checkpoints live here, whatever else is configured
    # Its owner's only when we create it (0700): it holds the secret key and the database. A directory the
    # operator made is left as they made it; the files in it are private anyway (private_file, hypha-server's
    # umask).
    HYPHA_DATA_DIR.mkdir(parents=True, exist_ok=True, mode=0o700)
except OSError as error:
    raise ImproperlyConfigured(f"HYPHA_DATA_DIR={str(HYPHA_DATA_DIR)!r} cannot be created: {error}") from None


def private_file(path: Path) -> None:
    """Make ``path`` readable by its owner only: created empty with mode 0600 if missing (never briefly
    readable by others), else stripped of group and other permission bits (an older install made 0644 ones)."""
    try:
        descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    except FileExistsError:
        mode = path.stat().st_mode & 0o777
        if mode & 0o077:
            path.chmod(mode & 0o700)
    else:
        os.close(descriptor)


DEBUG = env_bool("DEBUG", default=False)


def _secret_key() -> str:
    key = env_str("SECRET_KEY")
    if key:
        if len(key) < 32:
            raise ImproperlyConfigured("SECRET_KEY must be at least 32 characters long")
        return key
    if DATABASE_URL or REDIS_URL:
        raise ImproperlyConfigured(
            "SECRET_KEY (or SECRET_KEY_FILE) must be set when DATABASE_URL or REDIS_URL is set; "
            "generate one with: python -c 'import secrets; print(secrets.token_urlsafe(50))'"
        )
    # Embedded default: a key generated once and kept beside the SQLite database, so sessions survive restarts.
    key_file = HYPHA_DATA_DIR / "secret_key"
    try:
        HYPHA_DATA_DIR.mkdir(parents=True, exist_ok=True, mode=0o700)
        private_file(key_file)
        if not key_file.read_text().strip():
            key_file.write_text(secrets.token_urlsafe(50))
        return key_file.read_text().strip()
    except OSError as error:
        raise ImproperlyConfigured(
            f"HYPHA_DATA_DIR={str(HYPHA_DATA_DIR)!r} is not writable: {error}"
        ) from None


SECRET_KEY = _secret_key()
ALLOWED_HOSTS = env_list("ALLOWED_HOSTS", ["localhost", "127.0.0.1", "[::1]", "testserver"])
CSRF_TRUSTED_ORIGINS = env_list("CSRF_TRUSTED_ORIGINS", ["http://localhost:8000", "http://127.0.0.1:8000"])


def proxy_ssl_header(name: str, value: str | None) -> tuple[str, str] | None:
    """Django's ``SECURE_PROXY_SSL_HEADER`` from a header name (``X-Forwarded-Proto``): a request counts as
    HTTPS when the proxy set that header to ``https``. Only set it behind a proxy that overwrites the
    header; otherwise any client could claim HTTPS."""
    if value is None:
        return None
    header = value.strip()
    if not header or not all(character.isalnum() or character == "-" for character in header):
        raise ImproperlyConfigured(f"{name}={value!r} is not an HTTP header name (e.g. X-Forwarded-Proto)")
    return "HTTP_" + header.upper().replace("-", "_"), "https"


# Behind a TLS-terminating reverse proxy (docs/deploy.md): trust its X-Forwarded-Proto, secure cookies.
SECURE_PROXY_SSL_HEADER = proxy_ssl_header("SECURE_PROXY_SSL_HEADER", env_str("SECURE_PROXY_SSL_HEADER"))
SESSION_COOKIE_SECURE = env_bool("SESSION_COOKIE_SECURE", False)
CSRF_COOKIE_SECURE = env_bool("CSRF_COOKIE_SECURE", False)

# --- Django -------------------------------------------------------------------------------------------

INSTALLED_APPS = [
    "daphne",
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "rest_framework",
    "drf_spectacular",
    "drf_spectacular_sidecar",
    "channels",
    "apps.workers",
    "apps.leases",
    "apps.market",
    "apps.datasets",
    "apps.jobs",
    "apps.relay",
    "apps.accounting",
    "apps.dashboard",
]

MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    # Static files (admin, API docs) straight from the app and project static dirs: daphne serves none.
    "whitenoise.middleware.WhiteNoiseMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
]

ROOT_URLCONF = "hypha_site.urls"
ASGI_APPLICATION = "hypha_site.asgi.application"

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [BASE_DIR / "templates"],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ],
        },
    },
]

if DATABASE_URL:
    DATABASES = {"default": database_from_url(DATABASE_URL)}
else:
    DATABASES = {
        "default": {
            "ENGINE": "django.db.backends.sqlite3",
            "NAME": HYPHA_DATA_DIR / "hypha.sqlite3",
            "OPTIONS": SQLITE_OPTIONS,
            # One process, one connection per thread for its lifetime: opening a connection (and its PRAGMAs)
            # per request was a fifth of the database thread's time per status report (docs/benchmarks.md).
            "CONN_MAX_AGE": None,
            "TEST": {"NAME": HYPHA_DATA_DIR / "test.sqlite3"},
        }
    }
    # SQLite creates a database (and gives its -wal and -shm files the database's mode) 0644: made here first,
    # 0600, as it holds password and token hashes and every job's secrets.
    try:
        for _suffix in ("", "-wal", "-shm"):
            _database_file = HYPHA_DATA_DIR / f"hypha.sqlite3{_suffix}"
            if not _suffix or _database_file.exists():
                private_file(_database_file)
    except OSError as error:
        raise ImproperlyConfigured(
            f"HYPHA_DATA_DIR={str(HYPHA_DATA_DIR)!r} is not writable: {error}"
        ) from None

DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
AUTH_PASSWORD_VALIDATORS = [
    {"NAME": "django.contrib.auth.password_validation.MinimumLengthValidator"},
    {"NAME": "django.contrib.auth.password_validation.CommonPasswordValidator"},
]
LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = False
USE_TZ = True
STATIC_URL = "static/"
STATICFILES_DIRS = [BASE_DIR / "static"]
#: Only for a deployment that runs collectstatic (e.g. to put a CDN or nginx in front).
STATIC_ROOT = env_str("STATIC_ROOT")
#: Serve from the finders, so no collectstatic step is needed before `hypha-server` starts.
WHITENOISE_USE_FINDERS = True
WHITENOISE_AUTOREFRESH = DEBUG
LOGIN_URL = "/login/"

LOG_LEVEL = env_str("LOG_LEVEL", "INFO").upper()
if LOG_LEVEL not in {"DEBUG", "INFO", "WARNING", "ERROR"}:
    raise ImproperlyConfigured(f"LOG_LEVEL={LOG_LEVEL!r} must be one of DEBUG, INFO, WARNING, ERROR")
LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {"plain": {"format": "%(asctime)s %(levelname)s %(name)s: %(message)s"}},
    "handlers": {"console": {"class": "logging.StreamHandler", "formatter": "plain"}},
    "root": {"handlers": ["console"], "level": "WARNING"},
    "loggers": {
        "apps": {"level": LOG_LEVEL},
        "hypha_site": {"level": LOG_LEVEL},
        "django.request": {"level": "ERROR"},
        # Celery logs each task sent, received and run: six lines a second from the clocks alone. Keep its
        # start-up and connection lines and every warning and failure.
        "celery": {"level": "WARNING"},
        "celery.apps": {"level": LOG_LEVEL},
        "celery.worker.consumer": {"level": LOG_LEVEL},
    },
}

# --- channels -----------------------------------------------------------------------------------------

if EMBEDDED_TRANSPORTS:
    CHANNEL_LAYERS = {"default": {"BACKEND": "channels.layers.InMemoryChannelLayer"}}
else:
    CHANNEL_LAYERS = {
        "default": {
            "BACKEND": "channels_redis.core.RedisChannelLayer",
            "CONFIG": {
                # redis-py 8 reads with a 5 s socket timeout by default, which cuts channels_redis's 5 s
                # blocking receive (BZPOPMIN) short: every idle websocket consumer would die within 5 s.
                # Longer than that receive, so a dead Redis is still noticed.
                # redis-py's asyncio pool allows 100 connections by default: a few hundred daemons
                # connecting at once (each joining its groups) ran out (MaxConnectionsError on hello).
                "hosts": [{"address": REDIS_URL, "socket_timeout": 15, "max_connections": 2000}],
                "capacity": 1000,
                "expiry": 30,
            },
        }
    }

# --- REST API -----------------------------------------------------------------------------------------

REST_FRAMEWORK = {
    "DEFAULT_AUTHENTICATION_CLASSES": [
        # `Authorization: Token <key>`, the key stored hashed (apps.workers.models.UserToken), not DRF's
        # plaintext authtoken table.
        "hypha_site.api.UserTokenAuthentication",
        "rest_framework.authentication.SessionAuthentication",
    ],
    "DEFAULT_PERMISSION_CLASSES": ["rest_framework.permissions.IsAuthenticated"],
    "DEFAULT_SCHEMA_CLASS": "drf_spectacular.openapi.AutoSchema",
    "DEFAULT_PAGINATION_CLASS": "rest_framework.pagination.LimitOffsetPagination",
    "PAGE_SIZE": 100,
    # JSON bounded in nesting and refused strings no database holds; an oversized body a JSON 413
    # (hypha_site/parsers.py).
    "DEFAULT_PARSER_CLASSES": [
        "hypha_site.parsers.BoundedJSONParser",
        "rest_framework.parsers.FormParser",
        "rest_framework.parsers.MultiPartParser",
    ],
    "EXCEPTION_HANDLER": "hypha_site.parsers.exception_handler",
}
SPECTACULAR_SETTINGS = {
    "TITLE": "Hypha control plane API",
    "DESCRIPTION": "Jobs, workers, advertisements, offers and leases of the Hypha DiLoCo market.",
    "VERSION": "0.1.0",
    "SERVE_INCLUDE_SCHEMA": False,
    # The interactive docs load Swagger UI from this server (drf-spectacular-sidecar), not from a CDN.
    "SWAGGER_UI_DIST": "SIDECAR",
    "SWAGGER_UI_FAVICON_HREF": "SIDECAR",
    "REDOC_DIST": "SIDECAR",
    "COMPONENT_SPLIT_REQUEST": True,
    # A default beside a reference to an object component makes generators drop the schema (hypha_site.openapi).
    "POSTPROCESSING_HOOKS": [
        "drf_spectacular.hooks.postprocess_schema_enums",
        "hypha_site.openapi.drop_object_defaults",
    ],
}

# --- Celery -------------------------------------------------------------------------------------------

CELERY_BROKER_URL = REDIS_URL or "memory://"
CELERY_RESULT_BACKEND = None
CELERY_TASK_IGNORE_RESULT = True
# Embedded: tasks never reach a broker; hypha_site.runtime runs them in the daphne process.
CELERY_TASK_ALWAYS_EAGER = EMBEDDED_TRANSPORTS
CELERY_TASK_EAGER_PROPAGATES = True
CELERY_TASK_ACKS_LATE = True
CELERY_WORKER_PREFETCH_MULTIPLIER = 4
CELERY_BROKER_CONNECTION_RETRY_ON_STARTUP = True
#: Celery logs through the LOGGING above instead of replacing the root logger's handlers.
CELERY_WORKER_HIJACK_ROOT_LOGGER = False

# --- the market and its clocks ------------------------------------------------------------------------

#: Seconds an ACTIVE lease lives without a confirmed renewal (the original: 10 s).
HYPHA_LEASE_TTL = env_float("HYPHA_LEASE_TTL", 10.0, minimum=1.0, maximum=3600.0)
#: A renewal is requested once this fraction of the TTL is left (the original renews at 2/3 elapsed;
#: we ask earlier so a lost request has two more chances before expiry).
HYPHA_RENEW_AT_REMAINING = env_float("HYPHA_RENEW_AT_REMAINING", 0.67, minimum=0.1, maximum=0.95)
#: Seconds a transfer token lives (at least twice the lease TTL is used). Each live task gets a fresh one
#: with every renewal of its lease (``transfer_token`` frames), so a token that leaks is soon worthless.
HYPHA_TRANSFER_TOKEN_LIFETIME = env_float(
    "HYPHA_TRANSFER_TOKEN_LIFETIME", 15 * 60.0, minimum=2.0, maximum=86400.0
)
#: Seconds a trainer's slice download URL stays valid. The bridge downloads right after the claim, but waits
#: up to its ``data_wait`` (15 min by default) for data nodes that are down, retrying the same URLs: twice that.
HYPHA_SLICE_TOKEN_LIFETIME = env_float(
    "HYPHA_SLICE_TOKEN_LIFETIME", 30 * 60.0, minimum=2.0, maximum=7 * 86400.0
)
#: Seconds the parameter server's eval slice URLs stay valid. It downloads them when it reports its first
#: round (which may be long after its dispatch), again each round until that works, and again when its daemon
#: restarts it; a server the control plane replaces gets new URLs. So they live long by default.
HYPHA_EVAL_SLICE_TOKEN_LIFETIME = env_float(
    "HYPHA_EVAL_SLICE_TOKEN_LIFETIME", 7 * 86400.0, minimum=2.0, maximum=30 * 86400.0
)
#: Seconds a TEMPORARY (offer) lease holds the worker while the offer is open.
HYPHA_OFFER_TTL = env_float("HYPHA_OFFER_TTL", 3.0, minimum=0.2, maximum=600.0)
#: Seconds an advertisement collects offers before it settles for what it has and re-advertises.
HYPHA_OFFER_WINDOW = env_float("HYPHA_OFFER_WINDOW", 1.0, minimum=0.05, maximum=600.0)
#: Bounded exponential backoff between re-advertisements: first and maximum delay in seconds.
HYPHA_READVERTISE_BASE = env_float("HYPHA_READVERTISE_BASE", 1.0, minimum=0.05, maximum=600.0)
HYPHA_READVERTISE_MAX = env_float("HYPHA_READVERTISE_MAX", 30.0, minimum=0.05, maximum=3600.0)
#: How many daemons an advertisement attempt is sent to: HYPHA_ADVERT_FANOUT per wanted worker, at least
#: HYPHA_ADVERT_MIN_TARGETS, chosen among the connected workers that could take it, best price per capacity
#: first (apps/market/targeting.py). 0 sends each attempt to every worker that could take it.
HYPHA_ADVERT_FANOUT = env_int("HYPHA_ADVERT_FANOUT", 4, minimum=0, maximum=10_000)
HYPHA_ADVERT_MIN_TARGETS = env_int("HYPHA_ADVERT_MIN_TARGETS", 8, minimum=1, maximum=100_000)
#: Points kept per trainer in a job's per-step metric series (apps/jobs/metrics.py): when full, neighbours merge
#: pairwise, so a series never passes 40 bytes × this, however long the job (docs/dashboard.md).
HYPHA_METRICS_MAX_POINTS = env_int("HYPHA_METRICS_MAX_POINTS", 2000, minimum=16, maximum=1_000_000)
#: A trainer whose update the parameter server rejects in this many consecutive rounds has its lease ended
#: and the role advertised again (a job's ``rounds.verification.max_rejections`` overrides it; docs/training.md).
HYPHA_MAX_REJECTIONS = env_int("HYPHA_MAX_REJECTIONS", 3, minimum=1, maximum=1000)
#: Period of the market and lease clocks (Celery beat, or the embedded runner).
HYPHA_TICK_INTERVAL = env_float("HYPHA_TICK_INTERVAL", 0.5, minimum=0.05, maximum=60.0)
#: Seconds between two accrual rows of a running lease (apps/accounting): the lease clock writes one per ACTIVE
#: lease this often, and one more when the lease ends (docs/architecture.md, "Accounting").
HYPHA_ACCRUAL_INTERVAL = env_float("HYPHA_ACCRUAL_INTERVAL", 60.0, minimum=0.05, maximum=86_400.0)
#: Bounds of the request bodies the API parses (hypha_site/parsers.py): the largest JSON or form body (bytes;
#: streamed uploads have their own limits below), the largest TOML job (tomllib is pure Python: seconds per
#: MB), and how deep either may nest (arrays, objects, TOML dotted keys). Beyond them: a JSON 413 or 400.
HYPHA_MAX_REQUEST_BYTES = env_int("HYPHA_MAX_REQUEST_BYTES", 2_621_440, minimum=64 * 1024, maximum=1 << 30)
DATA_UPLOAD_MAX_MEMORY_SIZE = HYPHA_MAX_REQUEST_BYTES
HYPHA_MAX_TOML_BYTES = env_int("HYPHA_MAX_TOML_BYTES", 64 * 1024, minimum=4096, maximum=16 << 20)
HYPHA_MAX_INPUT_DEPTH = env_int("HYPHA_MAX_INPUT_DEPTH", 32, minimum=8, maximum=256)
#: The largest file of a final model the parameter server may upload (bytes).
HYPHA_MAX_MODEL_FILE_BYTES = env_int("HYPHA_MAX_MODEL_FILE_BYTES", 20 << 30, minimum=1 << 20, maximum=1 << 40)
#: The largest result file an inference worker may upload for one slice (bytes; PUT /api/jobs/{id}/results/{index}/,
#: docs/inference.md): past it a 413 and nothing is kept.
HYPHA_MAX_RESULT_BYTES = env_int("HYPHA_MAX_RESULT_BYTES", 1 << 30, minimum=1 << 10, maximum=1 << 40)
#: Users' uploads (POST /api/uploads/): the largest file, and each user's quota in bytes and in number of
#: uploads (a refused upload is a 413 and leaves nothing behind; DELETE /api/uploads/<id>/ frees room).
HYPHA_MAX_UPLOAD_BYTES = env_int("HYPHA_MAX_UPLOAD_BYTES", 10 << 30, minimum=1 << 20, maximum=1 << 40)
HYPHA_UPLOAD_QUOTA_BYTES = env_int("HYPHA_UPLOAD_QUOTA_BYTES", 50 << 30, minimum=1 << 20, maximum=1 << 50)
HYPHA_UPLOAD_QUOTA_COUNT = env_int("HYPHA_UPLOAD_QUOTA_COUNT", 100, minimum=1, maximum=1_000_000)
#: Each task's full output kept on the control plane (HYPHA_DATA_DIR/logs/, apps/jobs/training/task_logs.py):
#: past this many bytes its oldest output is dropped (rotated), and the log says so.
HYPHA_TASK_LOG_MAX_BYTES = env_int("HYPHA_TASK_LOG_MAX_BYTES", 4 << 20, minimum=1024, maximum=64 << 20)
#: Days a job's task logs are kept after it ended (0: for ever); the ``task-log-sweep`` clock deletes them.
HYPHA_TASK_LOG_RETENTION_DAYS = env_float("HYPHA_TASK_LOG_RETENTION_DAYS", 30.0, minimum=0.0, maximum=36500.0)
#: Seconds between two runs of that sweep.
HYPHA_TASK_LOG_SWEEP_INTERVAL = env_float(
    "HYPHA_TASK_LOG_SWEEP_INTERVAL", 3600.0, minimum=1.0, maximum=86400.0
)
#: Largest websocket frame accepted from a daemon (UTF-8 bytes); larger ones get a ``too_large`` error frame.
HYPHA_WS_MAX_MESSAGE_BYTES = env_int("HYPHA_WS_MAX_MESSAGE_BYTES", 256 * 1024, minimum=1024, maximum=64 << 20)
#: Per-connection token bucket of the worker gateway: sustained frames per second and the burst above it.
#: A daemon sends about one frame per task every 2 s (its log lines) plus a renewal per lease every ~3 s and
#: the few status reports it cannot answer itself: 200/s is ~100× a busy daemon. The burst is the daemon's
#: outbox (worker_daemon.link.MAX_QUEUED), flushed at once after a reconnect (docs/protocol.md "Limits").
HYPHA_WS_RATE = env_float("HYPHA_WS_RATE", 200.0, minimum=0.1, maximum=1e6)
HYPHA_WS_BURST = env_int("HYPHA_WS_BURST", 10_000, minimum=1, maximum=10_000_000)
#: Refused (rate-limited) frames within 10 s after which the gateway closes the connection (4008).
HYPHA_WS_FLOOD_REFUSALS = env_int("HYPHA_WS_FLOOD_REFUSALS", 1000, minimum=1, maximum=10_000_000)
#: The same bucket in bytes (a text frame counts its characters): a daemon's steady traffic is a few KB/s; the
#: burst lets a reconnecting daemon flush its outbox. Checked as frames arrive, like the frame bucket.
HYPHA_WS_BYTES_RATE = env_int("HYPHA_WS_BYTES_RATE", 1 << 20, minimum=1024, maximum=1 << 40)
HYPHA_WS_BYTES_BURST = env_int("HYPHA_WS_BYTES_BURST", 32 << 20, minimum=1024, maximum=1 << 40)
#: Frames (and their bytes) one connection may have received but not yet handled; one more closes it (4008).
#: A connection's frames are handled one at a time, so this bounds the memory and database work a sender
#: can queue up beyond what the buckets let through. The frame bound matches the burst (a daemon's outbox).
HYPHA_WS_BACKLOG = env_int("HYPHA_WS_BACKLOG", 10_000, minimum=1, maximum=10_000_000)
HYPHA_WS_BACKLOG_BYTES = env_int("HYPHA_WS_BACKLOG_BYTES", 32 << 20, minimum=1024, maximum=1 << 40)
for _name, _value in {
    "HYPHA_WS_BYTES_BURST": HYPHA_WS_BYTES_BURST,
    "HYPHA_WS_BACKLOG_BYTES": HYPHA_WS_BACKLOG_BYTES,
}.items():
    if _value < HYPHA_WS_MAX_MESSAGE_BYTES:
        raise ImproperlyConfigured(
            f"{_name} ({_value}) must be at least HYPHA_WS_MAX_MESSAGE_BYTES "
            f"({HYPHA_WS_MAX_MESSAGE_BYTES}): a frame of the largest size could never be handled"
        )

if HYPHA_OFFER_TTL <= HYPHA_OFFER_WINDOW:
    raise ImproperlyConfigured(
        f"HYPHA_OFFER_TTL ({HYPHA_OFFER_TTL}) must be longer than HYPHA_OFFER_WINDOW ({HYPHA_OFFER_WINDOW}): "
        "an offer's temporary lease must outlive the window that collects it"
    )

# --- the relay (docs/transfers.md): objects every party reaches outbound, indexed here ------------------


def relay_s3_endpoint_checked(name: str, value: str | None) -> str | None:
    """An S3 endpoint URL (``https://s3.example.com``, ``http://127.0.0.1:9000``), or None for AWS's own."""
    if value is None:
        return None
    parsed = urlparse(value.strip())
    if parsed.scheme not in {"http", "https"} or not parsed.hostname or parsed.query or parsed.fragment:
        raise ImproperlyConfigured(f"{name}={value!r} is not an http(s) URL (e.g. https://s3.example.com)")
    return value.strip().rstrip("/")


#: Where relay objects' bytes live: ``local`` (HYPHA_DATA_DIR/relay/, served by this server at /relay/ with
#: signed URLs) or ``s3`` (any S3-compatible store, presigned URLs: bodies never pass through this server).
HYPHA_RELAY_STORE = (env_str("HYPHA_RELAY_STORE", "local") or "local").strip().lower()
if HYPHA_RELAY_STORE not in {"local", "s3"}:
    raise ImproperlyConfigured(f"HYPHA_RELAY_STORE={HYPHA_RELAY_STORE!r} must be 'local' or 's3'")
#: Seconds a minted part or object URL stays valid (S3 presigned URLs allow at most 7 days).
HYPHA_RELAY_URL_LIFETIME = env_int("HYPHA_RELAY_URL_LIFETIME", 900, minimum=10, maximum=7 * 86400)
#: The largest relay object (bytes); a larger declared size is a 413.
HYPHA_RELAY_MAX_OBJECT_BYTES = env_int(
    "HYPHA_RELAY_MAX_OBJECT_BYTES", 16 << 30, minimum=1 << 20, maximum=5 << 40
)
#: Bytes per uploaded part. S3 needs at least 5 MiB (all parts but the last) and at most 10,000 parts.
HYPHA_RELAY_PART_SIZE = env_int("HYPHA_RELAY_PART_SIZE", 16 << 20, minimum=64 << 10, maximum=5 << 30)
#: Seconds an upload may stay incomplete (and a delivered object keep its reply) before the sweep deletes it.
HYPHA_RELAY_PENDING_TTL = env_int("HYPHA_RELAY_PENDING_TTL", 3600, minimum=60, maximum=30 * 86400)
#: Seconds between two sweeps of the relay (beat, or the embedded runner).
HYPHA_RELAY_SWEEP_INTERVAL = env_float("HYPHA_RELAY_SWEEP_INTERVAL", 60.0, minimum=1.0, maximum=86400.0)
HYPHA_RELAY_S3_ENDPOINT = relay_s3_endpoint_checked(
    "HYPHA_RELAY_S3_ENDPOINT", env_str("HYPHA_RELAY_S3_ENDPOINT")
)
HYPHA_RELAY_S3_BUCKET = env_str("HYPHA_RELAY_S3_BUCKET")
HYPHA_RELAY_S3_REGION = env_str("HYPHA_RELAY_S3_REGION", "us-east-1")
HYPHA_RELAY_S3_ACCESS_KEY_ID = env_str("HYPHA_RELAY_S3_ACCESS_KEY_ID")
HYPHA_RELAY_S3_SECRET_ACCESS_KEY = env_str("HYPHA_RELAY_S3_SECRET_ACCESS_KEY")
HYPHA_RELAY_S3_PREFIX = env_str("HYPHA_RELAY_S3_PREFIX", "hypha/")
if not re.fullmatch(r"([A-Za-z0-9._-]+/)*", HYPHA_RELAY_S3_PREFIX) or {".", ".."} & set(
    HYPHA_RELAY_S3_PREFIX.split("/")
):
    raise ImproperlyConfigured(
        f"HYPHA_RELAY_S3_PREFIX={HYPHA_RELAY_S3_PREFIX!r} must be empty or path segments ending in '/' "
        "(letters, digits, '.', '_', '-'), e.g. hypha/"
    )
if HYPHA_RELAY_STORE == "s3":
    if not HYPHA_RELAY_S3_BUCKET:
        raise ImproperlyConfigured("HYPHA_RELAY_STORE=s3 needs HYPHA_RELAY_S3_BUCKET")
    if HYPHA_RELAY_PART_SIZE < 5 << 20:
        raise ImproperlyConfigured(
            f"HYPHA_RELAY_PART_SIZE ({HYPHA_RELAY_PART_SIZE}) must be at least 5 MiB (5242880) with S3"
        )
    # An object of more parts is refused at upload (413) whatever the store: S3 allows 10,000.
    if HYPHA_RELAY_MAX_OBJECT_BYTES > 10_000 * HYPHA_RELAY_PART_SIZE:
        raise ImproperlyConfigured(
            f"HYPHA_RELAY_MAX_OBJECT_BYTES ({HYPHA_RELAY_MAX_OBJECT_BYTES}) needs more than 10,000 parts of "
            f"HYPHA_RELAY_PART_SIZE ({HYPHA_RELAY_PART_SIZE}) bytes, S3's limit; raise the part size"
        )

#: A clock tick still queued this long after beat sent it is dropped by the worker that takes it (Celery's
#: ``expires``): the ticks are idempotent and the next one is already behind it, so on a saturated machine
#: the workers catch up at once instead of running a backlog of stale ticks (bench/fleet.py, 1,000 daemons).
HYPHA_TICK_EXPIRES = max(2.0, 4 * HYPHA_TICK_INTERVAL)

CELERY_BEAT_SCHEDULE = {
    "lease-clock": {
        "task": "apps.jobs.tasks.tick_leases",
        "schedule": HYPHA_TICK_INTERVAL,
        "options": {"expires": HYPHA_TICK_EXPIRES},
    },
    "market-clock": {
        "task": "apps.jobs.tasks.tick_market",
        "schedule": HYPHA_TICK_INTERVAL,
        "options": {"expires": HYPHA_TICK_EXPIRES},
    },
    "relay-sweep": {"task": "apps.relay.tasks.sweep_relay", "schedule": HYPHA_RELAY_SWEEP_INTERVAL},
    "task-log-sweep": {"task": "apps.jobs.tasks.sweep_task_logs", "schedule": HYPHA_TASK_LOG_SWEEP_INTERVAL},
}

# --- observability (docs/observability.md) --------------------------------------------------------------


def status_bridge_checked(name: str, value: str | None) -> str | None:
    """``host:port`` of Hypha's AIM status bridge; ``http://host:port`` is accepted too (no other scheme, no
    path: the bridge's endpoint is always ``/status``)."""
    if value is None:
        return None
    address = value.strip()
    if address.lower().startswith("http://"):
        address = address[len("http://") :].rstrip("/")
    parsed = urlparse(f"http://{address}")
    try:
        port = parsed.port
    except ValueError:
        port = None
    if not parsed.hostname or port is None or parsed.path or parsed.query or "@" in address:
        raise ImproperlyConfigured(
            f"{name}={value!r} is not a host:port (e.g. 127.0.0.1:61000, the AIM driver's default port)"
        )
    return address


#: Hypha's ``status_bridge`` key (the original reads it from ``HYPHA_STATUS_BRIDGE`` too): each trainer
#: metric of a round is POSTed to ``http://<it>/status`` (reference §8). Unset: no posts.
HYPHA_STATUS_BRIDGE = status_bridge_checked("HYPHA_STATUS_BRIDGE", env_str("HYPHA_STATUS_BRIDGE"))
#: Seconds one post to the bridge may take (connect and reply) before it counts as failed.
HYPHA_STATUS_BRIDGE_TIMEOUT = env_float("HYPHA_STATUS_BRIDGE_TIMEOUT", 2.0, minimum=0.1, maximum=60.0)
#: ``GET /metrics`` answers a staff session, or ``Authorization: Bearer <HYPHA_METRICS_TOKEN>`` when set;
#: everyone else gets 401/403 unless HYPHA_METRICS_PUBLIC opens it (ignored when the token is set).
HYPHA_METRICS_TOKEN = env_str("HYPHA_METRICS_TOKEN")
if HYPHA_METRICS_TOKEN is not None and len(HYPHA_METRICS_TOKEN) < 16:
    raise ImproperlyConfigured("HYPHA_METRICS_TOKEN must be at least 16 characters long")
HYPHA_METRICS_PUBLIC = env_bool("HYPHA_METRICS_PUBLIC", False)

# --- hardening (docs/deploy.md "Threat model") -----------------------------------------------------------


def private_networks_checked(name: str, value: str | None) -> bool | tuple:
    """True (every address allowed), or the networks allowed (empty: none) of ``HYPHA_ALLOW_PRIVATE_URLS``:
    a boolean, or comma-separated addresses/CIDR networks (``10.0.0.0/8,127.0.0.1``)."""
    import ipaddress

    lowered = (value or "").strip().lower()
    if lowered in {"", "0", "false", "no", "off"}:
        return ()
    if lowered in {"1", "true", "yes", "on"}:
        return True
    networks = []
    for item in filter(None, (part.strip() for part in value.split(","))):
        try:
            networks.append(ipaddress.ip_network(item, strict=False))
        except ValueError:
            raise ImproperlyConfigured(
                f"{name}={value!r}: {item!r} is not a boolean, an address or a CIDR network"
            ) from None
    return tuple(networks)


#: Model URLs at loopback/private/link-local/multicast/reserved addresses are refused at submission unless
#: allowed here (the parameter server has its own HYPHA_ALLOW_PRIVATE_URLS, in the daemon's environment).
HYPHA_ALLOW_PRIVATE_URLS = private_networks_checked(
    "HYPHA_ALLOW_PRIVATE_URLS", env_str("HYPHA_ALLOW_PRIVATE_URLS")
)
#: The most parameters a model built from a config may have (whatever the job's roles declare).
HYPHA_MAX_MODEL_PARAMETERS = env_int(
    "HYPHA_MAX_MODEL_PARAMETERS", 20_000_000_000, minimum=1_000, maximum=10**15
)
#: Login throttling (dashboard and admin): after this many failed logins for one username, or from one client
#: address, within HYPHA_LOGIN_LOCKOUT_SECONDS, every login of it is refused until the window ends.
HYPHA_LOGIN_FAILURE_LIMIT = env_int("HYPHA_LOGIN_FAILURE_LIMIT", 10, minimum=1, maximum=10_000)
HYPHA_LOGIN_ADDRESS_FAILURE_LIMIT = env_int(
    "HYPHA_LOGIN_ADDRESS_FAILURE_LIMIT", 100, minimum=1, maximum=1_000_000
)
HYPHA_LOGIN_LOCKOUT_SECONDS = env_int("HYPHA_LOGIN_LOCKOUT_SECONDS", 900, minimum=1, maximum=7 * 86_400)
#: Seconds a connection has to send a complete request line and headers (from connecting, or from the end of
#: its previous response): slowloris clients that trickle or stall are closed with a 408.
HYPHA_HTTP_HEADER_TIMEOUT = env_float("HYPHA_HTTP_HEADER_TIMEOUT", 30.0, minimum=1.0, maximum=3600.0)
# The login failures are counted in the cache: Redis when there is one (shared by every daphne process),
# else this process's memory (the embedded default is one process).
if REDIS_URL:
    CACHES = {
        "default": {
            "BACKEND": "django.core.cache.backends.redis.RedisCache",
            "LOCATION": REDIS_URL,
            "KEY_PREFIX": "hypha",
        }
    }

# OpenTelemetry tracing is switched on by the standard OTEL_* variables alone (hypha_site.telemetry); Django
# calls LOGGING_CONFIG once per process in django.setup(), after the settings and before the apps and the
# request handler load: the one hook every entry point (daphne, Celery worker and beat, manage.py) passes
# through, and the moment the Django instrumentation needs to add its middleware.
LOGGING_CONFIG = "hypha_site.telemetry.configure_logging_and_tracing"
