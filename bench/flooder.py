"""A hostile worker for the control-plane benchmarks: floods the gateway with frames, reconnecting whenever it
is closed, until SIGTERM; then prints what it saw as one JSON line on stdout.

The flood of ``tests/e2e/test_flood.py`` (issue "Real runs and hostile input"), without its pauses: a real worker
token says ``hello`` (resources it never bids with: a price floor no advert meets), and once welcomed sends
``lease_renewed`` frames of leases it does not hold as fast as its socket takes them, while it reads what comes
back (``unknown_lease`` for each frame the gateway handled, ``rate_limited`` refusals). When the gateway closes
the connection (4008 when its backlog bound is passed) it connects again at once: a flooder gets a fresh
burst per connection, a limit deploy.md names as open.

Run by ``bench/fleet.py --flooders N`` as a process of its own (its CPU is the hostile load)::

    HYPHA_WORKER_TOKEN=hw_… python -m bench.flooder --url ws://127.0.0.1:8000/ws/worker/
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:  # run as `python bench/flooder.py`: the repo root is not on the path
    sys.path.insert(0, str(REPO_ROOT))

from websockets.asyncio.client import connect  # noqa: E402
from websockets.exceptions import ConnectionClosed, InvalidHandshake  # noqa: E402

from bench import harness  # noqa: E402
from worker_daemon import protocol  # noqa: E402

#: Seconds to wait for a welcome before giving up on a connection; and before connecting again after a failure.
WELCOME_TIMEOUT = 30.0
RETRY_DELAY = 0.1


@dataclass
class FloodCounts:
    connections: int = 0
    welcomed: int = 0
    frames_sent: int = 0
    #: Frames the gateway handled (each answered ``unknown_lease``) and refused (``rate_limited``).
    handled: int = 0
    refused: int = 0
    #: Close codes of the connections (None: closed without a code), and connection failures by kind.
    close_codes: Counter = field(default_factory=Counter)
    failures: Counter = field(default_factory=Counter)
    seconds: float = 0.0


def hello() -> protocol.Hello:
    return protocol.Hello(
        protocol_version=protocol.PROTOCOL_VERSION,
        daemon_version="flooder",
        resources={"cpu": 1, "memory": 1, "storage": 0, "gpu": 0},
        executors=[],
        price_floor=1e6,
        strategy="whole",
        leases=[],
    )


async def flood_once(url: str, token: str, counts: FloodCounts) -> None:
    """One connection: hello, then ``lease_renewed`` frames of unknown leases until the gateway closes it."""
    counts.connections += 1
    async with connect(
        url, additional_headers={"Authorization": f"Bearer {token}"}, max_queue=None, ping_interval=None
    ) as socket:
        await socket.send(protocol.encode(hello()))
        welcome = json.loads(await asyncio.wait_for(socket.recv(), timeout=WELCOME_TIMEOUT))
        if welcome.get("type") != "welcome":
            counts.failures[f"no welcome: {welcome.get('type')}"] += 1
            return
        counts.welcomed += 1

        async def listen() -> None:
            with contextlib.suppress(ConnectionClosed):
                async for message in socket:
                    code = json.loads(message).get("code")
                    if code == "unknown_lease":
                        counts.handled += 1
                    elif code == "rate_limited":
                        counts.refused += 1

        listener = asyncio.create_task(listen())
        frame = json.dumps({"type": "lease_renewed", "lease_id": str(uuid.uuid4())})
        with contextlib.suppress(ConnectionClosed):
            while not listener.done():
                await socket.send(frame)
                counts.frames_sent += 1
        await listener
    counts.close_codes[str(socket.close_code)] += 1


async def flood(url: str, token: str, counts: FloodCounts, stop: asyncio.Event) -> None:
    started = time.monotonic()
    while not stop.is_set():
        try:
            await flood_once(url, token, counts)
        except (OSError, InvalidHandshake, TimeoutError, ConnectionClosed) as error:
            counts.failures[type(error).__name__] += 1
            await asyncio.sleep(RETRY_DELAY)
        counts.seconds = time.monotonic() - started


async def main_async(url: str, token: str) -> FloodCounts:
    counts = FloodCounts()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signal_number in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signal_number, stop.set)
    task = asyncio.create_task(flood(url, token, counts, stop))
    await stop.wait()
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    return counts


# --- for the benchmarks: flooders as processes --------------------------------------------------------------


def start_flooders(plane: harness.ControlPlane, tokens: list[str], log_dir: Path) -> list[subprocess.Popen]:
    """One ``bench/flooder.py`` process per token, flooding the first web process."""
    url = plane.base_url.replace("http://", "ws://", 1) + "/ws/worker/"
    started = []
    for index, token in enumerate(tokens):
        env = {key: value for key, value in os.environ.items() if not key.startswith("HYPHA_")}
        env["HYPHA_WORKER_TOKEN"] = token
        with (log_dir / f"flooder-{index + 1}.log").open("ab") as log:
            started.append(
                subprocess.Popen(
                    [sys.executable, "-m", "bench.flooder", "--url", url],
                    cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=log, text=True,
                    start_new_session=True, preexec_fn=harness.stop_with_parent,
                )
            )  # fmt: skip
    return started


def stop_flooders(flooders: list[subprocess.Popen]) -> list[dict]:
    """SIGTERM each flooder and read its report (an error entry if it has none)."""
    for flooder in flooders:
        with contextlib.suppress(ProcessLookupError):
            flooder.send_signal(signal.SIGTERM)
    reports = []
    for flooder in flooders:
        try:
            output, _ = flooder.communicate(timeout=30)
            reports.append(json.loads(output.strip().splitlines()[-1]))
        except (subprocess.TimeoutExpired, ValueError, IndexError) as error:
            flooder.kill()
            flooder.communicate()
            reports.append({"error": f"no report from the flooder: {type(error).__name__}"})
    return reports


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.flooder", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--url", required=True, help="the gateway's websocket URL (ws://host:port/ws/worker/)"
    )
    arguments = parser.parse_args(argv)
    token = os.environ.get("HYPHA_WORKER_TOKEN", "")
    if not token:
        parser.error("HYPHA_WORKER_TOKEN must hold the flooder's worker token")
    counts = asyncio.run(main_async(arguments.url, token))
    # asdict() would rebuild the Counters from their (key, count) pairs, counting the pairs: plain dicts.
    report = {**asdict(counts), "close_codes": dict(counts.close_codes), "failures": dict(counts.failures)}
    print(json.dumps(report), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
