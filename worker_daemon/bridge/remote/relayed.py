"""A task's transfers through the control plane's relay (docs/transfers.md): for a parameter server that
accepts no inbound connections, the bridge reaches it through objects in the relay instead of its URL.

The executor sees no difference: a model file, an update's answer (200, or the 409/422 with the server's
reason) and each round's result arrive as they do directly. A mixin of
:class:`~worker_daemon.bridge.remote.RemoteBackend`.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import json
import logging
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import aiohttp

from worker_daemon import protocol
from worker_daemon.bridge.exceptions import ConnectorError, NetworkError
from worker_daemon.bridge.peer_http import HttpStatusError
from worker_daemon.relay import RelayClient, RelayError

logger = logging.getLogger(__name__)
T = TypeVar("T")

#: Seconds of one long-poll of the relay (the control plane caps ``wait`` at 30).
RELAY_WAIT = 25.0


class SwitchedToRelay(Exception):
    """Raised by a direct transfer's retry loop when the control plane says its peer is now reached through
    the relay: the caller goes on there."""


def token_peer(token: str | None) -> str | None:
    """The ``peer`` claim of a transfer token (not verified: only to name this task's own objects; the
    control plane checks the signature and refuses a key that is not the token's peer)."""
    if not token:
        return None
    body = token.partition(".")[0]
    try:
        claims = json.loads(base64.urlsafe_b64decode(body + "=" * (-len(body) % 4)))
    except (ValueError, binascii.Error):
        return None
    peer = claims.get("peer") if isinstance(claims, dict) else None
    return peer if isinstance(peer, str) else None


class RelayTransfers:
    """Relay transfers of a task's bridge (the attributes are :class:`RemoteBackend`'s)."""

    task_id: uuid.UUID
    job_id: str
    link: Any
    server_url: str | None
    transfer_token: str | None
    relay_peers: set[str]
    peer_wait: float
    retries: int
    retry_base: float
    retry_cap: float
    _relay: RelayClient | None
    _http: Callable[[], aiohttp.ClientSession]  # Downloads

    def _relayed(self, peer: str) -> bool:
        return peer in self.relay_peers

    def _relay_client(self) -> RelayClient:
        if self._relay is None:
            if not self.server_url:
                raise ConnectorError("the relay is needed but this daemon knows no control-plane URL")
            self._relay = RelayClient(
                self.server_url, self.job_id, lambda: self.transfer_token or "", self._http()
            )
        return self._relay

    async def _at_relay(self, what: str, operation: Callable[[RelayClient], Awaitable[T]]) -> T:
        """``operation(client)``; connection errors, timeouts, 5xx, 408 and 429 retried for up to ``peer_wait``
        seconds (said on the job's page after ``retries`` failures); another 4xx raised as
        :class:`HttpStatusError`."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.peer_wait
        pause = self.retry_base
        attempt = 0
        while True:
            try:
                return await operation(self._relay_client())
            except RelayError as error:
                if error.status < 500 and error.status not in (408, 429):
                    raise HttpStatusError(f"relay {what}", error.status, error.detail) from error
                failure: Exception = error
            except (aiohttp.ClientError, TimeoutError) as error:
                failure = error
            attempt += 1
            detail = str(failure) or type(failure).__name__
            left = deadline - loop.time()
            if left <= 0:
                raise ConnectorError(f"{what} through the relay: {detail}") from failure
            pause = min(pause, left)
            line = f"waiting for the relay: {what} failed ({detail}); trying again in {pause:.1f} s"
            logger.warning("task %s: %s", self.task_id, line)
            if attempt > self.retries:
                self.link.post(protocol.TaskLog(task_id=self.task_id, lines=[line[:1000]]))
            await asyncio.sleep(pause)
            pause = min(pause * 2, self.retry_cap)

    async def _relay_model_file(self, filename: str, target: Path) -> tuple[int, int | None]:
        """Ask the parameter server for ``filename`` through the relay and download it to ``target``:
        (size, the round of the weights it holds)."""
        key = f"model/latest/{filename}"
        what = f"model file {filename}"
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.peer_wait
        while True:
            await self._at_relay(what, lambda client: client.want(key))
            # The parameter server deletes its published model files when a round closes, so what is there
            # is the current round's (or, racing a closing round, the one before: the trainer then merges that
            # round's result, which the relay keeps).
            entry = await self._at_relay(what, lambda client: client.get(key, wait=RELAY_WAIT))
            if entry is not None:
                try:
                    size = await self._at_relay(
                        what, lambda client, entry=entry: client.download(entry, target)
                    )
                except HttpStatusError as error:
                    if error.status not in (403, 404, 410):
                        raise
                    # Deleted while this trainer downloaded it (a round closed): ask for the new one.
                    logger.info(
                        "task %s: %s went while downloading (%s); asking again", self.task_id, what, error
                    )
                else:
                    number = (entry.get("metadata") or {}).get("round")
                    return size, number if isinstance(number, int) and not isinstance(number, bool) else None
            if loop.time() > deadline:
                raise NetworkError(
                    f"the parameter server did not publish {what} to the relay within {self.peer_wait:g} s"
                )

    async def _relay_update(self, *, round_number: int, path: Path, samples: int) -> None:
        """Upload the update and wait for the parameter server's answer to it; a refusal is raised as the
        :class:`HttpStatusError` a direct PUT would have given."""
        me = token_peer(self.transfer_token)
        if me is None:
            raise ConnectorError("this task's transfer token names no peer; cannot send through the relay")
        key = f"updates/{round_number}/{me}"
        what = f"round {round_number} update"
        await self._at_relay(what, lambda client: client.upload(key, path, metadata={"samples": samples}))
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.peer_wait
        while True:
            reply = await self._at_relay(what, lambda client: client.wait_reply(key, wait=RELAY_WAIT))
            if reply is not None:
                break
            if loop.time() > deadline:
                raise NetworkError(
                    f"the parameter server did not answer the {what} within {self.peer_wait:g} s"
                )
        status = reply.get("status")
        if not isinstance(status, int) or status >= 300:
            body = reply.get("body") or {}
            detail = (
                f"{body.get('error', '')}: {body.get('detail', '')}".strip(": ")
                if isinstance(body, dict)
                else ""
            )
            raise HttpStatusError(f"relay {key}", status if isinstance(status, int) else 502, detail)

    async def _relay_result(self, round_number: int, target: Path) -> tuple[str, int, bool] | None:
        """Round ``round_number``'s result through the relay, downloaded to ``target``: ("ok", size,
        included); ("pruned", 0, False) when later rounds are there and it is not (the parameter server
        deleted it); None when it is not there yet."""
        key = f"results/{round_number}"
        entry = await self._at_relay(
            f"round {round_number} result", lambda client: client.get(key, wait=RELAY_WAIT)
        )
        if entry is None:
            later = await self._at_relay(
                f"round {round_number} result", lambda client: client.list("results/", wait=0)
            )
            rounds = [number for item in later if (number := _round_of(item.get("key", ""))) is not None]
            if rounds and min(rounds) > round_number:
                return "pruned", 0, False
            return None
        size = await self._at_relay(
            f"round {round_number} result", lambda client: client.download(entry, target)
        )
        me = token_peer(self.transfer_token)
        included = (entry.get("metadata") or {}).get("included") or []
        return "ok", size, me in included


def _round_of(key: str) -> int | None:
    tail = key.rpartition("/")[2]
    return int(tail) if tail.isdigit() else None
