"""Channel-layer sends from synchronous code: one ``async_to_sync`` call per send against one batch.

The Celery worker sends the lease clock's renewal requests and a settlement's declines from synchronous code.
Each ``async_to_sync`` call from a thread without an event loop runs a new loop, and channels_redis opens a
new Redis connection per loop; :func:`hypha_site.runtime.group_send_many` sends a whole batch in one call.
This prints, for a few batch sizes, the cost per send both ways, measured side by side in one run.

Usage::

    REDIS_URL=redis://127.0.0.1:6379/15 SECRET_KEY=… python bench/channel_sends.py   # channels_redis
    python bench/channel_sends.py                                                  # in-memory layer
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import uuid
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "hypha_site.settings")

import django  # noqa: E402

django.setup()

from django.conf import settings  # noqa: E402

from bench.simulated import markdown  # noqa: E402
from hypha_site import runtime  # noqa: E402


def one_by_one(sends: list[tuple[str, dict]]) -> None:
    for group, message in sends:
        runtime.group_send(group, message)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[10, 50, 200], help="sends per batch")
    parser.add_argument("--repeat", type=int, default=5, help="batches of each size, each way")
    arguments = parser.parse_args(argv)
    layer = settings.CHANNEL_LAYERS["default"]["BACKEND"].rsplit(".", 1)[-1]
    print(f"channel layer: {layer}; {arguments.repeat} batches per size and way, interleaved\n")
    rows = []
    for size in arguments.sizes:
        timings: dict[str, list[float]] = {"one by one": [], "batched": []}
        for _ in range(arguments.repeat):
            for way, send in (("one by one", one_by_one), ("batched", runtime.group_send_many)):
                prefix = uuid.uuid4().hex[:8]
                sends = [
                    (f"bench-{prefix}-{index}", {"type": "bench.frame", "text": "x"}) for index in range(size)
                ]
                started = time.perf_counter()
                send(sends)
                timings[way].append((time.perf_counter() - started) / size)
        single, batched = (sorted(values)[len(values) // 2] for values in timings.values())
        rows.append([str(size), f"{single * 1000:.3f}", f"{batched * 1000:.3f}", f"{single / batched:.1f}×"])
    print(markdown(["sends", "one by one (ms/send, median)", "batched (ms/send, median)", "ratio"], rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
