"""Prometheus metrics of the control plane: ``GET /metrics`` in the text exposition format.

Two kinds of numbers, kept apart on purpose:

* **State** (jobs, workers, leases, offers, advertisements by status; rounds; bytes moved) is counted in the
  database at scrape time by :class:`DatabaseCollector`. Every daphne process answers with the same values,
  so it does not matter which one a scrape reaches.
* **Events** (daemon messages and status reports handled, how long a status report took, posts to the AIM
  status bridge) are counted in the process that handled them. With several daphne processes, either scrape
  each process (one target per process), or set ``PROMETHEUS_MULTIPROC_DIR`` to a directory shared by the
  processes of one host (emptied before they start): then each process writes its counters there and any of
  them answers with the sum (prometheus_client's multiprocess mode).

Names and labels are listed in docs/observability.md. The endpoint answers a staff session, or
``Authorization: Bearer <HYPHA_METRICS_TOKEN>`` when that is set; ``HYPHA_METRICS_PUBLIC=1`` (without a token)
opens it to anyone.
"""

from __future__ import annotations

import hmac
import logging
import os
from collections.abc import Iterator
from typing import Any

from django.conf import settings
from django.db import DatabaseError
from django.http import HttpRequest, HttpResponse
from django.views.decorators.http import require_GET
from prometheus_client import (
    CollectorRegistry,
    Counter,
    Histogram,
    exposition,
    gc_collector,
    platform_collector,
    process_collector,
)
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

logger = logging.getLogger(__name__)

#: The registry of this process: the event counters below, the process's own metrics and the database.
REGISTRY = CollectorRegistry()

#: Progress kinds a task's bridge forwards (reference §1); anything else is counted as "other", so a
#: misbehaving daemon cannot grow the label set.
STATUS_KINDS = frozenset({"status", "metrics", "update", "update-received", "updated", "ready", "round"})

DAEMON_MESSAGES = Counter(
    "hypha_gateway_messages",
    "Frames received from worker daemons on the gateway, by message type ('invalid': not a protocol message).",
    ["type"],
    registry=REGISTRY,
)
STATUS_MESSAGES = Counter(
    "hypha_status_messages",
    "Status reports (a task's progress values) handled, by progress kind and outcome: ok, error (answered "
    "Error), refused (not the worker's task), failed (an unexpected exception).",
    ["kind", "outcome"],
    registry=REGISTRY,
)
STATUS_SECONDS = Histogram(
    "hypha_status_message_seconds",
    "Seconds from a status report's arrival to its reply being ready, by progress kind.",
    ["kind"],
    # A trainer reports every optimizer step: most replies take a few milliseconds; the slow tail (a round
    # report that dispatches, SQLite write locks) is what the upper buckets are for.
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0),
    registry=REGISTRY,
)
STATUS_BRIDGE_POSTS = Counter(
    "hypha_status_bridge_posts",
    "Metric posts to the AIM status bridge, by outcome: sent (2xx), rejected (other status), failed "
    "(connection error or timeout), dropped (not attempted: the bridge failed moments ago, or the queue was "
    "full).",
    ["outcome"],
    registry=REGISTRY,
)

if not os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
    # Per-process metrics mean nothing summed over processes, so multiprocess mode leaves them out.
    process_collector.ProcessCollector(registry=REGISTRY)
    platform_collector.PlatformCollector(registry=REGISTRY)
    gc_collector.GCCollector(registry=REGISTRY)


def status_kind(progress: dict | str) -> str:
    """The label of a progress value: its kind (Hypha's ``"update"`` or ``{"metrics": …}``) or "other"."""
    if isinstance(progress, str):
        kind = progress
    elif isinstance(progress, dict) and len(progress) == 1:
        kind = next(iter(progress))
    else:
        kind = ""
    return kind if kind in STATUS_KINDS else "other"


def status_handled(*, kind: str, outcome: str, seconds: float) -> None:
    STATUS_MESSAGES.labels(kind=kind, outcome=outcome).inc()
    STATUS_SECONDS.labels(kind=kind).observe(seconds)


