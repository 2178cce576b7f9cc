"""The fleet benchmark's report (``bench/fleet.py``): renewals and their latency, the leases, what the daemons
saw, the REST driver, CPU per process and the database, the flooders; and the side-by-side table of the runs of
``--web``/``--celery``. Split from ``bench/fleet.py``, which runs the fleet; both read the constants here."""

from __future__ import annotations

import argparse
import datetime
import os
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING

from bench.simulated import markdown, milliseconds, percentile

if TYPE_CHECKING:
    from bench.fleet import Run

#: The control plane asks for a renewal once this fraction of the TTL is left (set explicitly, so the
#: "needed" rate below is computed from what the control plane really runs with).
RENEW_AT_REMAINING = 0.67
#: Seconds to wait, after the drain, for every daemon to be free.
DRAIN_TIMEOUT = 60.0
#: The daemon's ``renew_refused`` reason for a lease it no longer holds (worker_daemon/connection.py).
NOT_HELD = "lease not held by this daemon"


# --- the tables --------------------------------------------------------------------------------------------


@dataclass
class Renewal:
    lease_id: uuid.UUID
    committed: float
    #: Time left on the lease when this renewal committed (its previous expires_at − now).
    left: float
    #: When it became due: once RENEW_AT_REMAINING of the TTL is left on its previous expiry.
    due: float
    #: The daemon's ``renew_lease`` arrival and ``lease_renewed`` send that led to this commit, if matched.
    request_arrived: float | None
    confirmation_sent: float | None


def renewals_in_window(run: Run, ttl: float) -> list[Renewal]:
    """Every renewal committed in the window, matched with the daemon's ``lease_renewed`` that caused it (the
    latest one sent before the commit) and the ``renew_lease`` it answered (the latest arrival before that)."""
    renewals = []
    for lease in run.leases.values():
        trace = run.recorder.leases.get(lease.id)
        previous_expiry = None
        for kind, at, expires_at in lease.events:
            if kind == "renewed" and run.window_start <= at <= run.window_end and previous_expiry is not None:
                sent = arrived = None
                if trace is not None:
                    sent = max((moment for moment in trace.confirmations if moment <= at), default=None)
                    if sent is not None:
                        arrived = max((moment for moment in trace.requests if moment <= sent), default=None)
                renewals.append(
                    Renewal(
                        lease_id=lease.id, committed=at, left=previous_expiry - at,
                        due=previous_expiry - RENEW_AT_REMAINING * ttl, request_arrived=arrived,
                        confirmation_sent=sent,
                    )
                )  # fmt: skip
            previous_expiry = expires_at
    return renewals


def latency_row(label: str, values: list[float]) -> list[str]:
    if not values:
        return [label, "0", "-", "-", "-", "-"]
    return [
        label,
        str(len(values)),
        *(milliseconds(percentile(values, fraction)) for fraction in (0.5, 0.95, 0.99)),
        milliseconds(max(values)),
    ]


def clock(value: float | None) -> str:
    if value is None:
        return "-"
    return datetime.datetime.fromtimestamp(value, datetime.UTC).strftime("%H:%M:%S.%f")[:-3]


