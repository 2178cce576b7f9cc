"""The parameter server's HTTP API (docs/training.md, "The parameter server's HTTP API"), on aiohttp.

::

    GET  /jobs/<job>/model/<filename>            a file of the current global model; X-Round: rounds completed
    GET  /jobs/<job>/state                       {"round", "rounds_completed", "expected", "received"}
    PUT  /jobs/<job>/rounds/<r>/update           safetensors pseudo-gradient (X-Samples optional)
    GET  /jobs/<job>/rounds/<r>/result?wait=<s>  safetensors u_r (X-Included; X-Weights-Digest: θ_r's digest),
                                                 204 while open, 410 when pruned
    GET  /healthz                                {"job", "round"}

Authorisation: every call carries ``Authorization: Bearer <transfer token>`` verified with the job key.
Missing, malformed, wrongly signed, expired or other-job tokens get 401. Updates need ``role`` ``trainer``
and a ``peer`` among the expected trainers — or one the control plane names when asked (``admit``: a trainer
that replaced a lost one) — else 403; model files and results need ``role`` ``trainer``
(any trainer of the job: one that joins late starts from the current weights); ``state`` and ``healthz``
accept any token of the job (the daemon and the control plane hold ``parameter_server`` ones). A path naming
another job is 404.

Every error is JSON ``{"error": <kind>, "detail": <message>}``. Update refusals: 409 ``round_conflict``,
404 ``unknown_round``, 413 ``too_large`` (body over 2x the global weights' size + 1 MiB), 422
``not_safetensors`` or ``refused_tensor`` (names, shapes, dtypes, NaN/Inf, int8 scales), 422 ``wrong_encoding``
(the body's ``hypha.encoding``/``hypha.block_size`` are not the job's: docs/training.md, "Encodings"; a body
without them is float32), 422 ``refused_samples``
(X-Samples over the job's ``max_samples_per_update``, or over what the control plane counted for the trainer
in the round — asked again before refusing; checked before the body is read), 422 ``refused_update`` (norm
out of bounds for the round, see :mod:`parameter_server.rounds`), 400 ``bad_request`` (X-Samples not an
integer of at most 18 digits). A refused update does not change the round; the refusal is noted in the
round report's ``refused``, and the trainer may send again. A model file name with a NUL is 404.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import tempfile
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from aiohttp import web

from hypha_tensors import weights as weights_io
from hypha_tensors.encoding import DecodedView, EncodedTensor, EncodingError, check, group, wire_dtype
from hypha_tensors.formats import Encoding
from hypha_tensors.spooled import SpooledFile, SpooledView
from parameter_server.exceptions import RoundError, TensorRefused, UpdateRefused, WeightsFileError
from parameter_server.rounds import RoundCoordinator
from worker_daemon import telemetry
from worker_daemon.protocol import TransferTokenError, verify_transfer_token

logger = logging.getLogger("parameter_server")

MAX_WAIT = 60.0
TRAINER_ROLE = "trainer"
_CHUNK = 1 << 20
# ASCII digits only (str.isdigit also takes '²', which int() refuses), and few enough for int() to parse.
_SAMPLES = re.compile(r"[0-9]{1,18}")


def error_response(status: int, kind: str, detail: str, **headers: str) -> web.Response:
    return web.json_response({"error": kind, "detail": detail}, status=status, headers=headers or None)


class _WrongEncoding(Exception):
    """An update body encoded otherwise than the job says (its metadata); the message says both."""


class _HTTPFailure(Exception):
    def __init__(self, status: int, kind: str, detail: str, **headers: str) -> None:
        super().__init__(detail)
        self.response = error_response(status, kind, detail, **headers)


@dataclass
class GlobalModelFiles:
    """The files trainers download: ``weights_path`` is the current ``model.safetensors`` (after
    ``rounds_completed`` rounds; replaced, never rewritten in place), the others live in ``files_dir``."""

    files_dir: Path
    weights_path: Path
    rounds_completed: int
    weights_filename: str = "model.safetensors"


class ParameterServerApp:
    """Holds the request handlers; :meth:`make_app` builds the aiohttp application.

    ``canonicalize`` maps an update's tensor names to the global ones (tied-weight aliases);
    ``signature`` is the global weights' name → (shape, dtype); updates must match its floating-point part,
    in ``encoding`` (the job's: updates in another are refused, 422 ``wrong_encoding``).
    """

    def __init__(
        self,
        *,
        job_id: str,
        transfer_key: str,
        coordinator: RoundCoordinator,
        files: GlobalModelFiles,
        signature: Mapping[str, weights_io.Signature],
        incoming_dir: Path,
        canonicalize: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]] = lambda update: update,
        max_update_bytes: int | None = None,
        admit: Callable[[str], Awaitable[bool]] | None = None,
        max_samples_per_update: int | None = None,
        count_samples: Callable[[str, int], Awaitable[int | None]] | None = None,
        encoding: Encoding | None = None,
    ) -> None:
        self.job_id = job_id
        self.transfer_key = transfer_key
        self.coordinator = coordinator
        self.files = files
        # Updates carry the floating-point tensors only (trainers synchronise no integer buffers); an integer
        # tensor a trainer sends anyway is ignored, as long as it is one of the model's.
        self.signature = {name: sig for name, sig in signature.items() if sig[1].is_floating_point}
        self.ignored_names = frozenset(signature) - frozenset(self.signature)
        self.encoding = encoding or Encoding()
        #: What an update's tensors must be on the wire: the global shapes, in the encoding's dtype.
        self.wire_signature = {
            name: (shape, wire_dtype(self.encoding, dtype)) for name, (shape, dtype) in self.signature.items()
        }
        self.incoming_dir = incoming_dir
        self.canonicalize = canonicalize
        #: Asked about a trainer of the job that is not expected (a replacement): True if it now is.
        self.admit = admit
        if max_update_bytes is None:
            max_update_bytes = 2 * files.weights_path.stat().st_size + (1 << 20)
        self.max_update_bytes = max_update_bytes
        #: The most samples one trainer can train on in a round (the job's cap; None: no cap).
        self.max_samples_per_update = max_samples_per_update
        #: Asked (peer, round) when X-Samples is over the control plane's last count for that trainer: the
        #: control plane's count now, or None if it does not count.
        self.count_samples = count_samples
        self.bytes_out = 0
        """Bytes of model files and results sent; the service reads and resets it for each round report."""

    def take_bytes_out(self) -> int:
        value, self.bytes_out = self.bytes_out, 0
        return value

    def make_app(self) -> web.Application:
        # client_max_size only bounds request.read()/json(); update bodies are streamed and bounded here.
        app = web.Application(middlewares=[self._errors])
        app.router.add_get("/healthz", self._healthz)
        app.router.add_get("/jobs/{job}/state", self._state)
        app.router.add_get("/jobs/{job}/model/{filename:.+}", self._model_file)
        app.router.add_put("/jobs/{job}/rounds/{round}/update", self._update)
        app.router.add_get("/jobs/{job}/rounds/{round}/result", self._result)
        return app

    # --- plumbing --------------------------------------------------------------------------------------------

    @web.middleware
    async def _errors(self, request: web.Request, handler: Callable[..., Any]) -> web.StreamResponse:
        try:
            return await handler(request)
        except _HTTPFailure as failure:
            return failure.response
        except (RoundError, UpdateRefused) as error:
            return error_response(error.status, error.kind, str(error))
        except web.HTTPException as error:
            if error.status >= 400:
                return error_response(error.status, error.reason.lower().replace(" ", "_"), error.reason)
            raise

    def _authorize(self, request: web.Request, *, trainer: bool) -> dict[str, Any]:
        header = request.headers.get("Authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise _HTTPFailure(
                401, "unauthorized", "a transfer token is required", **{"WWW-Authenticate": "Bearer"}
            )
        try:
            claims = verify_transfer_token(self.transfer_key, token.strip(), job_id=self.job_id)
        except TransferTokenError as error:
            raise _HTTPFailure(401, "unauthorized", str(error), **{"WWW-Authenticate": "Bearer"}) from None
        if trainer and claims.get("role") != TRAINER_ROLE:
            raise _HTTPFailure(403, "forbidden", f"role {claims.get('role')!r} may not do this; trainers may")
        job = request.match_info.get("job")
        if job is not None and job != self.job_id:
            raise _HTTPFailure(404, "unknown_job", f"this parameter server serves job {self.job_id}")
        return claims

    @staticmethod
    def _round_number(request: web.Request) -> int:
        text = request.match_info["round"]
        if not text.isdigit():
            raise _HTTPFailure(404, "unknown_round", f"{text!r} is not a round number")
        return int(text)

    # --- handlers --------------------------------------------------------------------------------------------

    async def _healthz(self, request: web.Request) -> web.Response:
        self._authorize(request, trainer=False)
        return web.json_response({"job": self.job_id, "round": self.coordinator.open_round})

    async def _state(self, request: web.Request) -> web.Response:
        self._authorize(request, trainer=False)
        return web.json_response(
            {
                "round": self.coordinator.open_round,
                "rounds_completed": self.coordinator.rounds_completed,
                "expected": list(self.coordinator.expected),
                "received": self.coordinator.received,
            }
        )

    async def _model_file(self, request: web.Request) -> web.StreamResponse:
        self._authorize(request, trainer=True)
        filename = request.match_info["filename"]
        # Read both at once: the file and its round must belong together (the service swaps them together).
        files = self.files
        if filename == files.weights_filename:
            path, rounds_completed = files.weights_path, files.rounds_completed
        elif "\0" in filename:  # the operating system refuses the path outright (ValueError, not OSError)
            raise _HTTPFailure(404, "not_found", "the model has no file whose name holds a NUL")
        else:
            path, rounds_completed = (files.files_dir / filename).resolve(), files.rounds_completed
            if not path.is_relative_to(files.files_dir.resolve()) or not path.is_file():
                raise _HTTPFailure(404, "not_found", f"the model has no file {filename!r}")
        return await self._send_file(request, path, {"X-Round": str(rounds_completed)})

    async def _send_file(
        self, request: web.Request, path: Path, headers: dict[str, str]
    ) -> web.StreamResponse:
        """Stream ``path`` completely before returning (the caller then knows it was delivered).

        Not ``web.FileResponse``: that one is sent after the handler returns, and the result handler must
        know the bytes went out before it counts a trainer as having fetched its result."""
        with open(path, "rb") as file:  # opened now: the service may replace or prune the path meanwhile
            size = os.fstat(file.fileno()).st_size
            response = web.StreamResponse(headers={**headers, "Content-Type": "application/octet-stream"})
            response.content_length = size
            await response.prepare(request)
            while chunk := await asyncio.to_thread(file.read, _CHUNK):
                await response.write(chunk)
        await response.write_eof()
        self.bytes_out += size
        return response

    def _samples(self, request: web.Request) -> int | None:
        text = request.headers.get("X-Samples")
        if text is None or not text.strip():
            return None
        if not _SAMPLES.fullmatch(text.strip()):
            raise _HTTPFailure(
                400,
                "bad_request",
                f"X-Samples must be an integer >= 0 of at most 18 digits, got {text[:40]!r}",
            )
        return int(text.strip())

    async def _check_samples(self, peer: str, round_number: int, samples: int | None) -> None:
        """422 ``refused_samples`` (noted in the round) if ``samples`` is more than ``peer`` can have trained
        on in the round: the job's cap, then the control plane's count for it (asked again when the last one
        it gave is lower, or none was given; not asked once it answered without counts)."""
        if samples is None:
            return
        cap = self.max_samples_per_update
        detail = None
        if cap is not None and samples > cap:
            detail = (
                f"X-Samples {samples} is more than a trainer can have trained on in a round "
                f"(at most {cap} in this job)"
            )
        elif self.count_samples is not None and self.coordinator.counts_reported is not False:
            counted = self.coordinator.counted(round_number, peer)
            if counted is None or samples > counted:
                counted = await self.count_samples(peer, round_number)
            if counted is not None and samples > counted:
                detail = (
                    f"X-Samples {samples} is more than the control plane counted for this trainer in "
                    f"round {round_number} ({counted})"
                )
        if detail is not None:
            self.coordinator.record_refusal(peer, round_number, detail)
            raise _HTTPFailure(422, "refused_samples", detail)

    async def _receive_body(self, request: web.Request, peer: str, round_number: int) -> Path:
        """The body in a temporary file (the caller deletes it); 413 past ``max_update_bytes``."""
        limit = self.max_update_bytes
        too_large = f"the update is over {limit} bytes (2x the global weights + 1 MiB)"
        if request.content_length is not None and request.content_length > limit:
            self.coordinator.record_refusal(peer, round_number, "too large")
            raise _HTTPFailure(413, "too_large", too_large)
        self.incoming_dir.mkdir(parents=True, exist_ok=True)
        descriptor, name = tempfile.mkstemp(
            prefix=f"round-{round_number}-", suffix=".partial", dir=self.incoming_dir
        )
        path = Path(name)
        size = 0
        try:
            with open(descriptor, "wb") as file:
                async for chunk in request.content.iter_chunked(_CHUNK):
                    size += len(chunk)
                    if size > limit:
                        self.coordinator.count_bytes_in(round_number, size)
                        self.coordinator.record_refusal(peer, round_number, "too large")
                        raise _HTTPFailure(413, "too_large", too_large)
                    file.write(chunk)
        except BaseException:
            path.unlink(missing_ok=True)
            raise
        self.coordinator.count_bytes_in(round_number, size)
        return path

    def _parse_update(self, path: Path, round_number: int | None = None) -> DecodedView:
        """The update in ``path``, checked against the global weights, as a view that reads and decodes a
        tensor from the file at every read (the round measures, then adds, one tensor at a time: no update is
        ever in memory whole; the caller closes ``view.file`` and deletes ``path`` once the round took it).
        ``_WrongEncoding`` when its metadata names another encoding than the job's; ``WeightsFileError``,
        ``TensorRefused`` (names, shapes, wire dtypes, NaN/Inf) or ``EncodingError`` (int8 scales) when it
        is unusable. With ``round_number``, the names must be that round's (its fragment's, in a streaming
        job); without, the whole model's."""
        try:
            encoding = Encoding.from_metadata(weights_io.read_metadata(path))
        except EncodingError as error:
            raise _WrongEncoding(f"the update's encoding is unusable: {error}") from None
        if encoding != self.encoding:
            raise _WrongEncoding(
                f"the update is encoded as {encoding}; this job's updates are {self.encoding}"
            )
        spooled = SpooledFile(path)
        try:
            return self._check_spooled(spooled, round_number)
        except BaseException:
            spooled.close()
            raise

    def _check_spooled(self, spooled: SpooledFile, round_number: int | None) -> SpooledView:
        # NaN and Inf first, as weights_io.load refuses them (a slice at a time: nothing model-sized).
        spooled.check_finite()
        # Names only: each maps to the file's names of its values and scales, read when the round asks.
        update = self.canonicalize(group({name: name for name in spooled.names}, self.encoding))
        for name in self.ignored_names & update.keys():
            del update[name]
        # What is left to check is the names, shapes and dtypes (on the wire, from the header), then each
        # int8 tensor's scales. A streaming round takes its fragment's names only.
        reference = self.wire_signature
        if round_number is not None and self.coordinator.fragment_count > 1:
            self.coordinator.check_names(round_number, update)
            reference = {name: reference[name] for name in self.coordinator.round_names(round_number)}
        weights_io.validate(
            {name: spooled.meta(entry.values) for name, entry in update.items()},
            reference=reference,
            check_finite=False,
        )
        for name in sorted(update):
            values, scales = update[name]
            entry = EncodedTensor(spooled.meta(values), None if scales is None else spooled.read(scales))
            check(entry, self.encoding, name=name)
        return SpooledView(
            spooled,
            update,
            self.encoding,
            dtypes={name: dtype for name, (_, dtype) in self.signature.items()},
        )

    async def _update(self, request: web.Request) -> web.Response:
        """A span per update (when tracing is on): ``hypha.outcome`` accepted or refused, with the reason."""
        with telemetry.span("update") as current:
            try:
                response = await self._accept_update(request, current)
            except _HTTPFailure as failure:
                telemetry.annotate(
                    current,
                    **{
                        "hypha.outcome": "refused",
                        "hypha.reason": str(failure),
                        "http.response.status_code": failure.response.status,
                    },
                )
                raise
            except (RoundError, UpdateRefused) as error:
                telemetry.annotate(
                    current,
                    **{
                        "hypha.outcome": "refused",
                        "hypha.reason": str(error),
                        "http.response.status_code": error.status,
                    },
                )
                raise
            telemetry.annotate(
                current, **{"hypha.outcome": "accepted", "http.response.status_code": response.status}
            )
            return response

    async def _accept_update(self, request: web.Request, current: Any) -> web.Response:
        claims = self._authorize(request, trainer=True)
        peer = str(claims["peer"])
        if peer not in self.coordinator.expected and not (self.admit is not None and await self.admit(peer)):
            raise _HTTPFailure(403, "forbidden", f"peer {peer!r} is not a trainer of this round")
        telemetry.annotate(current, **{"hypha.peer": peer})
        round_number = self._round_number(request)
        telemetry.annotate(current, **{"hypha.round": round_number})
        samples = self._samples(request)
        # Before reading the body: a late or duplicate update is refused without receiving megabytes.
        self.coordinator.check_can_submit(peer, round_number)
        await self._check_samples(peer, round_number, samples)
        path = await self._receive_body(request, peer, round_number)
        update: DecodedView | None = None
        try:
            try:
                update = await asyncio.to_thread(self._parse_update, path, round_number)
            except WeightsFileError as error:
                self.coordinator.record_refusal(peer, round_number, f"not safetensors: {error.reason}")
                raise _HTTPFailure(
                    422, "not_safetensors", f"the body is not a usable safetensors file: {error.reason}"
                ) from None
            except (TensorRefused, EncodingError) as error:
                self.coordinator.record_refusal(peer, round_number, str(error))
                raise _HTTPFailure(422, "refused_tensor", str(error)) from None
            except _WrongEncoding as error:
                self.coordinator.record_refusal(peer, round_number, str(error))
                raise _HTTPFailure(422, "wrong_encoding", str(error)) from None
            # The round reads the update from the file, a tensor at a time (one update at a time: its lock).
            await self.coordinator.submit(peer, round_number, update, samples)
        finally:
            # Not closed here: a round's thread may still read it (a request cancelled while it was added);
            # the file closes when the last reference goes, and its unlinked bytes stay readable until then.
            del update
            path.unlink(missing_ok=True)
        telemetry.annotate(current, **{"hypha.samples": samples})
        return web.json_response({"round": round_number, "accepted": True})

    async def _result(self, request: web.Request) -> web.StreamResponse:
        claims = self._authorize(request, trainer=True)
        round_number = self._round_number(request)
        try:
            wait = float(request.query.get("wait", "0"))
        except ValueError:
            raise _HTTPFailure(400, "bad_request", "wait must be a number of seconds") from None
        wait = min(max(wait, 0.0), MAX_WAIT) if wait == wait else 0.0  # NaN → 0
        result = await self.coordinator.wait_result(round_number, wait)
        if result is None or result.path is None:
            return web.Response(status=204, headers={"X-Round": str(round_number)})
        included = str(claims.get("peer")) in result.participants
        headers = {"X-Included": "true" if included else "false", "X-Round": str(round_number)}
        if result.digest is not None:
            headers["X-Weights-Digest"] = result.digest
        response = await self._send_file(request, result.path, headers)
        await self.coordinator.mark_fetched(str(claims.get("peer")), round_number)
        return response


async def start_http(app: web.Application, *, host: str, port: int) -> tuple[web.AppRunner, int]:
    """Serve ``app`` on ``host:port`` (port 0: a free port); returns the runner and the bound port."""
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=5.0)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    try:
        await site.start()
    except BaseException:
        await runner.cleanup()
        raise
    return runner, runner.addresses[0][1]


async def stop_http(runner: web.AppRunner) -> None:
    with contextlib.suppress(Exception):
        await runner.cleanup()
