"""The HTTP half of ``scripts/demo``: wait for the server, drive the REST API, print what happened.

Standard library only (urllib), so it runs with nothing but the server's requirements installed::

    python scripts/_demo_client.py wait-healthy --url http://127.0.0.1:8000 --pid 1234
    python scripts/_demo_client.py wait-online --url … --api-token KEY --workers demo-worker-1,demo-worker-2
    python scripts/_demo_client.py submit --url … --api-token KEY --num-trainers 2      # prints the job id
    python scripts/_demo_client.py wait-allocated --url … --api-token KEY --job ID
    python scripts/_demo_client.py leases --url … --api-token KEY --job ID

Exit codes: 0 done, 1 the API answered something unexpected or the wait timed out, 2 usage.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import urllib.error
import urllib.parse
import urllib.request

REQUEST_TIMEOUT = 5.0
POLL_INTERVAL = 0.25
#: Job states after which waiting for an allocation is pointless.
FINAL_JOB_STATES = {"failed", "cancelled", "completed"}
#: Counted as allocated: once every lease is active the job may move on to running.
ALLOCATED_JOB_STATES = {"allocated", "running"}


class DemoError(Exception):
    """Something the demo cannot go on from; the message says what."""


def request(url: str, *, token: str | None = None, method: str = "GET", body: dict | None = None):
    """``(status, decoded JSON or text)``; raises :class:`DemoError` when the server cannot be reached."""
    headers = {"Accept": "application/json"}
    data = None
    if token:
        headers["Authorization"] = f"Token {token}"
    if body is not None:
        data = json.dumps(body).encode()
        headers["Content-Type"] = "application/json"
    req = urllib.request.Request(url, data=data, headers=headers, method=method)
    try:
        with urllib.request.urlopen(req, timeout=REQUEST_TIMEOUT) as response:
            status, raw = response.status, response.read()
    except urllib.error.HTTPError as error:
        status, raw = error.code, error.read()
    except (urllib.error.URLError, OSError) as error:
        raise DemoError(f"{method} {url}: {getattr(error, 'reason', error)}") from None
    text = raw.decode("utf-8", "replace")
    try:
        return status, json.loads(text)
    except ValueError:
        return status, text


def api(base: str, path: str, *, token: str, method: str = "GET", body: dict | None = None, ok=(200,)):
    url = urllib.parse.urljoin(base.rstrip("/") + "/", path.lstrip("/"))
    status, payload = request(url, token=token, method=method, body=body)
    if status == 404 and isinstance(payload, str):
        raise DemoError(f"{method} {path}: 404 — the REST API has no such endpoint (not written yet?)")
    if status not in ok:
        raise DemoError(f"{method} {path}: HTTP {status}: {shorten(payload)}")
    return payload


def results(payload) -> list[dict]:
    """The items of a list response, paginated (``{"results": [...]}``) or not."""
    if isinstance(payload, dict) and isinstance(payload.get("results"), list):
        return payload["results"]
    if isinstance(payload, list):
        return payload
    raise DemoError(f"expected a list, got: {shorten(payload)}")


def shorten(payload, limit: int = 300) -> str:
    text = payload if isinstance(payload, str) else json.dumps(payload)
    return text if len(text) <= limit else text[:limit] + "…"


def process_alive(pid: int) -> bool:
    """True while ``pid`` runs (a zombie, exited but not yet reaped by its parent, counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True


# --- commands --------------------------------------------------------------------------------------


def wait_healthy(args) -> None:
    deadline = time.monotonic() + args.timeout
    url = args.url.rstrip("/") + "/healthz"
    last = "no answer yet"
    while time.monotonic() < deadline:
        if args.pid and not process_alive(args.pid):
            raise DemoError(f"the server (pid {args.pid}) exited before {url} answered")
        try:
            status, payload = request(url)
            if status == 200:
                return
            last = f"HTTP {status}: {shorten(payload, 120)}"
        except DemoError as error:
            last = str(error)
        time.sleep(POLL_INTERVAL)
    raise DemoError(f"{url} did not answer 200 within {args.timeout:g} s (last: {last})")


def wait_online(args) -> None:
    wanted = [name for name in args.workers.split(",") if name]
    pids = [int(pid) for pid in args.pids.split(",") if pid] if args.pids else []
    deadline = time.monotonic() + args.timeout
    seen: dict[str, str] = {}
    while True:
        workers = {w.get("name"): w for w in results(api(args.url, "/api/workers/", token=args.api_token))}
        states = {name: (workers.get(name) or {}).get("status", "unknown") for name in wanted}
        if states != seen:
            print("    " + ", ".join(f"{name}: {state}" for name, state in states.items()), flush=True)
            seen = states
        if all(state == "online" for state in states.values()):
            return
        for pid in pids:
            if not process_alive(pid):
                raise DemoError(f"a worker daemon (pid {pid}) exited before all workers were online")
        if time.monotonic() >= deadline:
            missing = [name for name, state in states.items() if state != "online"]
            raise DemoError(f"not online after {args.timeout:g} s: {', '.join(missing)}")
        time.sleep(POLL_INTERVAL)


def submit(args) -> None:
    body = {"name": args.name, "num_trainers": args.num_trainers}
    job = api(args.url, "/api/jobs/", token=args.api_token, method="POST", body=body, ok=(200, 201))
    if not isinstance(job, dict) or "id" not in job:
        raise DemoError(f"POST /api/jobs/ answered without a job id: {shorten(job)}")
    print(job["id"])


def wait_allocated(args) -> None:
    started = time.monotonic()
    last = None
    while True:
        job = api(args.url, f"/api/jobs/{args.job}/", token=args.api_token)
        status, reason = job.get("status"), job.get("status_reason")
        if (status, reason) != last:
            print(f"    {time.monotonic() - started:5.1f} s  {status}: {reason}", flush=True)
            last = (status, reason)
        if status in ALLOCATED_JOB_STATES:
            return
        if status in FINAL_JOB_STATES:
            raise DemoError(f"job {args.job} ended as {status!r} before it was allocated: {reason}")
        if time.monotonic() - started >= args.timeout:
            raise DemoError(f"job {args.job} not allocated after {args.timeout:g} s (status {status!r})")
        time.sleep(POLL_INTERVAL)


def leases(args) -> None:
    query = urllib.parse.urlencode({"job": args.job})
    rows = results(api(args.url, f"/api/leases/?{query}", token=args.api_token))
    if not rows:
        raise DemoError(f"job {args.job} has no leases")
    # Offers that lost leave a TEMPORARY lease behind that was released, never activated: count them apart.
    granted = [row for row in rows if row.get("activated_at")]
    lost = len(rows) - len(granted)
    rows = granted
    columns = ["role", "worker", "status", "price", "renewals", "expires_at"]
    table = [[_cell(row.get(column)) for column in columns] for row in rows]
    table.sort(key=lambda cells: (cells[0], cells[1]))
    widths = [max(len(column), *(len(cells[i]) for cells in table)) for i, column in enumerate(columns)]
    for cells in [columns, ["-" * width for width in widths], *table]:
        print(
            "    " + "  ".join(cell.ljust(width) for cell, width in zip(cells, widths, strict=True)).rstrip()
        )
    if lost:
        print(f"    (and {lost} offer(s) that lost: their temporary leases were released)")


def _cell(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="_demo_client.py", description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)

    command = commands.add_parser("wait-healthy", help="wait until GET /healthz answers 200")
    command.add_argument("--url", required=True)
    command.add_argument("--pid", type=int, help="fail at once if this process (the server) exits")
    command.add_argument("--timeout", type=float, default=60.0)
    command.set_defaults(run=wait_healthy)

    for name, function, help_text in [
        ("wait-online", wait_online, "wait until the named workers are online"),
        ("submit", submit, "submit a job and print its id"),
        ("wait-allocated", wait_allocated, "wait until the job is allocated, printing its status_reason"),
        ("leases", leases, "print a table of the job's leases"),
    ]:
        command = commands.add_parser(name, help=help_text)
        command.add_argument("--url", required=True)
        command.add_argument("--api-token", required=True)
        command.add_argument("--timeout", type=float, default=30.0)
        command.set_defaults(run=function)
        if name == "wait-online":
            command.add_argument("--workers", required=True, help="comma-separated worker names")
            command.add_argument("--pids", help="comma-separated daemon pids: fail at once if one exits")
        if name == "submit":
            command.add_argument("--name", default="demo")
            command.add_argument("--num-trainers", type=int, default=2)
        if name in {"wait-allocated", "leases"}:
            command.add_argument("--job", required=True)

    args = parser.parse_args(argv)
    try:
        args.run(args)
    except DemoError as error:
        print(f"demo: error: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