def report(run: Run, arguments: argparse.Namespace) -> bool:
    """Print the tables; True if the goal (no wrongful expiry) was met."""
    seconds = max(run.window_end - run.window_start, 1e-9)  # 0 when the window was skipped
    renewals = renewals_in_window(run, arguments.ttl)
    held = sum(run.sampler.held) / len(run.sampler.held) if run.sampler and run.sampler.held else 0.0
    schedule = held / (arguments.ttl * (1.0 - RENEW_AT_REMAINING))
    minimum = held / arguments.ttl
    rate = len(renewals) / seconds if seconds else 0.0
    in_window = [
        trace
        for trace in run.recorder.leases.values()
        if any(run.window_start <= moment <= run.window_end for moment in trace.requests)
    ]
    requests = sum(
        sum(run.window_start <= moment <= run.window_end for moment in trace.requests) for trace in in_window
    )
    confirmations = sum(
        sum(run.window_start <= moment <= run.window_end for moment in trace.confirmations)
        for trace in in_window
    )
    print("## Renewals (window)\n")
    print(
        markdown(
            ["daemons", "window (s)", "leases held (mean)", "requests received/s", "confirmations sent/s",
             "renewals committed/s", "÷ schedule", "÷ minimum (1 per TTL)"],
            [[
                str(run.daemons), f"{seconds:.0f}", f"{held:.1f}", f"{requests / seconds:.1f}",
                f"{confirmations / seconds:.1f}", f"{rate:.1f}", f"{rate / schedule:.2f}" if schedule else "-",
                f"{rate / minimum:.2f}" if minimum else "-",
            ]],
        )
    )  # fmt: skip
    print(
        f"\nschedule = leases held ÷ (TTL × (1 − {RENEW_AT_REMAINING})) = {schedule:.1f}/s; "
        f"minimum = leases held ÷ TTL = {minimum:.1f}/s\n"
    )
    print("## Renewal latency (ms, window)\n")
    left = [renewal.left for renewal in renewals]
    print(
        markdown(
            ["from → to", "renewals", "p50", "p95", "p99", "max"],
            [
                latency_row("due → renew_lease arrived", [r.request_arrived - r.due for r in renewals if r.request_arrived is not None]),
                latency_row("lease_renewed sent → committed", [r.committed - r.confirmation_sent for r in renewals if r.confirmation_sent is not None]),
                latency_row("due → committed", [r.committed - r.due for r in renewals]),
            ],
        )
    )  # fmt: skip
    if left:
        print(
            f"\nTime left on a lease when its renewal committed (s): min {min(left):.2f}, "
            f"p1 {percentile(left, 0.01):.2f}, p50 {percentile(left, 0.5):.2f} (TTL {arguments.ttl:g})"
        )
    if len(set(run.web_of.values())) > 1 or run.flood:
        print_by_web(run, renewals)

    leases = list(run.leases.values())

    def window(value: float | None) -> bool:
        return value is not None and run.window_start <= value <= run.window_end

    wrongful = [lease for lease in leases if lease.status == "expired" and lease.activated_at is not None]
    # The other way to lose a lease although the daemon is alive: no renew_lease reached it within the TTL,
    # so it dropped the lease, and answered the late request with renew_refused (the lease is then released).
    lost = [
        lease
        for lease in leases
        if lease.status == "released" and lease.reason.startswith(f"released by the worker: {NOT_HELD}")
    ]
    offers_expired = [lease for lease in leases if lease.status == "expired" and lease.activated_at is None]
    print("\n## Leases\n")
    print(
        markdown(
            ["", "created", "activated", "released", "expired while ACTIVE (wrongful)",
             "released: dropped by its daemon for want of a renew_lease", "offers expired (TEMPORARY)"],
            [
                ["window", str(sum(window(lease.created_at) for lease in leases)),
                 str(sum(window(lease.activated_at) for lease in leases)),
                 str(sum(window(lease.ended_at) and lease.status == "released" for lease in leases)),
                 str(sum(window(lease.ended_at) for lease in wrongful)),
                 str(sum(window(lease.ended_at) for lease in lost)),
                 str(sum(window(lease.ended_at) for lease in offers_expired))],
                ["whole run", str(len(leases)), str(sum(lease.activated_at is not None for lease in leases)),
                 str(sum(lease.status == "released" for lease in leases)), str(len(wrongful)), str(len(lost)),
                 str(len(offers_expired))],
            ],
        )
    )  # fmt: skip
    if wrongful:
        print("\n### Wrongful expiries\n")
        rows = []
        for lease in sorted(wrongful, key=lambda lease: lease.ended_at or 0.0):
            trace = run.recorder.leases.get(lease.id)
            renewed = [at for kind, at, _ in lease.events if kind == "renewed"]
            rows.append(
                [
                    str(lease.id)[:8], lease.worker, lease.role, clock(lease.activated_at),
                    clock(trace.requests[-1] if trace and trace.requests else None),
                    clock(trace.confirmations[-1] if trace and trace.confirmations else None),
                    clock(renewed[-1] if renewed else None), clock(lease.expires_at), clock(lease.ended_at),
                    lease.reason,
                ]
            )  # fmt: skip
        print(
            markdown(
                ["lease", "worker", "role", "activated", "last renew_lease arrived", "last lease_renewed sent",
                 "last renewal committed", "expires_at", "expired at", "reason"],
                rows,
            )
        )  # fmt: skip

    recorder = run.recorder
    dropped = [trace for trace in recorder.leases.values() if trace.dropped_at is not None]
    reconnects = sum(recorder.hellos.values()) - len(recorder.hellos)
    print("\n## What the daemons saw (whole run)\n")
    print(
        markdown(
            ["renew_lease received", "lease_renewed sent", "renew_refused sent", "dropped locally (no request in time)",
             "lease_ended expired", "error frames", "reconnects", "dispatches", "adverts received", "offers sent"],
            [[
                str(recorder.received_types["renew_lease"]), str(recorder.sent_types["lease_renewed"]),
                str(recorder.sent_types["renew_refused"]), str(len(dropped)),
                str(sum(1 for t in recorder.leases.values() if t.ended and t.ended[0] == "expired")),
                str(sum(recorder.errors.values())), str(reconnects), str(recorder.received_types["dispatch_job"]),
                str(recorder.received_types["advertisement"]), str(recorder.sent_types["offer"]),
            ]],
        )
    )  # fmt: skip
    print(
        "\nReceived: "
        + ", ".join(f"{kind} {count}" for kind, count in sorted(recorder.received_types.items()))
    )
    print("Sent: " + ", ".join(f"{kind} {count}" for kind, count in sorted(recorder.sent_types.items())))
    if recorder.declines:
        print(
            "Offers declined: "
            + "; ".join(f"{why} ×{count}" for why, count in recorder.declines.most_common(6))
        )
    if recorder.errors:
        print("\nError frames: " + ", ".join(f"{code} ×{count}" for code, count in recorder.errors.items()))
        for sample in recorder.error_samples:
            print(f"  - {sample}")
    if recorder.refusals:
        print(
            "\nrenew_refused: "
            + "; ".join(f"{str(lease)[:8]}: {why}" for lease, why in recorder.refusals[:10])
        )

    driver = run.driver
    if driver is not None:
        print("\n## REST driver (whole run)\n")
        print(
            markdown(
                ["call", "calls", "p50 (ms)", "p95 (ms)", "p99 (ms)", "max (ms)"],
                [latency_row("POST /api/jobs/", driver.submit_seconds),
                 latency_row("POST /api/jobs/{id}/cancel/", driver.cancel_seconds)],
            )
        )  # fmt: skip
        print(
            f"\nsubmitted {driver.submitted}, cancelled {driver.cancelled}; failures: "
            + (", ".join(f"{what} ×{count}" for what, count in driver.failures.items()) or "none")
        )

    if run.cpu:
        lag = run.sampler.lag if run.sampler else []
        print("\n## CPU in the window (% of one core) and this process's event-loop lag\n")
        names = [*run.cpu, "benchmark (daemons + driver)"]
        other = run.machine_cpu - sum(run.cpu.values()) - run.bench_cpu_percent
        print(
            markdown(
                [*names, "other work on the machine", "machine (all cores)", "loop lag p99 (ms)",
                 "loop lag max (ms)"],
                [[*(f"{value:.0f}" for value in run.cpu.values()), f"{run.bench_cpu_percent:.0f}",
                  f"{max(0.0, other):.0f}", f"{run.machine_cpu:.0f}",
                  milliseconds(percentile(lag, 0.99)) if lag else "-", milliseconds(max(lag)) if lag else "-"]],
            )
        )  # fmt: skip
        print(
            f"\nBusiest process: {busiest(run)}; machine {run.machine_cpu:.0f} % of "
            f"{100 * (os.cpu_count() or 1)} % (what is not listed above is other work on the machine)"
        )
    if run.database:
        print(
            "\n## PostgreSQL (this run's database) and the Celery queue in the window, sampled every 0.25 s\n"
        )
        keys = list(run.database)
        print(markdown(keys, [[f"{run.database[key]:.1f}" for key in keys]]))
    if run.flood:
        print("\n## The flooders (whole window)\n")
        rows = [
            [str(index + 1), *(str(report.get(key, "-")) for key in
             ("connections", "welcomed", "frames_sent", "handled", "refused")),
             ", ".join(f"{code} ×{count}" for code, count in report.get("close_codes", {}).items()) or "-",
             ", ".join(f"{kind} ×{count}" for kind, count in report.get("failures", {}).items())
             or report.get("error", "-")]
            for index, report in enumerate(run.flood)
        ]  # fmt: skip
        print(
            markdown(
                ["flooder", "connections", "welcomed", "frames sent", "handled (unknown_lease)",
                 "refused (rate_limited)", "close codes", "failures"],
                rows,
            )
        )  # fmt: skip
    if run.problems:
        print("\n## Control-plane log: warnings and errors\n")
        for text, count in run.problems.most_common(15):
            print(f"- ×{count} {text}")
    if run.not_freed:
        print(
            f"\nwarning: {run.not_freed} daemons still held a lease or reservation {DRAIN_TIMEOUT:g}s after the drain"
        )
    return not wrongful and not lost


