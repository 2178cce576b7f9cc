"""The control plane's REST API over httpx, with every failure turned into a :mod:`hypha_cli.exceptions` error.

Every call has a timeout (``Settings.timeout`` for connecting and for each read and write). What is a wrong
server and what is a missing job: a Hypha control plane answers every ``/api/`` request with JSON, errors as
``{"detail": ...}`` (400s as field → messages). So a 404 *with* such a body for a job is a missing job, while a
404 page, HTML, or a non-JSON success means the URL is not a Hypha control plane's.
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

from hypha_cli.config import Settings
from hypha_cli.exceptions import (
    AuthenticationError,
    JobNotFoundError,
    RefusedError,
    ServerError,
    UsageError,
    WrongServerError,
)

#: Jobs or workers asked for per page (the API's own maximum page is 100).
PAGE_SIZE = 100
DOWNLOAD_CHUNK = 1 << 16
USER_AGENT = "hypha-cli/0.1.0"


class HyphaClient:
    """An authenticated client of one control plane. Use it as a context manager.

    ``transport`` replaces the network (tests pass an ``httpx.MockTransport``).
    """

    def __init__(self, settings: Settings, *, transport: httpx.BaseTransport | None = None) -> None:
        self.server = settings.server
        self.timeout = settings.timeout
        headers = {"User-Agent": USER_AGENT, "Accept": "application/json"}
        if settings.token:
            headers["Authorization"] = f"Token {settings.token}"
        self._http = httpx.Client(
            base_url=settings.server,
            headers=headers,
            timeout=httpx.Timeout(settings.timeout),
            transport=transport,
            follow_redirects=True,  # httpx drops the Authorization header on a redirect to another host
        )

    def __enter__(self) -> HyphaClient:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        self._http.close()

    # --- the API ------------------------------------------------------------------------------------------

    def verify(self) -> int:
        """Check that the server is a Hypha control plane that accepts the token; the number of jobs the
        token's user sees."""
        page = self._json(self._send("GET", "/api/jobs/", params={"limit": 1}))
        if not isinstance(page, dict) or not isinstance(page.get("results"), list) or "count" not in page:
            raise WrongServerError(
                f"{self.server}/api/jobs/ did not answer like a Hypha control plane (no paginated job list)"
            )
        return int(page["count"])

    def jobs(self, *, limit: int, status: str | None = None, name: str | None = None) -> list[dict[str, Any]]:
        """The newest ``limit`` jobs the token's user sees, as the API lists them; with ``status``, only those in
        it; with ``name``, only those whose name contains it (any case)."""
        query = {key: value for key, value in (("status", status), ("name", name)) if value}
        return self._list("/api/jobs/", limit=limit, query=query or None)

    def workers(self, *, limit: int, mine: bool = False) -> list[dict[str, Any]]:
        """Up to ``limit`` workers of the pool, as the API lists them: the public facts of each, in full those the
        token's user owns (staff: every worker); with ``mine``, only the user's own."""
        return self._list("/api/workers/", limit=limit, query={"mine": "true"} if mine else None)

    def job(self, job_id: str) -> dict[str, Any]:
        """A job with its rounds, tasks, data progress and model files."""
        return self._object(self._send("GET", f"/api/jobs/{job_id}/", job_id=job_id))

    def submit(
        self, *, content: bytes, content_type: str, name: str | None, endpoint: str = "/api/jobs/diloco/"
    ) -> dict[str, Any]:
        """Submit a spec (``application/json`` or ``application/toml``) to ``endpoint`` (DiLoCo's, or
        ``/api/jobs/inference/``); the created job."""
        params = {"name": name} if name is not None and content_type == "application/toml" else None
        response = self._send(
            "POST",
            endpoint,
            content=content,
            headers={"Content-Type": content_type},
            params=params,
        )
        return self._object(response)

    def cancel(self, job_id: str) -> dict[str, Any]:
        """Cancel a job; the job afterwards."""
        return self._object(self._send("POST", f"/api/jobs/{job_id}/cancel/", job_id=job_id))

    def discard_round(self, job_id: str, number: int) -> dict[str, Any]:
        """Discard round ``number``, the running job's latest closed round; the job afterwards. A 409 (not
        discardable) is a :class:`RefusedError` with the server's reason."""
        try:
            response = self._send("POST", f"/api/jobs/{job_id}/rounds/{number}/discard/", job_id=job_id)
        except JobNotFoundError:
            # The server's 404 is for a missing job and a missing closed round alike.
            raise JobNotFoundError(
                f"no job {job_id} with a closed round {number} on {self.server} (or it is not one of yours)"
            ) from None
        return self._object(response)

    def task_log(self, job_id: str, task_id: str) -> str:
        """A task's full log as the control plane keeps it (its newest part, past the server's cap)."""
        return self._send("GET", f"/api/jobs/{job_id}/tasks/{task_id}/log", job_id=job_id).text

    def download_model(self, job_id: str, directory: Path) -> Path:
        """Save the job's model zip in ``directory`` (created if needed); its path. The file appears only
        once complete (written under a temporary name, then renamed); a failed download leaves nothing."""
        return self._download(f"/api/jobs/{job_id}/model", job_id, directory, f"model-{job_id}.zip")

    def download_results(
        self, job_id: str, directory: Path, *, name: str | None = None, index: int | None = None
    ) -> Path:
        """Save an inference job's results in ``directory``: every result so far as one zip (with its
        ``manifest.json``), or slice ``index``'s result file alone; saved as ``name``, else as the server
        names it. Written as :meth:`download_model` writes. A job or slice without results is a
        :class:`JobNotFoundError`; a training job's (409) a :class:`RefusedError`."""
        if index is None:
            path, fallback = f"/api/jobs/{job_id}/results/", f"results-{job_id}.zip"
        else:
            path, fallback = f"/api/jobs/{job_id}/results/{index}/", f"{index}.result"
        try:
            return self._download(path, job_id, directory, fallback, name=name)
        except JobNotFoundError:
            if index is None:
                raise
            raise JobNotFoundError(
                f"job {job_id} has no result for slice {index} on {self.server} (not yet, no such slice, or "
                "not one of your jobs)"
            ) from None

    def _download(
        self, url: str, job_id: str, directory: Path, fallback: str, *, name: str | None = None
    ) -> Path:
        partial: Path | None = None
        try:
            with self._http.stream("GET", url) as response:
                if not response.is_success:
                    response.read()
                    self._check(response, job_id=job_id)
                name = name or _attachment_name(response.headers.get("Content-Disposition", ""))
                destination = directory / (name or fallback)
                partial = directory / f".{destination.name}.part"
                try:
                    directory.mkdir(parents=True, exist_ok=True)
                    with partial.open("wb") as handle:
                        for chunk in response.iter_bytes(DOWNLOAD_CHUNK):
                            handle.write(chunk)
                except OSError as error:
                    raise UsageError(f"cannot write to {directory}: {error.strerror or error}") from None
            os.replace(partial, destination)
        except httpx.HTTPError as error:
            _discard(partial)
            raise self._network_error(error) from None
        except BaseException:
            _discard(partial)
            raise
        return destination

    # --- plumbing -----------------------------------------------------------------------------------------

    def _list(self, path: str, *, limit: int, query: dict[str, str] | None = None) -> list[dict[str, Any]]:
        items: list[dict[str, Any]] = []
        while len(items) < limit:
            page_query = {"limit": min(PAGE_SIZE, limit - len(items)), "offset": len(items), **(query or {})}
            page = self._json(self._send("GET", path, params=page_query))
            if not isinstance(page, dict) or not isinstance(page.get("results"), list):
                raise WrongServerError(f"{self.server}{path} did not answer like a Hypha control plane")
            items.extend(page["results"])
            if not page.get("next") or not page["results"]:
                break
        return items[:limit]

    def _send(self, method: str, path: str, *, job_id: str | None = None, **kwargs: Any) -> httpx.Response:
        try:
            response = self._http.request(method, path, **kwargs)
        except httpx.HTTPError as error:
            raise self._network_error(error) from None
        self._check(response, job_id=job_id)
        return response

    def _network_error(self, error: httpx.HTTPError) -> Exception:
        if isinstance(error, httpx.TimeoutException):
            return WrongServerError(
                f"{self.server} did not answer within {self.timeout:g}s ({type(error).__name__})"
            )
        if isinstance(error, httpx.ConnectError):
            return WrongServerError(f"cannot connect to {self.server}: {_reason(error)} (is --server right?)")
        if isinstance(error, httpx.UnsupportedProtocol | httpx.InvalidURL):
            return UsageError(f"bad server URL {self.server}: {error}")
        if isinstance(error, httpx.DecodingError):
            return ServerError(f"{self.server} sent a body that cannot be decoded: {error}")
        return WrongServerError(f"talking to {self.server} failed: {_reason(error)}")

    def _check(self, response: httpx.Response, *, job_id: str | None) -> None:
        """Raise the error an unsuccessful ``response`` stands for."""
        status = response.status_code
        if response.is_success:
            return
        body = _json_body(response)
        detail = body.get("detail") if isinstance(body, dict) else None
        where = f"{response.request.method} {response.request.url}"
        if status >= 500:
            raise ServerError(
                f"{self.server} failed: HTTP {status} for {where}" + (f": {detail}" if detail else "")
            )
        if body is None:
            raise WrongServerError(
                f"{where} answered HTTP {status} without a JSON body: {self.server} is not a Hypha control plane "
                "(check --server)"
            )
        if status in (401, 403):
            reason = detail or "authentication failed"
            raise AuthenticationError(
                f"{self.server} refused the API token ({reason}); run `hypha login --server {self.server}`"
            )
        if status == 404:
            if job_id is not None and detail:
                raise JobNotFoundError(f"no job {job_id} on {self.server} (or it is not one of yours)")
            raise WrongServerError(
                f"{where} answered 404 ({detail}): is {self.server} a Hypha control plane?"
            )
        if status in (400, 409, 413, 415, 422):
            errors = flatten_errors(body)
            message = detail if isinstance(detail, str) else "; ".join(_format(item) for item in errors)
            raise RefusedError(message or f"HTTP {status}", status=status, errors=errors, body=body)
        raise ServerError(f"{where} answered HTTP {status}" + (f": {detail}" if detail else ""))

    def _json(self, response: httpx.Response) -> Any:
        body = _json_body(response)
        if body is None:
            kind = response.headers.get("Content-Type", "no content type")
            raise WrongServerError(
                f"{response.request.url} answered {kind}, not JSON: {self.server} is not a Hypha control plane"
            )
        return body

    def _object(self, response: httpx.Response) -> dict[str, Any]:
        body = self._json(response)
        if not isinstance(body, dict) or "id" not in body:
            raise ServerError(f"{response.request.url} answered an unexpected shape: {str(body)[:200]}")
        return body


