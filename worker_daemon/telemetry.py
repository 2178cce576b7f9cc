"""OpenTelemetry tracing of the daemons, switched on by the standard ``OTEL_*`` variables alone.

Django-free on purpose: the control plane (:mod:`hypha_site.telemetry`) takes its on/off rule,
:func:`exporters_named`, from here, so the rule exists once.

On when ``OTEL_TRACES_EXPORTER`` names an exporter (``otlp``, ``console``; ``none`` is off), or, without it,
when ``OTEL_EXPORTER_OTLP_ENDPOINT`` or ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` is set (then ``otlp``).
``OTEL_SDK_DISABLED=true`` turns it off whatever else is set. Off, nothing of opentelemetry is imported and
:func:`span` costs one global lookup.

The OTLP exporter speaks http/protobuf (port 4318): the gRPC exporter is not installed, so
``OTEL_EXPORTER_OTLP_PROTOCOL=grpc`` is a configuration error rather than a silent loss of every span. The
exporter reads the rest of the standard variables (endpoint, headers, timeout, compression) and the SDK
reads ``OTEL_SERVICE_NAME`` (which wins over the ``service_name`` given to :func:`configure`),
``OTEL_RESOURCE_ATTRIBUTES`` and ``OTEL_TRACES_SAMPLER``/``_ARG``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Mapping
from typing import Any

logger = logging.getLogger(__name__)

ENDPOINT_VARIABLES = ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")
EXPORTERS = ("otlp", "console")

_lock = threading.Lock()
_tracer_provider: Any = None


class TelemetryConfigError(ValueError):
    """An ``OTEL_*`` variable asks for something that is not installed (an exporter, the gRPC protocol)."""


def exporters_named(environ: Mapping[str, str]) -> list[str]:
    """The trace exporters the ``OTEL_*`` variables of ``environ`` ask for; empty means tracing is off.

    Raises :class:`TelemetryConfigError` for an exporter other than ``otlp``, ``console`` or ``none``."""
    if environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return []
    named = environ.get("OTEL_TRACES_EXPORTER", "").strip()
    if named:
        names = [name.strip().lower() for name in named.split(",") if name.strip()]
        if "none" in names:
            return []
        unknown = [name for name in names if name not in EXPORTERS]
        if unknown:
            raise TelemetryConfigError(
                f"OTEL_TRACES_EXPORTER={named!r}: {', '.join(unknown)} not installed; "
                f"use {', '.join(EXPORTERS)} or none"
            )
        return names
    if any(environ.get(name, "").strip() for name in ENDPOINT_VARIABLES):
        return ["otlp"]
    return []


def enabled() -> bool:
    """True once :func:`configure` started tracing in this process."""
    return _tracer_provider is not None


def provider() -> Any:
    """The tracer provider :func:`configure` started, or ``None`` while tracing is off."""
    return _tracer_provider


def configure(*, service_name: str) -> bool:
    """Start tracing if the ``OTEL_*`` variables ask for it (once per process); True if it is on.

    ``service_name`` is the default ``service.name`` (``OTEL_SERVICE_NAME`` or a ``service.name`` in
    ``OTEL_RESOURCE_ATTRIBUTES`` win). Raises :class:`TelemetryConfigError` for unusable variables."""
    global _tracer_provider
    names = exporters_named(os.environ)
    if not names:
        return False
    with _lock:
        if _tracer_provider is not None:
            return True
        _tracer_provider = start_provider(names, service_name=service_name)
    logger.info("OpenTelemetry tracing on: exporters %s", ", ".join(names))
    return True


def start_provider(names: list[str], *, service_name: str) -> Any:
    """A tracer provider exporting to ``names`` (see :func:`exporters_named`), installed as the global one."""
    from opentelemetry import trace
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SimpleSpanProcessor

    attributes = {}
    if not os.environ.get("OTEL_SERVICE_NAME", "").strip() and "service.name=" not in os.environ.get(
        "OTEL_RESOURCE_ATTRIBUTES", ""
    ):
        attributes["service.name"] = service_name
    provider = TracerProvider(resource=Resource.create(attributes))
    for name in names:
        if name == "otlp":
            provider.add_span_processor(BatchSpanProcessor(otlp_exporter()))
        else:
            # For a look at the spans while debugging: printed as they end, not batched.
            provider.add_span_processor(SimpleSpanProcessor(ConsoleSpanExporter()))
    trace.set_tracer_provider(provider)
    return provider


def otlp_exporter() -> Any:
    """The OTLP span exporter (http/protobuf); :class:`TelemetryConfigError` if another protocol is asked for."""
    protocol = (
        os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
        or os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL")
        or "http/protobuf"
    ).strip()
    if protocol != "http/protobuf":
        raise TelemetryConfigError(
            f"OTEL_EXPORTER_OTLP_PROTOCOL={protocol!r}: only http/protobuf is installed "
            "(the collector's port 4318, e.g. OTEL_EXPORTER_OTLP_ENDPOINT=http://collector:4318)"
        )
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    return OTLPSpanExporter()


def shutdown() -> None:
    """Export what is buffered (the batch processor's queue) before the process exits; no-op when off."""
    if _tracer_provider is not None:
        with contextlib.suppress(Exception):
            _tracer_provider.shutdown()


def flush(*, timeout: float) -> None:
    """Export what is buffered, waiting at most ``timeout`` seconds (before an ``os._exit``); no-op when off."""
    if _tracer_provider is not None:
        with contextlib.suppress(Exception):
            _tracer_provider.force_flush(int(timeout * 1000))


def span(name: str, **attributes: Any) -> contextlib.AbstractContextManager[Any]:
    """A span around a block (the current span's child), yielding it; or, when tracing is off, nothing at
    all (yields None). Attributes that are None are left out; UUIDs and other values become strings."""
    if _tracer_provider is None:
        return contextlib.nullcontext()
    return _tracer_provider.get_tracer("hypha").start_as_current_span(name, attributes=_clean(attributes))


def annotate(current: Any, **attributes: Any) -> None:
    """Set ``attributes`` on a span :func:`span` yielded (None, when tracing is off: nothing to do)."""
    if current is not None:
        current.set_attributes(_clean(attributes))


def _clean(attributes: Mapping[str, Any]) -> dict[str, Any]:
    cleaned: dict[str, Any] = {}
    for key, value in attributes.items():
        if value is None:
            continue
        if isinstance(value, bool | int | float | str):
            cleaned[key] = value
        elif isinstance(value, list | tuple):
            cleaned[key] = [
                item if isinstance(item, bool | int | float | str) else str(item) for item in value
            ]
        else:
            cleaned[key] = str(value)
    return cleaned