class DatabaseCollector(Collector):
    """Gauges of the control plane's state, counted in the database at every scrape (a handful of indexed
    GROUP BY queries). If the database does not answer, ``hypha_database_up`` is 0 and the state gauges are
    left out, so the scrape itself still succeeds."""

    def describe(self) -> Iterator[Metric]:
        # Without describe() a registry would call collect(), and so the database, on registration.
        return iter(self._families())

    def collect(self) -> Iterator[Metric]:
        families = self._families()
        up = GaugeMetricFamily("hypha_database_up", "1 if the database answered this scrape, else 0.")
        try:
            self._fill(*families)
        except DatabaseError as error:
            logger.warning("metrics: the database did not answer: %s", error)
            up.add_metric([], 0)
            return iter([up])
        up.add_metric([], 1)
        return iter([up, *families])

    @staticmethod
    def _families() -> list[GaugeMetricFamily]:
        return [
            GaugeMetricFamily("hypha_jobs", "Jobs by status.", labels=["status"]),
            GaugeMetricFamily(
                "hypha_workers", "Registered workers by presence (online: connected now).", labels=["status"]
            ),
            GaugeMetricFamily("hypha_leases", "Leases by status.", labels=["status"]),
            GaugeMetricFamily("hypha_advertisements", "Market advertisements by status.", labels=["status"]),
            GaugeMetricFamily(
                "hypha_offers",
                "Offers by outcome (open: undecided; accepted: won a lease; declined; expired).",
                labels=["status"],
            ),
            GaugeMetricFamily(
                "hypha_rounds",
                "DiLoCo rounds recorded, by whether the parameter server has applied them.",
                labels=["closed"],
            ),
            GaugeMetricFamily(
                "hypha_round_bytes",
                "Bytes the parameter servers reported moving in recorded rounds (in: pseudo-gradients "
                "received; out: updates sent), summed over all rounds.",
                labels=["direction"],
            ),
            GaugeMetricFamily(
                "hypha_job_samples_per_second",
                "Samples per second of a running job's trainers, summed, in its latest closed round that "
                f"reported any (the {MAX_JOB_SERIES} most recently created running jobs).",
                labels=["job"],
            ),
            GaugeMetricFamily(
                "hypha_job_tokens_per_second",
                "Tokens per second of a running job's trainers, summed, in its latest closed round that "
                f"reported any (token models only; the {MAX_JOB_SERIES} most recently created running jobs).",
                labels=["job"],
            ),
        ]

    @staticmethod
    def _fill(
        jobs, workers, leases, advertisements, offers, rounds, round_bytes, job_samples, job_tokens
    ) -> None:
        from django.db.models import Count, Q, Sum

        from apps.jobs.models import Job, Round
        from apps.leases.models import Lease
        from apps.market.models import Advertisement, Offer
        from apps.workers.models import Worker

        for family, model in (
            (jobs, Job),
            (workers, Worker),
            (leases, Lease),
            (advertisements, Advertisement),
            (offers, Offer),
        ):
            counts = dict(model.objects.order_by().values_list("status").annotate(count=Count("pk")))
            # Every status, zeros included: a series that vanishes reads as "no data", not as 0.
            for status in model.Status.values:
                family.add_metric([status], counts.get(status, 0))
        totals: dict[str, Any] = Round.objects.aggregate(
            closed_rounds=Count("pk", filter=Q(closed=True)),
            open_rounds=Count("pk", filter=Q(closed=False)),
            bytes_in=Sum("bytes_in"),
            bytes_out=Sum("bytes_out"),
        )
        rounds.add_metric(["true"], totals["closed_rounds"])
        rounds.add_metric(["false"], totals["open_rounds"])
        round_bytes.add_metric(["in"], totals["bytes_in"] or 0)
        round_bytes.add_metric(["out"], totals["bytes_out"] or 0)
        _fill_job_throughput(job_samples, job_tokens)


#: Running jobs given throughput series, the most recently created first: bounds the label cardinality.
MAX_JOB_SERIES = 50
#: A job's latest rounds read for its throughput (the open one, and closed ones before it).
_THROUGHPUT_ROUNDS = 3


def _fill_job_throughput(job_samples: GaugeMetricFamily, job_tokens: GaugeMetricFamily) -> None:
    """Per running job (at most :data:`MAX_JOB_SERIES`), the rates of ``apps.jobs.throughput.of_job`` over its
    latest rounds; a job whose trainers reported none has no series."""
    from django.db.models import Prefetch

    from apps.jobs import throughput
    from apps.jobs.models import Job, Round

    # One query for the jobs and one for their latest rounds, however many jobs run (not one per job).
    latest = Round.objects.order_by("-number").only("job_id", "closed", "trainer_metrics")[
        :_THROUGHPUT_ROUNDS
    ]
    running = (
        Job.objects.filter(status=Job.Status.RUNNING)
        .order_by("-created_at")
        .only("pk")
        .prefetch_related(Prefetch("rounds", queryset=latest, to_attr="latest_rounds"))[:MAX_JOB_SERIES]
    )
    for job in running:
        job_id = job.pk
        found = throughput.of_job(reversed(job.latest_rounds))
        if found["samples_per_second"] is not None:
            job_samples.add_metric([str(job_id)], found["samples_per_second"])
        if found["tokens_per_second"] is not None:
            job_tokens.add_metric([str(job_id)], found["tokens_per_second"])


REGISTRY.register(DatabaseCollector())


def scrape_registry() -> CollectorRegistry:
    """What a scrape exposes: this process's registry, or in multiprocess mode the counters of every process
    (from ``PROMETHEUS_MULTIPROC_DIR``) and the database."""
    if not os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        return REGISTRY
    from prometheus_client import multiprocess

    registry = CollectorRegistry()
    multiprocess.MultiProcessCollector(registry)
    registry.register(DatabaseCollector())
    return registry


def _bearer_matches(request: HttpRequest, token: str) -> bool:
    scheme, _, presented = request.headers.get("Authorization", "").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(presented.strip().encode(), token.encode())


def _refusal(request: HttpRequest) -> HttpResponse | None:
    """None when ``request`` may scrape: a staff session, the bearer token (when set), or anyone when
    ``HYPHA_METRICS_PUBLIC`` opened the endpoint and no token is set. Else a 401 (403 for a signed-in user who
    is not staff). The counts describe every user's jobs and workers, so they are not for everyone."""
    token = settings.HYPHA_METRICS_TOKEN
    user = getattr(request, "user", None)
    if user is not None and user.is_active and user.is_staff:
        return None
    if token and _bearer_matches(request, token):
        return None
    if not token and settings.HYPHA_METRICS_PUBLIC:
        return None
    if user is not None and user.is_authenticated:
        return HttpResponse("staff only\n", status=403, content_type="text/plain")
    response = HttpResponse(
        "a staff session or a valid bearer token is required\n", status=401, content_type="text/plain"
    )
    response["WWW-Authenticate"] = 'Bearer realm="metrics"'
    return response


@require_GET
def metrics_view(request: HttpRequest) -> HttpResponse:
    """``GET /metrics``: the exposition (OpenMetrics when the scraper asks for it)."""
    refusal = _refusal(request)
    if refusal is not None:
        return refusal
    encoder, content_type = exposition.choose_encoder(request.headers.get("Accept", ""))
    return HttpResponse(encoder(scrape_registry()), content_type=content_type)