def flatten_errors(body: Any, prefix: str = "") -> list[tuple[str, str]]:
    """A 400 body as ``(dotted field path, message)`` pairs, in the body's order.

    ``{"trainer": {"price": {"max": ["..."]}}}`` gives ``("trainer.price.max", "...")``; list items that are
    objects are numbered (``rounds.0.x``); ``non_field_errors`` and ``detail`` give an empty path.
    """
    found: list[tuple[str, str]] = []
    if isinstance(body, dict):
        for key, value in body.items():
            name = "" if key in ("non_field_errors", "detail") else str(key)
            path = f"{prefix}.{name}" if prefix and name else (prefix or name)
            found.extend(flatten_errors(value, path))
    elif isinstance(body, list):
        for index, item in enumerate(body):
            if isinstance(item, dict | list):
                found.extend(flatten_errors(item, f"{prefix}.{index}" if prefix else str(index)))
            else:
                found.append((prefix, str(item)))
    elif body is not None:
        found.append((prefix, str(body)))
    return found


def _format(item: tuple[str, str]) -> str:
    path, message = item
    return f"{path}: {message}" if path else message


def _json_body(response: httpx.Response) -> Any:
    """The decoded body if the response says it is JSON and it parses; else ``None``."""
    if "json" not in response.headers.get("Content-Type", ""):
        return None
    try:
        return response.json()
    except ValueError:
        return None


def _attachment_name(disposition: str) -> str | None:
    """The file name of a ``Content-Disposition: attachment; filename="…"`` header, reduced to a safe base
    name (the server must not choose where we write)."""
    match = re.search(r'filename="?([^";]+)"?', disposition)
    if not match:
        return None
    name = os.path.basename(match.group(1).strip())
    return name if name and not name.startswith(".") else None


def _discard(path: Path | None) -> None:
    if path is not None:
        with contextlib.suppress(OSError):
            path.unlink()


def _reason(error: Exception) -> str:
    """The innermost OS-level reason of a network error ("Connection refused"), else its text."""
    cause: BaseException | None = error
    while cause is not None:
        if isinstance(cause, OSError) and cause.strerror:
            return cause.strerror
        cause = cause.__cause__ or cause.__context__
    return str(error) or type(error).__name__


def iter_field_lines(errors: list[tuple[str, str]]) -> Iterator[str]:
    """One line per field error: ``path: message``."""
    for item in errors:
        yield _format(item)
