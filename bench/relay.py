"""Relay benchmark (issue 14): the control plane's memory while a large body is relayed, and how much of a cut
transfer is sent again when it resumes.

For each store (``local``: the bytes go through the control plane's ``/relay/`` routes; ``s3``: through a
``rclone serve s3`` on loopback, the control plane only indexes) and each mode (embedded: one ``hypha-server``;
services: web + Celery worker + beat on PostgreSQL and Redis — ``bench/harness.py``), it starts the real
control plane, makes the relay tests' cast in its database (a running job with a live parameter server and
its transfer token: ``tests/apps/relay/world.py``, through ``manage.py shell`` — no market round), writes a
``--size`` MiB file and moves it with the daemons' own client (``worker_daemon/relay.py``, ``RelayClient``):

1. **up**: ``upload`` (hash, ``POST uploads/``, a PUT per part, complete);
2. **down**: ``download`` of that object (to a file, SHA-256 checked);
3. **slow down**: the same through a proxy that passes at most ``--slow-rate`` MiB/s to the client: a thin
   link, the case where a server without backpressure holds what the client has not read yet;
4. **resume up**: another key, through a proxy that cuts every connection once the client has sent half the
   body's bytes and refuses connections until the client's ``upload`` has given up (a daemon that lost its
   network); then a new client (a new session, as after a restart) calls ``upload`` again, which asks
   ``uploads/`` which parts are done and sends the others. Reported: the bytes it sent ÷ the body;
5. **resume down**: the same for ``download``: cut at half the body, then a new ``download`` of the same
   object resumes the partial file with a ``Range`` request. Reported: the bytes it received ÷ the body.

The proxy counts every byte each way (headers and API calls included); with the local store it stands
between the client and the control plane (the URLs the relay mints name the host the client used), with S3
between everyone and rclone (``HYPHA_RELAY_S3_ENDPOINT`` names it, so presigned URLs do). Phases 1 and 2 go
straight to the control plane with the local store.

While each phase runs a thread samples ``VmRSS`` (``/proc/<pid>/status``) of every process of every
control-plane process group (the Celery worker's pool processes too) every 50 ms. Reported per process
group: the largest growth of one of its processes over its RSS when the phase began, and over the whole run
(against the RSS before the first transfer). rclone's own RSS is shown beside, not part of the goal.

Goals (issue 14): RSS growth < 64 MiB in every control-plane process for a 1 GiB body up and down; a resumed
upload or download sends ≤ 55 % of the body again (half of it, plus at most one part).

Usage::

    python bench/relay.py                                    # 1024 MiB; embedded, + services if DATABASE_URL
                                                             # and REDIS_URL are set; local + s3 (rclone)
    python bench/relay.py --size 256 --modes embedded --stores local
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import hashlib
import json
import os
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

import aiohttp  # noqa: E402

from bench.harness import (  # noqa: E402
    MODE_DESCRIPTIONS,
    control_plane,
    exit_on_sigterm,
    load_average,
    machine_details,
    resolve_mode,
    run_directory,
)
from worker_daemon.relay import RelayClient  # noqa: E402

MIB = 1 << 20
#: Bytes the proxy moves per read, each way.
PROXY_CHUNK = 256 << 10
#: Growth bound of the goal, and the most a resumed transfer may send again (÷ the body) for 1 GiB.
MEMORY_GOAL_MIB = 64
RESUME_GOAL = 0.55
#: The relay's default part size (``HYPHA_RELAY_PART_SIZE``, not set here): a resumed upload sends again the
#: half not stored plus at most one part, so a body under 320 MiB is held to that instead of 55 %.
PART_SIZE = 16 * MIB
#: The phases with a column of their own in the report (the resume phases count in "whole run").
PHASES = ("up", "down", "slow down")

#: Makes the relay tests' cast in the control plane's database; prints the job and its parameter server's token.
MAKE_WORLD = """
import json
from tests.apps.relay.world import make_world
world = make_world("bench")
print(json.dumps({"job": str(world.job.pk), "token": world.server.token}))
"""


# --- memory ---------------------------------------------------------------------------------------------------


def rss_kib(pid: int) -> int | None:
    """``VmRSS`` of ``pid`` in KiB; None when the process is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


def group_members(pgid: int) -> list[int]:
    """The pids of process group ``pgid`` (a control-plane child leads its own: ``start_new_session``)."""
    members = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # pid (comm) state ppid pgrp …: comm may hold spaces and parentheses, so split after its last ')'.
        if int(stat.rsplit(")", 1)[1].split()[2]) == pgid:
            members.append(int(entry.name))
    return sorted(members)


