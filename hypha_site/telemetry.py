"""OpenTelemetry tracing of the control plane (Django requests, Celery tasks, the worker gateway's messages),
switched on by the standard ``OTEL_*`` variables alone.

On when ``OTEL_TRACES_EXPORTER`` names an exporter (``otlp``, ``console``; ``none`` is off), or, without it,
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

logger = logging.getLogger(__name__)

SERVICE_NAME = "hypha-control-plane"
ENDPOINT_VARIABLES = ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")
EXPORTERS = ("otlp", "console")
#: Health checks and Prometheus scrapes would be most of the spans and tell nothing; the standard
#: ``OTEL_PYTHON_DJANGO_EXCLUDED_URLS`` / ``OTEL_PYTHON_EXCLUDED_URLS`` replace this list.
DEFAULT_EXCLUDED_URLS = "/healthz$,/metrics$"

_lock = threading.Lock()
_tracer_provider: Any = None


def exporters_named(environ: Mapping[str, str]) -> list[str]:
    """The trace exporters the ``OTEL_*`` variables of ``environ`` ask for; empty means tracing is off."""
    if environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return []
    named = environ.get("OTEL_TRACES_EXPORTER", "").strip()
    if named:
        names = [name.strip().lower() for name in named.split(",") if name.strip()]
        if "none" in names:
            return []
        unknown = [name for name in names if name not in EXPORTERS]
        if unknown:
            raise ImproperlyConfigured(
                f"OTEL_TRACES_EXPORTER={named!r}: {', '.join(unknown)} not installed; "
                f"use {', '.join(EXPORTERS)} or none"
            )
        return names
    if any(environ.get(name, "").strip() for name in ENDPOINT_VARIABLES):
        return ["otlp"]
    return []


def enabled(environ: Mapping[str, str] | None = None) -> bool:
    return bool(exporters_named(os.environ if environ is None else environ))


def configure_logging_and_tracing(logging_settings: dict) -> None:
    """Django's ``LOGGING_CONFIG`` hook: the settings' ``LOGGING`` as Django would apply it, then tracing."""
    logging.config.dictConfig(logging_settings)
    configure()


def configure() -> bool:
    """Start tracing if the ``OTEL_*`` variables ask for it (once per process); True if it is on."""
    global _tracer_provider
    names = exporters_named(os.environ)
    if not names:
        return False
    with _lock:
        if _tracer_provider is not None:
            return True
        _tracer_provider = _start(names)
    logger.info("OpenTelemetry tracing on: exporters %s", ", ".join(names))
    return True


def _start(names: list[str]) -> Any:
    from opentelemetry import trace
    from opentelemetry.instrumentation.celery import CeleryInstrumentor
    from opentelemetry.instrumentation.django import DjangoInstrumentor
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SimpleSpanProcessor

    attributes = {}
    if not os.environ.get("OTEL_SERVICE_NAME") and "service.name=" not in os.environ.get(
        "OTEL_RESOURCE_ATTRIBUTES", ""
    ):
        attributes["service.name"] = SERVICE_NAME
    provider = TracerProvider(resource=Resource.create(attributes))
    for name in names:
        if name == "otlp":
            provider.add_span_processor(BatchSpanProcessor(_otlp_exporter()))
        else:
            # For a look at the spans while debugging: printed as they end, not batched.
            provider.add_span_processor(SimpleSpanProcessor(ConsoleSpanExporter()))
    trace.set_tracer_provider(provider)
    excluded = None
    if not (
        os.environ.get("OTEL_PYTHON_DJANGO_EXCLUDED_URLS") or os.environ.get("OTEL_PYTHON_EXCLUDED_URLS")
    ):
        excluded = DEFAULT_EXCLUDED_URLS
    DjangoInstrumentor().instrument(tracer_provider=provider, excluded_urls=excluded)
    CeleryInstrumentor().instrument(tracer_provider=provider)
    return provider


def _otlp_exporter() -> Any:
    protocol = (
        os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
        or os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL")
        or "http/protobuf"
    ).strip()
    if protocol != "http/protobuf":
        raise ImproperlyConfigured(
            f"OTEL_EXPORTER_OTLP_PROTOCOL={protocol!r}: only http/protobuf is installed "
            "(the collector's port 4318, e.g. OTEL_EXPORTER_OTLP_ENDPOINT=http://collector:4318)"
        )
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    return OTLPSpanExporter()


def span(name: str, **attributes: Any) -> contextlib.AbstractContextManager:
    """A span around a block (the current span's child), or nothing at all when tracing is off."""
    if _tracer_provider is None:
        return contextlib.nullcontext()
    return _tracer_provider.get_tracer("hypha_site").start_as_current_span(name, attributes=attributes)
