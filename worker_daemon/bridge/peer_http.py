"""HTTP with the job's peers (parameter server, data nodes): the errors and results of one request."""

from __future__ import annotations

import contextlib
import urllib.parse
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import aiohttp


class HttpStatusError(Exception):
    """A peer answered with an unexpected HTTP status (``detail`` is the start of its body)."""

    def __init__(self, url: str, status: int, detail: str) -> None:
        super().__init__(f"{url} answered {status}: {detail}" if detail else f"{url} answered {status}")
        self.status = status
        self.detail = detail


class IntegrityError(Exception):
    """A download whose size or SHA-256 is not what the control plane announced."""


@dataclass(frozen=True, slots=True)
class Download:
    status: int
    size: int
    headers: Mapping[str, str]


@dataclass(frozen=True, slots=True)
class CachedSlice:
    """A claimed slice downloaded (and verified) into the task's prefetch cache, not acknowledged yet."""

    dataset: str
    index: int
    size: int
    path: Path


def without_query(url: str) -> str:
    """``url`` for a span: without its query and fragment, which may hold signatures."""
    return urllib.parse.urlsplit(url)._replace(query="", fragment="").geturl()


async def error_detail(response: aiohttp.ClientResponse) -> str:
    """The reason in an error answer: ``error: detail`` of a JSON body, else the start of the text."""
    try:
        text = (await response.text(errors="replace"))[:2000]
    except (aiohttp.ClientError, TimeoutError):
        return ""
    with contextlib.suppress(ValueError):
        import json

        body = json.loads(text)
        if isinstance(body, dict) and ("error" in body or "detail" in body):
            return f"{body.get('error', '')}: {body.get('detail', '')}".strip(": ")
    return text.strip()[:500]