def print_by_web(run: Run, renewals: list[Renewal]) -> None:
    """The renewal path and the losses of the daemons of each web process (the flooders flood web 1)."""
    rows = []
    for web in sorted(set(run.web_of.values())):
        on_web = [r for r in renewals if run.web_of.get(run.leases[r.lease_id].worker) == web]
        leases = [lease for lease in run.leases.values() if run.web_of.get(lease.worker) == web]
        arrived = [r.request_arrived - r.due for r in on_web if r.request_arrived is not None]
        committed = [r.committed - r.confirmation_sent for r in on_web if r.confirmation_sent is not None]

        def pair(values: list[float]) -> str:
            if not values:
                return "-"
            return f"{milliseconds(percentile(values, 0.5))} / {milliseconds(percentile(values, 0.99))}"

        rows.append(
            [
                f"web {web + 1}" + (" (flooded)" if run.flood and web == 0 else ""),
                str(sum(1 for index in run.web_of.values() if index == web)),
                str(len(on_web)),
                pair(arrived),
                pair(committed),
                str(sum(lease.status == "expired" and lease.activated_at is not None for lease in leases)),
                str(sum(lease.status == "released" and lease.reason.startswith(f"released by the worker: {NOT_HELD}")
                        for lease in leases)),
            ]
        )  # fmt: skip
    print("\n## By web process (window; losses over the whole run)\n")
    print(
        markdown(
            ["web process", "daemons", "renewals", "due → renew_lease arrived p50 / p99 (ms)",
             "lease_renewed sent → committed p50 / p99 (ms)", "expired while ACTIVE", "dropped by the daemon"],
            rows,
        )
    )  # fmt: skip


