"""Batch downloads: several small slices of one dataset in one request, each under its own slice token.

A trainer prefetches: it holds the tokens of a few claimed slices at once (one per ``slice_assigned``), and a
100 KiB slice costs the node far more in per-request work than in bytes. So the node answers::

    POST /datasets/<name>/slices
    Content-Type: application/json

    {"slices": [{"index": 3, "token": "<the token of slice 3's URL>"},
                {"index": 7, "token": "<the token of slice 7's URL>"}]}

with, in request order, each slice framed by one ASCII line::

    200  Content-Type: application/x-hypha-slices, X-Slice-Count: 2, Content-Length: <all of it>

    3 102400 <sha256 of slice 3, 64 lowercase hex>\\n<its 102400 bytes>7 102400 <sha256>\\n<its bytes>

A client splits the body by the sizes in the lines and checks each against the size and digest the control
plane announced (the line's own digest is the node's ``X-Sha256``). No new token: every entry carries the
token of that slice's ``GET`` URL (the ``token`` query parameter the control plane signed for that dataset,
slice, job and peer), verified exactly as the ``GET`` verifies it. A batch is all or nothing, and gets nothing
the ``GET`` of each of its slices would not.

The answers, in the order they are checked (all JSON ``{"error", "detail"}`` but the 200):

* 503 ``not_ready`` (with ``Retry-After``): the node has no download key yet;
* 413 ``too_large``: a body over :data:`MAX_BODY` bytes;
* 400 ``bad_request``: not a JSON object ``{"slices": [...]}`` (no other keys), no entry, more than
  :data:`MAX_SLICES`, an entry that is not exactly ``{"index": <int ≥ 0>, "token": <string>}``, or an index
  twice;
* 401 ``unauthorized`` / 403 ``forbidden``: the first entry whose token a ``GET`` would refuse, with its
  status (so a token for another dataset or slice is a 403: a batch cannot mix datasets); the detail names the
  entry;
* 404 ``not_found``: another dataset than the node's, or an index past its last slice;
* 400 ``too_large``: a slice over the node's inline limit (1 MiB by default): download it with ``GET``, which
  streams it.

Slices behind the relay (data nodes that accept no inbound connections, served by the control plane) have no
batch endpoint: a client falls back to one ``GET`` per slice there, as with a node older than this one (404).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

#: Media type of a batch's answer.
CONTENT_TYPE = "application/x-hypha-slices"
#: Most slices in one batch.
MAX_SLICES = 64
#: Largest request body (64 entries of ~250-byte tokens fit many times over).
MAX_BODY = 64 * 1024


class BatchRequestError(Exception):
    """A batch request the node refuses before looking at its tokens (``status`` 400 or 413)."""

    def __init__(self, status: int, error: str, detail: str) -> None:
        super().__init__(detail)
        self.status = status
        self.error = error
        self.detail = detail


@dataclass(frozen=True, slots=True)
class Entry:
    index: int
    token: str


def parse_request(body: bytes) -> list[Entry]:
    """The entries of a batch request's body, in order; :class:`BatchRequestError` (400) for anything else."""

    def refuse(detail: str) -> BatchRequestError:
        return BatchRequestError(400, "bad_request", detail)

    try:
        document: Any = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        raise refuse('the body must be JSON: {"slices": [{"index": …, "token": …}, …]}') from None
    if not isinstance(document, dict) or set(document) != {"slices"}:
        raise refuse('the body must be an object with one key, "slices"')
    entries = document["slices"]
    if not isinstance(entries, list) or not entries:
        raise refuse('"slices" must be a non-empty list')
    if len(entries) > MAX_SLICES:
        raise refuse(f"at most {MAX_SLICES} slices per batch, not {len(entries)}")
    parsed: list[Entry] = []
    seen: set[int] = set()
    for position, entry in enumerate(entries):
        if not isinstance(entry, dict) or set(entry) != {"index", "token"}:
            raise refuse(f'slices[{position}] must be {{"index": …, "token": …}}, nothing else')
        index, token = entry["index"], entry["token"]
        # bool is an int to Python, and 2**70 would pass ``>= 0``: neither names a slice.
        if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < 1 << 40:
            raise refuse(f"slices[{position}].index must be a slice index (an integer ≥ 0)")
        if not isinstance(token, str):
            raise refuse(f"slices[{position}].token must be a string")
        if index in seen:
            raise refuse(f"slice {index} is asked for twice")
        seen.add(index)
        parsed.append(Entry(index=index, token=token))
    return parsed


def frame_line(index: int, size: int, sha256: str) -> bytes:
    """The line that precedes a slice's bytes in a batch's answer."""
    return f"{index} {size} {sha256}\n".encode()