class MemorySampler:
    """Samples the RSS of every process of some process groups every 50 ms in a thread. Per phase (the
    :meth:`phase` block) and per group: the largest growth of one of its processes over its RSS at the
    phase's start; over the whole run, over its RSS at the first phase's start."""

    def __init__(self, groups: dict[str, Callable[[], list[int]]]) -> None:
        self.groups = groups  # name → its pids now
        self.first: dict[int, int] = {}  # pid → KiB at the start of the run
        self.phases: dict[str, dict[str, float]] = {}  # phase → group → MiB growth
        self.whole: dict[str, float] = dict.fromkeys(groups, 0.0)

    @contextlib.contextmanager
    def phase(self, name: str):
        members = {group: pids() for group, pids in self.groups.items()}
        start = {pid: rss_kib(pid) or 0 for pids in members.values() for pid in pids}
        for pid, kib in start.items():
            self.first.setdefault(pid, kib)
        peak = dict(start)
        stop = threading.Event()

        def sample() -> None:
            while not stop.wait(0.05):
                for pid in peak:
                    if (kib := rss_kib(pid)) is not None and kib > peak[pid]:
                        peak[pid] = kib

        thread = threading.Thread(target=sample, daemon=True)
        thread.start()
        try:
            yield
        finally:
            stop.set()
            thread.join()
            self.phases[name] = {
                group: max((peak[pid] - start[pid] for pid in pids), default=0) / 1024
                for group, pids in members.items()
            }
            for group, pids in members.items():
                growth = max((peak[pid] - self.first[pid] for pid in pids), default=0) / 1024
                self.whole[group] = max(self.whole[group], growth)


# --- a proxy that counts, cuts and throttles ------------------------------------------------------------------