def busiest(run: Run) -> str:
    """The control-plane process (or PostgreSQL, Redis) that used the most CPU in the window."""
    cpu = {name: percent for name, percent in run.cpu.items() if name != "flooders"}
    if not cpu:
        return "-"
    name = max(cpu, key=cpu.get)
    return f"{name} {cpu[name]:.0f} %"


def summary_row(run: Run, arguments: argparse.Namespace) -> list[str]:
    """One run's line of the side-by-side table."""
    renewals = renewals_in_window(run, arguments.ttl)
    seconds = max(run.window_end - run.window_start, 1e-9)
    held = sum(run.sampler.held) / len(run.sampler.held) if run.sampler and run.sampler.held else 0.0
    schedule = held / (arguments.ttl * (1.0 - RENEW_AT_REMAINING))
    due = [renewal.committed - renewal.due for renewal in renewals]
    leases = list(run.leases.values())
    wrongful = sum(lease.status == "expired" and lease.activated_at is not None for lease in leases)
    lost = sum(
        lease.status == "released" and lease.reason.startswith(f"released by the worker: {NOT_HELD}")
        for lease in leases
    )
    flood = ", ".join(
        f"{report.get('connections', 0)} connections, {report.get('handled', 0)} frames handled"
        for report in run.flood
    )
    return [
        str(run.scale), str(run.daemons), f"{run.fill_seconds:.0f}", f"{held:.0f}",
        f"{len(renewals) / seconds / schedule:.2f}" if schedule and renewals else "-",
        f"{milliseconds(percentile(due, 0.5))} / {milliseconds(percentile(due, 0.99))}" if due else "-",
        f"{min(renewal.left for renewal in renewals):.2f}" if renewals else "-",
        f"**{wrongful}**", f"**{lost}**", flood or "-", busiest(run), f"{run.machine_cpu:.0f}",
        f"{max(0.0, run.machine_cpu - sum(run.cpu.values()) - run.bench_cpu_percent):.0f}",
        f"{run.database.get('transactions/s', 0.0):.0f}" if run.database else "-",
        f"{run.database.get('Celery queue (mean)', 0.0):.1f} / {run.database.get('Celery queue (max)', 0.0):.0f}",
    ]  # fmt: skip


SUMMARY_HEADER = [
    "control plane", "daemons", "fill (s)", "leases held (mean)", "renewals ÷ schedule",
    "due → committed p50 / p99 (ms)", "least time left (s)", "expired while ACTIVE", "dropped by the daemon",
    "flooder", "busiest process (% of a core)", "machine CPU (%, 100 per core)", "of which other work",
    "PostgreSQL transactions/s", "Celery queue mean / max",
]  # fmt: skip
