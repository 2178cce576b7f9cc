"""Upload memory benchmark: the control plane's resident memory while a user streams a large upload.

It starts the real control plane (``bench/harness.py``: embedded, or web + worker + beat in services mode),
makes a user token, and streams ``--size`` MiB to ``POST /api/uploads/?name=…`` with a ``Content-Length`` (1 MiB
chunks of random bytes from a generator: the client never holds the file). A thread samples the serving
process's ``VmRSS`` from ``/proc/<pid>/status`` every 50 ms; ``VmHWM`` (the kernel's own high-water mark)
is read before and after. Reported: RSS before, the peak, RSS 2 s after the answer, and the growth of the
high-water mark, in MiB (2^20 bytes). Goal (issue 12): growth < 64 MiB for a 1 GiB upload.

Usage::

    python bench/upload_memory.py                 # 1024 MiB, embedded unless DATABASE_URL/REDIS_URL are set
    python bench/upload_memory.py --size 256
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
import threading
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

import httpx  # noqa: E402

from bench.harness import (  # noqa: E402
    control_plane,
    exit_on_sigterm,
    load_average,
    print_markdown_header,
    resolve_mode,
    run_directory,
)

CHUNK = 1 << 20
MIB = 1 << 20


def memory_kib(pid: int) -> dict[str, int]:
    """``VmRSS`` and ``VmHWM`` of ``pid`` in KiB, from ``/proc/<pid>/status``."""
    values = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, rest = line.partition(":")
        if key in {"VmRSS", "VmHWM"}:
            values[key] = int(rest.split()[0])
    return values


def chunks(total: int, digest):
    """``total`` bytes of random data in 1 MiB chunks, hashed into ``digest`` as they go."""
    block = os.urandom(CHUNK)
    sent = 0
    while sent < total:
        piece = block[: min(CHUNK, total - sent)]
        digest.update(piece)
        sent += len(piece)
        yield piece


def measure(base_url: str, token: str, pid: int, size: int) -> dict[str, float]:
    """Stream ``size`` bytes as one upload; the server's memory before, during and after (MiB)."""
    samples: list[int] = []
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            samples.append(memory_kib(pid)["VmRSS"])
            stop.wait(0.05)

    before = memory_kib(pid)
    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    digest = hashlib.sha256()
    started = time.monotonic()
    with httpx.Client(base_url=base_url, headers={"Authorization": f"Token {token}"}, timeout=600) as client:
        response = client.post(
            "/api/uploads/",
            params={"name": "bench.bin"},
            content=chunks(size, digest),
            # A declared length, as most clients send (a chunked body is streamed the same way).
            headers={"Content-Type": "application/octet-stream", "Content-Length": str(size)},
        )
        elapsed = time.monotonic() - started
        if response.status_code != 201 or response.json()["sha256"] != digest.hexdigest():
            raise SystemExit(f"upload refused or corrupted: {response.status_code} {response.text[:500]}")
        time.sleep(2.0)
        stop.set()
        sampler.join()
        after = memory_kib(pid)
        client.delete(f"/api/uploads/{response.json()['id']}/")  # 404 before DELETE existed: harmless
    return {
        "rss_before": before["VmRSS"] / 1024,
        "rss_peak": max(samples, default=0) / 1024,
        "rss_after": after["VmRSS"] / 1024,
        "hwm_growth": (after["VmHWM"] - before["VmHWM"]) / 1024,
        "seconds": elapsed,
    }


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--size", type=int, default=1024, help="upload size in MiB (default 1024)")
    parser.add_argument("--mode", choices=["auto", "embedded", "services"], default="auto")
    parser.add_argument("--keep", action="store_true", help="keep the run directory (logs, data)")
    args = parser.parse_args()
    exit_on_sigterm()
    mode = resolve_mode(args.mode)
    load_at_start = load_average()
    settings = {"HYPHA_MAX_UPLOAD_BYTES": str(max(args.size * MIB, 1 << 30))}
    with (
        run_directory("hypha-upload-bench-", keep=args.keep) as root,
        control_plane(mode=mode, root=root, settings=settings) as plane,
    ):
        server = next(child for child in plane.children if child.name in {"server", "web"})
        token = plane.manage("create_user_token", "bench-uploader")
        result = measure(plane.base_url, token, server.popen.pid, args.size * MIB)
        print_markdown_header(
            "Upload memory",
            mode=mode,
            details=plane.details,
            load_at_start=load_at_start,
            settings=settings,
            run=f"one upload of {args.size} MiB (Content-Length, streamed)",
        )
    print()
    print("| upload | RSS before | RSS peak | RSS 2 s after | VmHWM growth | time |")
    print("|---|---|---|---|---|---|")
    print(
        f"| {args.size} MiB | {result['rss_before']:.0f} MiB | {result['rss_peak']:.0f} MiB "
        f"| {result['rss_after']:.0f} MiB | {result['hwm_growth']:.0f} MiB | {result['seconds']:.1f} s |"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
