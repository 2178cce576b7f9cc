"""The relay client: objects of a job exchanged through the control plane's relay (docs/transfers.md), used
by the trainer bridge and by the parameter server when one cannot reach the other directly.

The control plane indexes the objects and mints short-lived URLs; the bytes go to and from those URLs (the
control plane's own ``/relay/`` store or S3), streamed in chunks of at most :data:`CHUNK` both ways, so
memory does not grow with an object's size. Every call sends the task's current transfer token
(``token()`` is asked each time: tokens are renewed with the lease).

Errors: :class:`RelayError` for a 4xx/5xx answer (of the control plane, or of the store once retries are
spent); :class:`RelayIntegrityError` (a :class:`RelayError`) when a download's size or SHA-256 is not the
object's. Connection errors and timeouts propagate as aiohttp's own (``aiohttp.ClientError``,
``TimeoutError``) once the retries of a part or of a download are spent.

No Django here: the daemon imports nothing of the control plane.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import os
import urllib.parse
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any, BinaryIO

import aiohttp

#: Bytes per read and write of a body.
CHUNK = 1 << 20
#: Bytes per second the control plane is assumed to hash at least when it completes a local upload (the
#: complete call's read timeout grows with the object's size).
COMPLETE_HASH_RATE = 50 << 20


class RelayError(Exception):
    """The relay answered ``status`` (``detail``: its reason; ``body``: its JSON body, if any)."""

    def __init__(self, status: int, detail: str, *, body: Any = None) -> None:
        super().__init__(f"relay answered {status}: {detail}" if detail else f"relay answered {status}")
        self.status = status
        self.detail = detail
        self.body = body


class RelayIntegrityError(RelayError):
    """A download whose size or SHA-256 is not what the object declares (the partial file is deleted)."""

    def __init__(self, detail: str) -> None:
        super().__init__(0, detail)


class RelayClient:
    """One job's relay, as one of its tasks sees it (see the module)."""

    def __init__(
        self,
        server_url: str,
        job_id: str,
        token: Callable[[], str],
        session: aiohttp.ClientSession,
        *,
        connect_timeout: float = 10.0,
        read_timeout: float = 60.0,
        part_attempts: int = 3,
        upload_rounds: int = 4,
        download_attempts: int = 5,
        retry_delay: float = 0.5,
    ) -> None:
        self.server_url = server_url.rstrip("/")
        self.job_id = str(job_id)
        self._token = token
        self._session = session
        self.connect_timeout = connect_timeout
        self.read_timeout = read_timeout
        self.part_attempts = max(1, part_attempts)
        self.upload_rounds = max(1, upload_rounds)
        self.download_attempts = max(1, download_attempts)
        self.retry_delay = retry_delay
        self._api = f"{self.server_url}/api/relay/jobs/{self.job_id}/"

    # --- uploads --------------------------------------------------------------------------------------

    async def upload(self, key: str, path: str | os.PathLike, *, metadata: dict | None = None) -> dict:
        """Upload the file at ``path`` as ``key``; the complete object.

        The file's SHA-256 is computed first (streamed). Then the control plane is asked for the upload's
        plan, every part not done yet is PUT (each retried ``part_attempts`` times), and the upload is
        completed. After a failure (a part that kept failing, an expired URL, parts found missing) the plan
        is asked for again — the control plane says which parts it has — and only the others are sent, up
        to ``upload_rounds`` times. Calling ``upload`` again later resumes the same way."""
        path = Path(path)
        size, sha256 = await asyncio.to_thread(_file_digest, path)
        body = {"key": key, "size": size, "sha256": sha256, "metadata": metadata or {}}
        failure: BaseException | None = None
        for round_number in range(self.upload_rounds):
            if round_number:
                await asyncio.sleep(self.retry_delay * 2 ** (round_number - 1))
            plan = await self._call("POST", "uploads/", json_body=body)
            try:
                for part in plan["parts"]:
                    if not part["done"]:
                        await self._put_part(path, part)
                return await self._call(
                    "POST", "uploads/complete/", json_body={"key": key}, extra_read=size / COMPLETE_HASH_RATE
                )
            except _PartFailed as failed:
                failure = failed.cause
            except RelayError as error:
                # Complete found parts missing (400) or the store lost the upload (409): resume or restart.
                if error.status not in (400, 409) and error.status < 500:
                    raise
                failure = error
        assert failure is not None
        raise failure

    async def _put_part(self, path: Path, part: dict) -> None:
        url = self._absolute(part["url"])
        failure: BaseException | None = None
        for attempt in range(self.part_attempts):
            if attempt:
                await asyncio.sleep(self.retry_delay * 2 ** (attempt - 1))
            try:
                async with self._session.put(
                    url,
                    data=file_part(path, part["offset"], part["size"]),
                    headers={"Content-Length": str(part["size"]), "Content-Type": "application/octet-stream"},
                    timeout=self._timeout(),
                ) as response:
                    if response.status < 300:
                        await response.read()
                        return
                    failure = RelayError(response.status, await _detail(response))
                    if response.status < 500 and response.status not in (408, 429):
                        break  # this URL will not work again (expired, refused): ask for a new plan
            except (aiohttp.ClientError, TimeoutError) as error:
                failure = error
        raise _PartFailed(failure)

    # --- reading --------------------------------------------------------------------------------------

    async def get(self, key: str, *, wait: float = 0.0) -> dict | None:
        """The complete object ``key`` with a GET URL, or None if it is not there after ``wait`` seconds
        (``model/latest/<file>``: the newest ``model/<round>/<file>``)."""
        return await self._call("GET", "objects/", params={"key": key, "wait": wait}, extra_read=wait)

    async def list(self, prefix: str, *, wait: float = 0.0) -> list[dict]:
        """The complete objects under ``prefix``, oldest first (at most 100), waiting up to ``wait`` seconds
        while there are none."""
        answer = await self._call("GET", "objects/", params={"prefix": prefix, "wait": wait}, extra_read=wait)
        return answer["objects"]

    async def download(self, obj: dict, target: str | os.PathLike) -> int:
        """Download ``obj`` (an answer of :meth:`get` or :meth:`list`) to ``target``; its size.

        Streamed to ``.<target name>.<sha256 prefix>.relay-partial`` beside the target, which a cut download
        (or a later call for the same content) resumes with a ``Range`` header from the bytes already there; an expired URL is replaced once
        by asking for the object again. The size and SHA-256 are checked at the end (a mismatch deletes the
        partial file: :class:`RelayIntegrityError`), then the file is renamed to ``target``."""
        target = Path(target)
        size, sha256, url = int(obj["size"]), obj["sha256"], self._absolute(obj["url"])
        partial = target.with_name(f".{target.name}.{sha256[:16]}.relay-partial")
        digest = hashlib.sha256()
        have = partial.stat().st_size if partial.exists() else 0
        if have > size:
            have = 0
        with partial.open("r+b" if partial.exists() else "w+b") as handle:
            handle.truncate(have)
            if have:
                await asyncio.to_thread(_hash_prefix, handle, digest, have)
            refreshed = False
            failures = 0
            while have < size:
                try:
                    headers = {"Range": f"bytes={have}-"} if have else {}
                    async with self._session.get(url, headers=headers, timeout=self._timeout()) as response:
                        if response.status in (401, 403, 404) and not refreshed:
                            refreshed = True  # an expired URL (or a store that moved): ask for a new one
                            url = await self._fresh_url(obj)
                            continue
                        if response.status >= 300:
                            raise RelayError(response.status, await _detail(response))
                        start = _content_start(response)
                        if start != have:
                            if start != 0:
                                raise RelayError(502, f"asked for bytes from {have}, got them from {start}")
                            have, digest = 0, hashlib.sha256()  # the whole object again
                            handle.seek(0)
                            handle.truncate(0)
                        async for chunk in response.content.iter_chunked(CHUNK):
                            if have + len(chunk) > size:
                                handle.close()
                                partial.unlink(missing_ok=True)
                                raise RelayIntegrityError(f"{obj['key']}: more than its {size} bytes arrived")
                            await asyncio.to_thread(_append, handle, digest, chunk)
                            have += len(chunk)
                    if have < size:
                        raise aiohttp.ClientPayloadError(f"the body ended at byte {have} of {size}")
                except RelayIntegrityError:
                    raise
                except (aiohttp.ClientError, TimeoutError, RelayError) as error:
                    if isinstance(error, RelayError) and 400 <= error.status < 500:
                        raise
                    failures += 1
                    if failures >= self.download_attempts:
                        raise
                    # What was written and hashed stays; a chunk cut half-way is not counted in ``have``.
                    handle.seek(have)
                    handle.truncate(have)
                    await asyncio.sleep(self.retry_delay * 2 ** (failures - 1))
        if digest.hexdigest() != sha256:
            partial.unlink(missing_ok=True)
            raise RelayIntegrityError(
                f"{obj['key']}: SHA-256 {digest.hexdigest()}, not the declared {sha256}"
            )
        os.replace(partial, target)
        return size

    async def _fresh_url(self, obj: dict) -> str:
        fresh = await self.get(obj["key"])
        if fresh is None:
            raise RelayError(404, f"{obj['key']} is gone from the relay")
        if (fresh["size"], fresh["sha256"]) != (obj["size"], obj["sha256"]):
            raise RelayError(409, f"{obj['key']} now has other content")
        return self._absolute(fresh["url"])

    # --- replies, wants, deletion ---------------------------------------------------------------------

    async def reply(self, key: str, status: int, body: dict) -> dict:
        """Answer the object ``key`` (set once) with an HTTP-like ``status`` and a JSON ``body``."""
        return await self._call(
            "POST", "objects/reply/", json_body={"key": key, "status": status, "body": body}
        )

    async def wait_reply(self, key: str, *, wait: float = 0.0) -> dict | None:
        """The reply to ``key`` (``{"status", "body"}``), or None if there is none after ``wait`` seconds."""
        return await self._call("GET", "objects/reply/", params={"key": key, "wait": wait}, extra_read=wait)

    async def want(self, key: str) -> None:
        """Ask the parameter server to publish ``key`` (``model/latest/<filename>``)."""
        await self._call("POST", "objects/want/", json_body={"key": key})

    async def wants(self, *, wait: float = 0.0) -> list[str]:
        """The keys readers want published (the parameter server only), waiting up to ``wait`` seconds."""
        answer = await self._call("GET", "wants/", params={"wait": wait}, extra_read=wait)
        return answer["wants"]

    async def delete(self, key: str) -> None:
        """Delete the object ``key`` (its writer, or the parameter server)."""
        await self._call("DELETE", "objects/", params={"key": key})

    # --- plumbing -------------------------------------------------------------------------------------

    def _timeout(self, extra_read: float = 0.0) -> aiohttp.ClientTimeout:
        return aiohttp.ClientTimeout(
            total=None, sock_connect=self.connect_timeout, sock_read=self.read_timeout + extra_read
        )

    def _absolute(self, url: str) -> str:
        return urllib.parse.urljoin(f"{self.server_url}/", url)

    async def _call(
        self,
        method: str,
        path: str,
        *,
        json_body: dict | None = None,
        params: dict | None = None,
        extra_read: float = 0.0,
    ) -> Any:
        """One API call: its JSON answer, None for a 204; :class:`RelayError` for a 4xx/5xx."""
        query = {name: str(value) for name, value in (params or {}).items()}
        async with self._session.request(
            method,
            self._api + path,
            json=json_body,
            params=query or None,
            headers={"Authorization": f"Bearer {self._token()}"},
            timeout=self._timeout(extra_read),
        ) as response:
            if response.status == 204:
                return None
            raw = await response.read()
            try:
                body = json.loads(raw) if raw else None
            except ValueError:
                body = None
            if response.status >= 300:
                detail = body.get("detail") if isinstance(body, dict) else None
                raise RelayError(
                    response.status, str(detail if detail is not None else body or raw[:300]), body=body
                )
            return body


