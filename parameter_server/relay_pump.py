"""The parameter server's side of the relay (docs/transfers.md): what it does when trainers cannot reach it.

A parameter server behind NAT cannot be called; everyone reaches the control plane's relay outbound instead.
:class:`RelayPump` runs beside the HTTP API and moves bytes between the relay and the server:

* **updates** — it long-polls the relay for ``updates/<round>/<peer>`` objects, downloads each (streamed,
  size and SHA-256 checked) and PUTs it to this server's own HTTP API on loopback with a transfer token it
  signs for the writing peer (it holds the job's transfer key), so an update through the relay is validated,
  bounded and counted by exactly the code a direct one is. The API's answer (status and JSON body) becomes
  the object's reply, which the trainer waits for; then the object is deleted.
* **results** — after each round it uploads ``results/<r>`` (u_r's file, in its published form) with
  metadata ``round``, ``digest`` (θ_r's) and ``included`` (the peers in the mean), and deletes
  ``results/<r − KEEP_RESULTS>``. A trainer that read it counts as having fetched it (the final wait).
* **model files on demand** — a trainer that joins asks for ``model/latest/<file>``; the pump answers with
  ``model/<rounds completed>/<file>`` and deletes the ones it published before.

Every call has a timeout; a failing relay is retried with a capped backoff and never stops the rounds: direct
trainers go on, and relay trainers wait (their bridges say so).
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp

from parameter_server.rounds import KEEP_RESULTS, RoundCoordinator, RoundResult
from worker_daemon.protocol import sign_transfer_token
from worker_daemon.relay import RelayClient, RelayError

logger = logging.getLogger("parameter_server.relay")

#: Seconds of one long-poll of the relay (the control plane caps ``wait`` at 30).
POLL_WAIT = 25.0
#: The longest pause between two tries of a failing relay call.
RETRY_CAP = 10.0
#: Lifetime of the tokens the pump signs for its own loopback calls.
LOOPBACK_TOKEN_LIFETIME = 300


def loopback_host(host: str) -> str:
    """The address to reach a server bound to ``host`` from the same machine."""
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return host or "127.0.0.1"
    if address.is_unspecified:
        return "::1" if address.version == 6 else "127.0.0.1"
    return host


def parse_update_key(key: str) -> tuple[int, str] | None:
    """(round, peer) of ``updates/<round>/<peer>``; None for any other key."""
    parts = key.split("/")
    if len(parts) != 3 or parts[0] != "updates" or not parts[1].isdigit():
        return None
    return int(parts[1]), parts[2]


class RelayPump:
    """Moves one job's updates, results and model files between the relay and this parameter server.

    ``local_base`` is this server's own API (``http://127.0.0.1:<port>``); ``model_file(name)`` gives the
    path and round of a current global-model file (None for a name the model does not have)."""

    def __init__(
        self,
        *,
        client: RelayClient,
        session: aiohttp.ClientSession,
        job_id: str,
        transfer_key: str,
        local_base: str,
        coordinator: RoundCoordinator,
        incoming_dir: Path,
        model_file: Callable[[str], tuple[Path, int, str | None] | None],
    ) -> None:
        self.client = client
        self.session = session
        self.job_id = job_id
        self.transfer_key = transfer_key
        self.local_base = local_base.rstrip("/")
        self.coordinator = coordinator
        self.incoming_dir = incoming_dir
        self.model_file = model_file
        self._tasks: set[asyncio.Task[Any]] = set()
        self._results: dict[int, asyncio.Task[Any]] = {}
        #: Model-file keys this pump published, oldest first (older ones go when a newer one is published).
        self._published_models: dict[str, list[str]] = {}
        #: Bytes through the relay by round (an update's download, a result's upload), and the rest (model
        #: files asked for): a round's report takes its own rounds' bytes, not a next round's update that
        #: arrived before the report went out (a CI run counted three updates in a two-trainer round).
        self._in_by_round: dict[int, int] = {}
        self._out_by_round: dict[int, int] = {}
        self._out_other = 0

    def start(self) -> None:
        """Start consuming updates and answering wants (in the background; :meth:`aclose` stops them)."""
        self._spawn(self._updates(), "relay updates")
        self._spawn(self._wants(), "relay wants")

    def publish_result(self, result: RoundResult) -> None:
        """Upload round ``result``'s file to the relay in the background (off the round's critical path)."""
        self._results[result.round_number] = self._spawn(
            self._publish_result(result), f"relay result {result.round_number}"
        )

    async def settle(self, round_number: int, *, timeout: float = 120.0) -> None:
        """Wait (at most ``timeout`` s) until round ``round_number``'s result is in the relay, so that the
        round's report counts its bytes."""
        task = self._results.pop(round_number, None)
        if task is not None:
            with contextlib.suppress(TimeoutError, asyncio.CancelledError):
                await asyncio.wait_for(asyncio.shield(task), timeout)

    def count_in(self, round_number: int, size: int) -> None:
        """``size`` bytes of a round ``round_number`` update came in through the relay."""
        self._in_by_round[round_number] = self._in_by_round.get(round_number, 0) + size

    def count_out(self, round_number: int | None, size: int) -> None:
        """``size`` bytes went out through the relay: round ``round_number``'s result, or (None) a model file."""
        if round_number is None:
            self._out_other += size
        else:
            self._out_by_round[round_number] = self._out_by_round.get(round_number, 0) + size

    def take_bytes(self, round_number: int) -> tuple[int, int]:
        """(bytes in, bytes out) through the relay for rounds up to ``round_number`` not taken yet, the model
        files sent since the last call counted out; a later round's bytes stay for its own report."""
        bytes_in = sum(self._in_by_round.pop(n) for n in [n for n in self._in_by_round if n <= round_number])
        bytes_out = sum(
            self._out_by_round.pop(n) for n in [n for n in self._out_by_round if n <= round_number]
        )
        bytes_out += self._out_other
        self._out_other = 0
        return bytes_in, bytes_out

    async def aclose(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    # --- internals -------------------------------------------------------------------------------------------

    def _spawn(self, coroutine: Any, name: str) -> asyncio.Task[Any]:
        task = asyncio.create_task(coroutine, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def _patiently(self, what: str, operation: Callable[[], Any]) -> Any:
        """``operation()`` retried with a capped backoff on relay and connection failures (a 4xx other than
        408/429 is not retried: it is raised)."""
        pause = 0.5
        while True:
            try:
                return await operation()
            except RelayError as error:
                if 400 <= error.status < 500 and error.status not in (408, 429):
                    raise
                failure: Exception = error
            except (aiohttp.ClientError, TimeoutError, OSError) as error:
                failure = error
            logger.warning("relay: %s failed (%s); trying again in %.1f s", what, failure, pause)
            await asyncio.sleep(pause)
            pause = min(pause * 2, RETRY_CAP)

    async def _updates(self) -> None:
        feeding: set[str] = set()

        async def feed(entry: dict[str, Any]) -> None:
            try:
                await self._feed(entry)
            finally:
                feeding.discard(entry["key"])

        while True:
            objects = await self._patiently(
                "polling for updates", lambda: self.client.list("updates/", wait=POLL_WAIT)
            )
            # Every trainer's update at once: each download overlaps the others (and the loopback PUTs).
            new = [entry for entry in objects if entry.get("key") not in feeding]
            for entry in new:
                feeding.add(entry["key"])
                self._spawn(feed(entry), f"relay {entry['key']}")
            if not new:
                # The list answers at once while updates being fed are still there: do not spin on them.
                await asyncio.sleep(0.5)

    async def _feed(self, entry: dict[str, Any]) -> None:
        """Hand one update object to this server's API, reply with its answer, delete the object."""
        key = entry["key"]
        parsed = parse_update_key(key)
        if parsed is None:
            return
        round_number, peer = parsed
        if entry.get("reply") is None:
            status, body = await self._submit(entry, round_number, peer)
            try:
                await self._patiently(f"replying to {key}", lambda: self.client.reply(key, status, body))
            except RelayError as error:
                logger.warning("relay: cannot reply to %s: %s", key, error)
        with contextlib.suppress(RelayError):
            await self._patiently(f"deleting {key}", lambda: self.client.delete(key))

    async def _submit(
        self, entry: dict[str, Any], round_number: int, peer: str
    ) -> tuple[int, dict[str, Any]]:
        self.incoming_dir.mkdir(parents=True, exist_ok=True)
        body_path = self.incoming_dir / f"relay-{uuid.uuid4().hex}"
        try:
            try:
                await self._patiently(
                    f"downloading {entry['key']}", lambda: self.client.download(entry, body_path)
                )
            except RelayError as error:
                return 422, {"error": "relay_download_failed", "detail": str(error)}
            size = body_path.stat().st_size
            self.count_in(round_number, size)
            token = sign_transfer_token(
                self.transfer_key,
                {
                    "job": self.job_id,
                    "peer": peer,
                    "role": "trainer",
                    "exp": int(time.time()) + LOOPBACK_TOKEN_LIFETIME,
                },
            )
            headers = {"Authorization": f"Bearer {token}", "Content-Type": "application/octet-stream"}
            samples = (entry.get("metadata") or {}).get("samples")
            if isinstance(samples, int) and not isinstance(samples, bool):
                headers["X-Samples"] = str(samples)
            url = f"{self.local_base}/jobs/{self.job_id}/rounds/{round_number}/update"
            with body_path.open("rb") as body:
                async with self.session.put(
                    url, data=body, headers=headers, timeout=aiohttp.ClientTimeout(total=None, sock_read=600)
                ) as response:
                    try:
                        answer = await response.json(content_type=None)
                    except ValueError:
                        answer = {"detail": (await response.text())[:500]}
                    status = response.status
            logger.info(
                "relay: round %d update from %s (%d bytes): HTTP %d", round_number, peer, size, status
            )
            return status, answer if isinstance(answer, dict) else {"detail": str(answer)[:500]}
        finally:
            body_path.unlink(missing_ok=True)

    async def _publish_result(self, result: RoundResult) -> None:
        if result.path is None:
            return
        key = f"results/{result.round_number}"
        metadata = {
            "round": result.round_number,
            "digest": result.digest or "",
            "included": list(result.participants),
        }
        path = result.path
        size = path.stat().st_size
        try:
            await self._patiently(
                f"uploading {key}", lambda: self.client.upload(key, path, metadata=metadata)
            )
        except (RelayError, FileNotFoundError) as error:
            logger.error("relay: cannot publish %s: %s", key, error)
            return
        self.count_out(result.round_number, size)
        logger.info("relay: published %s (%d bytes)", key, size)
        # Model files published before this round hold older weights: a trainer asking now must get the
        # new ones (it asks again, and the answer is this round's).
        for keys in self._published_models.values():
            for old_model in keys:
                with contextlib.suppress(RelayError, aiohttp.ClientError, TimeoutError):
                    await self.client.delete(old_model)
            keys.clear()
        old = result.round_number - KEEP_RESULTS - 1
        if old >= 1:
            with contextlib.suppress(RelayError, aiohttp.ClientError, TimeoutError):
                await self.client.delete(f"results/{old}")

    async def count_readers(self, round_number: int) -> None:
        """Until cancelled: every trainer the relay handed ``results/<round_number>`` counts as having fetched
        it (the server's final wait for the last round's result)."""
        key = f"results/{round_number}"
        while True:
            with contextlib.suppress(RelayError, aiohttp.ClientError, TimeoutError):
                entry = await self.client.get(key)
                for peer in (entry or {}).get("readers") or []:
                    await self.coordinator.mark_fetched(str(peer), round_number)
            await asyncio.sleep(2.0)

    async def _wants(self) -> None:
        while True:
            keys = await self._patiently("polling for wants", lambda: self.client.wants(wait=POLL_WAIT))
            for key in keys:
                filename = key.removeprefix("model/latest/")
                if filename == key:
                    continue
                await self._publish_model_file(filename)

    async def _publish_model_file(self, filename: str) -> None:
        found = self.model_file(filename)
        if found is None:
            logger.warning(
                "relay: a trainer asked for model file %r, which this model does not have", filename
            )
            return
        path, round_number, digest = found
        key = f"model/{round_number}/{filename}"
        metadata = {"round": round_number, "digest": digest or ""}
        try:
            await self._patiently(
                f"uploading {key}", lambda: self.client.upload(key, path, metadata=metadata)
            )
        except RelayError as error:
            logger.error("relay: cannot publish %s: %s", key, error)
            return
        self.count_out(None, path.stat().st_size)
        published = self._published_models.setdefault(filename, [])
        if key not in published:
            published.append(key)
        for old in published[:-1]:
            with contextlib.suppress(RelayError, aiohttp.ClientError, TimeoutError):
                await self.client.delete(old)
        del published[:-1]
