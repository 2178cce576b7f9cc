"""OpenTelemetry tracing of the control plane (Django requests, Celery tasks, the worker gateway's messages),
switched on by the standard ``OTEL_*`` variables alone.

The on/off rule is :func:`worker_daemon.telemetry.exporters_named`, shared with the daemons:
on when ``OTEL_TRACES_EXPORTER`` names an exporter (``otlp``, ``console``; ``none`` is off), or, without it,
when ``OTEL_EXPORTER_OTLP_ENDPOINT`` or ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` is set (then ``otlp``).
``OTEL_SDK_DISABLED=true`` turns it off whatever else is set. Off, nothing of opentelemetry is imported.

The OTLP exporter speaks http/protobuf (port 4318): the gRPC exporter is not installed, so
``OTEL_EXPORTER_OTLP_PROTOCOL=grpc`` is a configuration error rather than a silent loss of every span.
The exporter itself reads the rest of the standard variables (endpoint, headers, timeout, compression),
and the SDK reads ``OTEL_SERVICE_NAME`` (default here: ``hypha-control-plane``),
``OTEL_RESOURCE_ATTRIBUTES`` and ``OTEL_TRACES_SAMPLER``/``_ARG``.

:func:`configure_logging_and_tracing` is the ``LOGGING_CONFIG`` of the settings: Django calls it in every
process's ``django.setup()``, before the request handler loads its middleware (the Django instrumentation
adds its own to ``settings.MIDDLEWARE``) and before a Celery worker forks its pool (the span processor's
thread restarts in each child).
"""

from __future__ import annotations

import contextlib
import logging
import logging.config
import os
import threading
from collections.abc import Mapping
from typing import Any

from django.core.exceptions import ImproperlyConfigured

from worker_daemon import telemetry as daemon_telemetry

logger = logging.getLogger(__name__)

SERVICE_NAME = "hypha-control-plane"
#: Health checks and Prometheus scrapes would be most of the spans and tell nothing; the standard
#: ``OTEL_PYTHON_DJANGO_EXCLUDED_URLS`` / ``OTEL_PYTHON_EXCLUDED_URLS`` replace this list.
DEFAULT_EXCLUDED_URLS = "/healthz$,/metrics$"

_lock = threading.Lock()
_tracer_provider: Any = None


def exporters_named(environ: Mapping[str, str]) -> list[str]:
    """The trace exporters the ``OTEL_*`` variables of ``environ`` ask for; empty means tracing is off.

    The rule is :func:`worker_daemon.telemetry.exporters_named` (shared with the daemons); a bad value is an
    ``ImproperlyConfigured`` here."""
    try:
        return daemon_telemetry.exporters_named(environ)
    except daemon_telemetry.TelemetryConfigError as error:
        raise ImproperlyConfigured(str(error)) from None


def enabled(environ: Mapping[str, str] | None = None) -> bool:
    return bool(exporters_named(os.environ if environ is None else environ))


def configure_logging_and_tracing(logging_settings: dict) -> None:
    """Django's ``LOGGING_CONFIG`` hook: the settings' ``LOGGING`` as Django would apply it, then tracing."""
    logging.config.dictConfig(logging_settings)
    configure()


def configure() -> bool:
    """Start tracing if the ``OTEL_*`` variables ask for it (once per process); True if it is on.

    The provider, its exporters and the service name's rule are the daemons' (:mod:`worker_daemon.telemetry`);
    this adds the Django and Celery instrumentation, once."""
    global _tracer_provider
    try:
        if not daemon_telemetry.configure(service_name=SERVICE_NAME):
            return False
    except daemon_telemetry.TelemetryConfigError as error:
        raise ImproperlyConfigured(str(error)) from None
    with _lock:
        if _tracer_provider is None:
            _tracer_provider = _instrument(daemon_telemetry.provider())
    return True


def _instrument(provider: Any) -> Any:
    from opentelemetry.instrumentation.celery import CeleryInstrumentor
    from opentelemetry.instrumentation.django import DjangoInstrumentor

    excluded = None
    if not (
        os.environ.get("OTEL_PYTHON_DJANGO_EXCLUDED_URLS") or os.environ.get("OTEL_PYTHON_EXCLUDED_URLS")
    ):
        excluded = DEFAULT_EXCLUDED_URLS
    DjangoInstrumentor().instrument(tracer_provider=provider, excluded_urls=excluded)
    CeleryInstrumentor().instrument(tracer_provider=provider)
    return provider


def _otlp_exporter() -> Any:
    try:
        return daemon_telemetry.otlp_exporter()
    except daemon_telemetry.TelemetryConfigError as error:
        raise ImproperlyConfigured(str(error)) from None


def span(name: str, **attributes: Any) -> contextlib.AbstractContextManager:
    """A span around a block (the current span's child), or nothing at all when tracing is off."""
    if _tracer_provider is None:
        return contextlib.nullcontext()
    return _tracer_provider.get_tracer("hypha_site").start_as_current_span(name, attributes=attributes)