class Proxy:
    """A TCP proxy on loopback to ``target`` in a thread of its own (its own event loop), counting the bytes
    each way. ``cut_up_at`` / ``cut_down_at``: once that many bytes went up (client → server) or down, every
    connection is cut and new ones are refused until :meth:`restore`. ``rate``: bytes/s passed down at most."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self.up = 0
        self.down = 0
        self.cut_up_at: int | None = None
        self.cut_down_at: int | None = None
        self.refusing = False
        self.rate: float | None = None
        self._paced_since = 0.0
        self._paced_bytes = 0
        self._transports: set = set()
        self._loop = asyncio.new_event_loop()
        ready = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(ready,), daemon=True)
        self._thread.start()
        ready.wait()

    def _run(self, ready: threading.Event) -> None:
        asyncio.set_event_loop(self._loop)
        server = self._loop.run_until_complete(asyncio.start_server(self._connection, "127.0.0.1", 0))
        self.port = server.sockets[0].getsockname()[1]
        ready.set()
        self._loop.run_forever()
        server.close()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def reset(
        self, *, cut_up_at: int | None = None, cut_down_at: int | None = None, rate: float | None = None
    ):
        """Counters to zero, the given cut points and rate (bytes), and connections accepted again."""
        self.up = self.down = 0
        self.cut_up_at, self.cut_down_at, self.rate = cut_up_at, cut_down_at, rate
        self._paced_since, self._paced_bytes = time.monotonic(), 0
        self.refusing = False

    restore = reset

    def close(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)

    def _cut(self) -> None:
        self.refusing = True
        for transport in list(self._transports):
            transport.abort()

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.refusing:
            writer.transport.abort()
            return
        try:
            upstream_reader, upstream_writer = await asyncio.open_connection(*self.target)
        except OSError:
            writer.transport.abort()
            return
        transports = {writer.transport, upstream_writer.transport}
        self._transports |= transports
        try:
            await asyncio.gather(
                self._pump(reader, upstream_writer, down=False),
                self._pump(upstream_reader, writer, down=True),
                return_exceptions=True,
            )
        finally:
            self._transports -= transports
            for transport in transports:
                transport.abort()

    async def _pump(self, source: asyncio.StreamReader, sink: asyncio.StreamWriter, *, down: bool) -> None:
        while data := await source.read(PROXY_CHUNK):
            if down:
                limit, self.down = self.cut_down_at, self.down + len(data)
                crossed = limit is not None and self.down >= limit
            else:
                limit, self.up = self.cut_up_at, self.up + len(data)
                crossed = limit is not None and self.up >= limit
            if crossed:
                self._cut()
                return
            sink.write(data)
            await sink.drain()
            if down and self.rate:
                self._paced_bytes += len(data)
                ahead = self._paced_since + self._paced_bytes / self.rate - time.monotonic()
                if ahead > 0:
                    await asyncio.sleep(ahead)
        if sink.can_write_eof():
            sink.write_eof()


# --- one configuration -------------------------------------------------------------------------------------


@dataclass
class Result:
    store: str
    mode: str
    memory: dict[str, dict[str, float]] = field(default_factory=dict)  # phase → group → MiB
    whole: dict[str, float] = field(default_factory=dict)  # group → MiB
    seconds: dict[str, float] = field(default_factory=dict)  # phase → s
    resume: dict[str, float] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    details: dict[str, str] = field(default_factory=dict)


def write_body(path: Path, size: int) -> str:
    """``size`` bytes (random, each MiB numbered so no two are alike) at ``path``; their SHA-256."""
    block = bytearray(os.urandom(MIB))
    digest = hashlib.sha256()
    with path.open("wb") as handle:
        for index in range(-(-size // MIB)):
            piece = memoryview(block)[: min(MIB, size - index * MIB)]
            block[:8] = index.to_bytes(8, "big")
            handle.write(piece)
            digest.update(piece)
    return digest.hexdigest()


def relay_client(url: str, world: dict, session: aiohttp.ClientSession) -> RelayClient:
    # Short retry delays: the cut phases wait for the client to give up, not for its back-off.
    return RelayClient(url, world["job"], lambda: world["token"], session, read_timeout=120, retry_delay=0.05)


async def transfers(
    result: Result,
    *,
    base_url: str,
    world: dict,
    source: Path,
    sha256: str,
    size: int,
    proxy: Proxy,
    via_proxy: str,
    memory: MemorySampler,
    slow_rate: float,
    root: Path,
) -> None:
    """The five phases (see the module), into ``result``. ``via_proxy``: the control plane's URL for the
    client in the phases that need the proxy in the path (the proxy itself with the local store)."""

    async def timed(phase: str, work):
        with memory.phase(phase):
            started = time.monotonic()
            answer = await work
            result.seconds[phase] = time.monotonic() - started
        return answer

    async with aiohttp.ClientSession() as session:
        direct = relay_client(base_url, world, session)
        proxy.reset()
        obj = await timed("up", direct.upload("model/1/body.bin", source))
        if (obj["size"], obj["sha256"]) != (size, sha256):
            raise SystemExit(f"the relay holds another object than the one sent: {obj}")
        target = root / "received.bin"
        await timed("down", direct.download(obj, target))
        target.unlink()
        if slow_rate:
            proxied = relay_client(via_proxy, world, session)
            obj = await proxied.get("model/1/body.bin")  # its URL names the proxy (local store)
            proxy.reset(rate=slow_rate)
            await timed("slow down", proxied.download(obj, target))
            proxy.reset()
            target.unlink()

    # Resume up: cut at half the body, refused until the client gives up; then a new client, a new session.
    key = "model/2/body.bin"
    proxy.reset(cut_up_at=size // 2)
    async with aiohttp.ClientSession() as session:
        try:
            await timed("resume up", relay_client(via_proxy, world, session).upload(key, source))
            result.notes.append("resume up: the cut did not happen (the upload completed)")
        except Exception as error:  # what a daemon's upload raises when its network goes away
            result.notes.append(f"resume up: the first upload failed with {type(error).__name__}")
    first_up = proxy.up
    proxy.restore()
    async with aiohttp.ClientSession() as session:
        with memory.phase("resume up (again)"):
            obj = await relay_client(via_proxy, world, session).upload(key, source)
    result.resume["up first"] = first_up / size
    result.resume["up again"] = proxy.up / size
    if (obj["size"], obj["sha256"]) != (size, sha256):
        raise SystemExit(f"the resumed upload made another object: {obj}")

    # Resume down: the same for a download of that object.
    target = root / "resumed.bin"
    async with aiohttp.ClientSession() as session:
        client = relay_client(via_proxy, world, session)
        obj = await client.get(key)
        proxy.reset(cut_down_at=size // 2)
        try:
            await timed("resume down", client.download(obj, target))
            result.notes.append("resume down: the cut did not happen (the download completed)")
        except Exception as error:
            result.notes.append(f"resume down: the first download failed with {type(error).__name__}")
    first_down = proxy.down
    proxy.restore()
    async with aiohttp.ClientSession() as session:
        with memory.phase("resume down (again)"):
            received = await relay_client(via_proxy, world, session).download(obj, target)
    result.resume["down first"] = first_down / size
    result.resume["down again"] = proxy.down / size
    with target.open("rb") as handle:  # the client checked it too; this checks the client
        if received != size or hashlib.file_digest(handle, "sha256").hexdigest() != sha256:
            raise SystemExit("the resumed download is not the object")
    target.unlink()
    async with aiohttp.ClientSession() as session:
        for name in ("model/1/body.bin", key):
            await relay_client(base_url, world, session).delete(name)


def run_configuration(store: str, mode: str, args, root: Path, s3) -> Result:
    """One store in one mode: start the control plane (and the proxy), run the phases, stop everything."""
    result = Result(store=store, mode=mode)
    size = args.size * MIB
    settings = {"HYPHA_RELAY_STORE": store}
    proxy = None
    if store == "s3":
        from tests.apps.relay.world import S3_ACCESS_KEY, S3_SECRET_KEY

        proxy = Proxy(("127.0.0.1", int(s3.endpoint.rsplit(":", 1)[1])))
        settings |= {
            "HYPHA_RELAY_S3_ENDPOINT": proxy.url,
            "HYPHA_RELAY_S3_BUCKET": s3.bucket,
            "HYPHA_RELAY_S3_REGION": "us-east-1",
            "HYPHA_RELAY_S3_ACCESS_KEY_ID": S3_ACCESS_KEY,
            "HYPHA_RELAY_S3_SECRET_ACCESS_KEY": S3_SECRET_KEY,
            "HYPHA_RELAY_S3_PREFIX": f"bench-{mode}/",
        }
    run_root = root / f"{store}-{mode}"
    try:
        with control_plane(mode=mode, root=run_root, settings=settings) as plane:
            result.details = plane.details
            world = json.loads(plane.manage("shell", "--command", MAKE_WORLD).splitlines()[-1])
            host, port = plane.base_url.rsplit("/", 1)[1].split(":")
            if proxy is None:
                proxy = Proxy((host, int(port)))
            via_proxy = plane.base_url if store == "s3" else proxy.url
            groups = {
                child.name: functools.partial(group_members, child.popen.pid) for child in plane.children
            }
            if store == "s3":
                groups["rclone (S3)"] = lambda: [s3.pid]
            source = run_root / "body.bin"
            sha256 = write_body(source, size)
            memory = MemorySampler(groups)
            asyncio.run(
                transfers(
                    result, base_url=plane.base_url, world=world, source=source, sha256=sha256, size=size,
                    proxy=proxy, via_proxy=via_proxy, memory=memory, slow_rate=args.slow_rate * MIB,
                    root=run_root,
                )
            )  # fmt: skip
            source.unlink()
            result.memory, result.whole = memory.phases, memory.whole
    finally:
        if proxy is not None:
            proxy.close()
    return result


# --- the S3 server ------------------------------------------------------------------------------------------


@dataclass
class S3:
    endpoint: str
    bucket: str
    pid: int


@contextlib.contextmanager
def s3_server(root: Path, wanted: bool):
    """``rclone serve s3`` on loopback (the relay tests' own, ``tests/apps/relay/world.py``); None when not
    ``wanted`` or when rclone cannot run here (said on stderr)."""
    if not wanted:
        yield None
        return
    import pytest

    from tests.apps.relay.world import start_s3_server

    running = start_s3_server(root)
    try:
        server = next(running)
    except pytest.skip.Exception as skipped:
        print(f"the s3 store is skipped: {skipped}", file=sys.stderr)
        yield None
        return
    try:
        (pid,) = [
            int(entry.name)
            for entry in Path("/proc").iterdir()
            if entry.name.isdigit() and _parent_and_name(entry) == (os.getpid(), "rclone")
        ]
        yield S3(endpoint=server.endpoint, bucket=server.bucket, pid=pid)
    finally:
        running.close()


def _parent_and_name(entry: Path) -> tuple[int, str] | None:
    try:
        stat = (entry / "stat").read_text()
    except OSError:
        return None
    name, rest = stat.split("(", 1)[1].rsplit(")", 1)
    return int(rest.split()[1]), name


# --- report -------------------------------------------------------------------------------------------------


def print_report(results: list[Result], args, load_at_start: str) -> None:
    import datetime

    print(f"# Relay: memory and resume — {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC\n")
    for key, value in machine_details().items():
        print(f"- {key}: {value}")
    print(f"- load average (1/5/15 min): {load_at_start} at start, {load_average()} at the end")
    for mode in dict.fromkeys(result.mode for result in results):
        print(f"- {mode}: {MODE_DESCRIPTIONS[mode]}")
    details = {key: value for result in results for key, value in result.details.items()}
    for key, value in details.items():
        print(f"- {key}: {value}")
    print(
        f"- body {args.size} MiB, parts of 16 MiB (the default), slow reader {args.slow_rate} MiB/s; "
        f"command: {' '.join(sys.argv)}"
    )
    print("\nPeak RSS growth (MiB) of each process group's largest process, per phase and over the whole run")
    print(
        f"(goal < {MEMORY_GOAL_MIB} MiB in every control-plane process; rclone is the S3 store, not ours):\n"
    )
    phases = [phase for phase in PHASES if any(phase in result.memory for result in results)]
    print("| store | mode | process | " + " | ".join(phases) + " | whole run | < 64 MiB |")
    print("|---|---|---|" + "---:|" * len(phases) + "---:|:---:|")
    for result in results:
        for group, whole in result.whole.items():
            cells = [f"{result.memory.get(phase, {}).get(group, float('nan')):.1f}" for phase in phases]
            verdict = "–" if group.startswith("rclone") else ("yes" if whole < MEMORY_GOAL_MIB else "**no**")
            print(
                f"| {result.store} | {result.mode} | {group} | "
                + " | ".join(cells)
                + f" | {whole:.1f} | {verdict} |"
            )
    print("\nSeconds per phase (MB/s = 10⁶ bytes/s):\n")
    print("| store | mode | " + " | ".join(phases) + " |")
    print("|---|---|" + "---:|" * len(phases))
    for result in results:
        cells = []
        for phase in phases:
            seconds = result.seconds.get(phase)
            cells.append(
                "–" if seconds is None else f"{seconds:.1f} s ({args.size * MIB / seconds / 1e6:,.0f})"
            )
        print(f"| {result.store} | {result.mode} | " + " | ".join(cells) + " |")
    # Half the body plus one part, with 1 % for headers and API calls; never stricter than the 55 %.
    goal = max(RESUME_GOAL, round(0.5 + PART_SIZE / (args.size * MIB) + 0.01, 3))
    print(f"\nResume after a cut at half the body: bytes on the wire ÷ the body (goal ≤ {goal}):\n")
    print(f"| store | mode | upload: before the cut | upload: resumed | ≤ {goal} | download: before the cut "
          f"| download: resumed | ≤ {goal} |")  # fmt: skip
    print("|---|---|---:|---:|:---:|---:|---:|:---:|")
    for result in results:
        r = result.resume
        ok_up = "yes" if r["up again"] <= goal else "**no**"
        ok_down = "yes" if r["down again"] <= goal else "**no**"
        print(
            f"| {result.store} | {result.mode} | {r['up first']:.3f} | {r['up again']:.3f} | {ok_up} "
            f"| {r['down first']:.3f} | {r['down again']:.3f} | {ok_down} |"
        )
    for result in results:
        for note in result.notes:
            print(f"\n- {result.store}, {result.mode}: {note}", end="")
    print()


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--size", type=int, default=1024, help="body size in MiB (default 1024)")
    parser.add_argument(
        "--slow-rate", type=float, default=64, help="slow reader's MiB/s (0: skip; default 64)"
    )
    parser.add_argument("--modes", default="auto", help="embedded,services (default: embedded, + services "
                        "when DATABASE_URL and REDIS_URL are set)")  # fmt: skip
    parser.add_argument("--stores", default="local,s3", help="local,s3 (default both; s3 needs rclone)")
    parser.add_argument("--keep", action="store_true", help="keep the run directory (logs, data)")
    args = parser.parse_args()
    exit_on_sigterm()
    if args.modes == "auto":
        modes = ["embedded"] + (["services"] if resolve_mode("auto") == "services" else [])
    else:
        modes = [resolve_mode(mode.strip()) for mode in args.modes.split(",")]
    stores = [store.strip() for store in args.stores.split(",")]
    load_at_start = load_average()
    results = []
    with (
        run_directory("hypha-relay-bench-", keep=args.keep) as root,
        s3_server(root / "s3", "s3" in stores) as s3,
    ):
        for store in stores:
            if store == "s3" and s3 is None:
                continue
            for mode in modes:
                print(f"{store}, {mode} …", file=sys.stderr, flush=True)
                results.append(run_configuration(store, mode, args, root, s3))
    print_report(results, args, load_at_start)
    return 0


if __name__ == "__main__":
    sys.exit(main())