class _PartFailed(Exception):
    def __init__(self, cause: BaseException | None) -> None:
        super().__init__(str(cause))
        self.cause = cause


def _file_digest(path: Path) -> tuple[int, str]:
    digest = hashlib.sha256()
    size = 0
    with path.open("rb") as handle:
        while chunk := handle.read(CHUNK):
            digest.update(chunk)
            size += len(chunk)
    return size, digest.hexdigest()


async def file_part(path: Path, offset: int, size: int) -> AsyncIterator[bytes]:
    """``size`` bytes of the file from ``offset``, a chunk at a time, read in a thread (the body of one part's
    PUT; the data node's publisher sends its slices' parts with it too)."""
    with path.open("rb") as handle:
        handle.seek(offset)
        remaining = size
        while remaining > 0:
            chunk = await asyncio.to_thread(handle.read, min(CHUNK, remaining))
            if not chunk:
                raise OSError(f"{path} ended before byte {offset + size} (changed while being uploaded?)")
            remaining -= len(chunk)
            yield chunk


def _hash_prefix(handle: BinaryIO, digest, length: int) -> None:
    handle.seek(0)
    remaining = length
    while remaining > 0:
        chunk = handle.read(min(CHUNK, remaining))
        if not chunk:
            raise OSError("the partial download is shorter than it was")
        digest.update(chunk)
        remaining -= len(chunk)


def _append(handle: BinaryIO, digest, chunk: bytes) -> None:
    handle.write(chunk)
    digest.update(chunk)


def _content_start(response: aiohttp.ClientResponse) -> int:
    """Where the body starts in the object: ``Content-Range``'s first byte (S3 answers 206; some S3-compatible
    servers 200 with a Content-Range), else 0 (the whole object)."""
    content_range = response.headers.get("Content-Range", "")
    if response.status in (200, 206) and content_range.startswith("bytes "):
        with contextlib.suppress(ValueError):
            return int(content_range[len("bytes ") :].split("-", 1)[0])
    return 0


async def _detail(response: aiohttp.ClientResponse) -> str:
    """The reason in an error answer: ``detail`` of our JSON, ``Message`` of an S3 XML error, or the text."""
    try:
        text = (await response.text(errors="replace"))[:4000]
    except (aiohttp.ClientError, TimeoutError):
        return ""
    with contextlib.suppress(ValueError, AttributeError):
        body = json.loads(text)
        if isinstance(body, dict) and "detail" in body:
            return str(body["detail"])
    if "<Message>" in text:
        return text.split("<Message>", 1)[1].split("</Message>", 1)[0]
    return text.strip()[:500]
