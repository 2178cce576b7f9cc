"""The parameter server's life, from the initial model to the final upload (docs/training.md steps 3, 7, 8).

:func:`run` is what ``python -m parameter_server`` runs:

1. Build or fetch the initial model (:mod:`parameter_server.model`); if ``work_dir/checkpoints`` has a
   round, or the job's ``checkpoint`` names a later one the control plane keeps (this server replaces a lost
   one), restore its weights, momentum, round number and last result instead, else save round 0. Every round
   (round 0 included) is uploaded to the control plane before it is published: its momentum and result, and
   its weights every ``rounds.checkpoint_every`` rounds (the copy replays the results since on them).
2. Bind the HTTP API, then report ``{"ready": {"url", "round"}}`` through the bridge.
3. For each round the coordinator publishes: compute the eval loss (if the job has ``eval``) in a thread,
   then report ``{"round": {...}}``. When a round accepts its first update, report ``{"waiting": {"round"}}``
   in the background, and again every ``EXPECT_REFRESH`` seconds while the round waits; an ``Expect`` reply
   says whom the round waits for (a dead trainer dropped, a replacement added) and for how long
   (:meth:`RoundCoordinator.expect`), and, if it counts them, how many samples each trainer reported in the
   round (``"samples": {peer: n}``: the most its X-Samples may claim; asked again when an update claims
   more). An update from a trainer the round does not expect (a replacement) is accepted if the control
   plane, asked at once, names it. A reply's ``"discard": n`` (the owner discards round n, the last closed
   one) makes round n + 1 close by going back to round n − 1's weights and momentum. The round is finished when the reply is ``{"type": "Done"}`` or
   ``update_rounds`` rounds are done.
4. Upload ``config.json``, ``model.safetensors`` and the model's data files (``generation_config.json``,
   tokenizer files: ``final_model_files``) to the control plane, keep serving until every
   participant of the last round fetched its result (or ``final_wait`` seconds pass), return 0.

Files under ``work_dir``: ``model/`` (config and other non-weight files), ``global/round-N.safetensors``
(the global weights after round N, the last two kept), ``results/round-N.safetensors`` (u_N, the last two),
``checkpoints/`` (weights, momentum and u_r per round, the last two), ``incoming/`` (update bodies being read),
``eval/`` (cached eval slices), ``source/`` (downloaded model files).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import math
import shutil
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

from hypha_tensors import weights as weights_io
from hypha_tensors.fragments import FragmentError, largest_share, partition
from parameter_server import checkpoints, memory
from parameter_server.evaluation import Evaluator
from parameter_server.exceptions import (
    CheckpointError,
    EvalDataError,
    EvalNotFinite,
    JobConfigError,
    ParameterServerError,
)
from parameter_server.job import JobConfig
from parameter_server.math import StateDict
from parameter_server.model import (
    ControlPlaneAccess,
    InitialModel,
    final_model_files,
    prepare_model,
)
from parameter_server.relay_pump import RelayPump, loopback_host
from parameter_server.reporting import (
    BridgeReporter,
    download_checkpoint,
    upload_checkpoint,
    upload_model,
)
from parameter_server.rounds import KEEP_RESULTS, SPARE_SETS, RoundCoordinator, RoundResult
from parameter_server.server import GlobalModelFiles, ParameterServerApp, start_http, stop_http
from worker_daemon.relay import RelayClient

logger = logging.getLogger("parameter_server")

# safetensors metadata transformers' from_pretrained looks for.
FILE_METADATA = {"format": "pt"}
#: After the control plane says the expected trainers are due in ``d`` seconds, the round waits at most
#: ``EXPECT_FACTOR · d + EXPECT_GRACE`` seconds more (and never past ``round_timeout``): their uploads and
#: the estimate's error need the slack.
EXPECT_FACTOR = 2.0
EXPECT_GRACE = 30.0
#: Seconds between two questions about a round that waits for updates (a trainer may die meanwhile).
EXPECT_REFRESH = 10.0


@dataclass(frozen=True)
class Settings:
    """Where the parameter server listens and whom it talks to (command line and environment)."""

    work_dir: Path
    socket_path: Path
    host: str
    port: int
    public_url: str | None
    transfer_key: str
    transfer_token: str
    server_url: str
    final_wait: float = 60.0
    upload_deadline: float = 60.0
    #: Seconds a checkpoint upload (or the download of the one to resume from) keeps retrying: a control
    #: plane being redeployed must not fail the job.
    checkpoint_deadline: float = 600.0
    #: Seconds a round's report waits for the round's participants to fetch its result, so that the round's
    #: ``bytes_out`` counts those downloads (a slower one counts in the next round's report).
    result_fetch_wait: float = 5.0
    #: Where the daemon keeps the current transfer token (``HYPHA_TRANSFER_TOKEN_FILE``): tokens are
    #: short-lived and refreshed there; ``transfer_token`` is the first one, used when the file is unreadable.
    transfer_token_file: Path | None = None

    def current_token(self) -> str:
        if self.transfer_token_file is not None:
            try:
                token = self.transfer_token_file.read_text(encoding="ascii").strip()
            except (OSError, UnicodeDecodeError) as error:
                logger.warning("cannot read the transfer token file %s: %s", self.transfer_token_file, error)
            else:
                if token:
                    return token
        return self.transfer_token


class Stopped(Exception):
    """SIGTERM (or SIGINT) arrived: stop serving now."""


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def _round_file(directory: Path, round_number: int) -> Path:
    return directory / f"round-{round_number:09d}.safetensors"


def _prune(directory: Path, keep_from: int) -> None:
    for path in directory.glob("round-*.safetensors"):
        with contextlib.suppress(ValueError, OSError):
            if int(path.name.removeprefix("round-").removesuffix(".safetensors")) < keep_from:
                # A download in progress keeps its open file; unlinking does not cut it short.
                path.unlink()


class ParameterServer:
    """One job's parameter server: see the module docstring. Use :meth:`start`, :meth:`serve`, :meth:`aclose`."""

    def __init__(self, job: JobConfig, settings: Settings) -> None:
        self.job = job
        self.settings = settings
        self.work_dir = settings.work_dir
        self.global_dir = self.work_dir / "global"
        self.results_dir = self.work_dir / "results"
        self.checkpoint_dir = self.work_dir / "checkpoints"
        self.initial: InitialModel | None = None
        self.coordinator: RoundCoordinator | None = None
        self.app: ParameterServerApp | None = None
        self.public_url: str | None = None
        self.reporter = BridgeReporter(settings.socket_path)
        self.evaluator = (
            Evaluator(config=job.eval, input_names=job.input_names, cache_dir=self.work_dir / "eval")
            if job.eval is not None
            else None
        )
        self._weights_after: dict[int, StateDict] = {}
        #: One eval at a time on the one model (a round's report and the next round's loss checks).
        self._eval_lock = asyncio.Lock()
        self._background: set[asyncio.Task[None]] = set()
        self._runner: Any = None
        self._session: aiohttp.ClientSession | None = None
        #: Moves bytes through the control plane's relay when the trainers cannot reach this server.
        self.relay: RelayPump | None = None
        self._relay_session: aiohttp.ClientSession | None = None
        self._bound_port = 0
        #: The checkpoint copy on the control plane: the round whose weights it holds (its base) and the
        #: rounds since, whose results it replays on them (parameter_server/checkpoints.py).
        self._checkpoint_base = 0
        self._checkpoint_chain: tuple[checkpoints.ChainLink, ...] = ()

    # --- start -----------------------------------------------------------------------------------------------

    async def start(self) -> None:
        """Prepare the model, restore or save round 0, bind the HTTP port (no report yet)."""
        for directory in (self.global_dir, self.results_dir):
            directory.mkdir(parents=True, exist_ok=True)
        access = ControlPlaneAccess(server_url=self.settings.server_url, token=self.settings.current_token())
        initial = await asyncio.to_thread(prepare_model, self.job, self.work_dir, control_plane=access)
        self.initial = initial
        fragments = self._fragments(initial)
        state = await self._restore()
        last_result = None
        if state is None:
            weights, momentum, completed = initial.weights, None, 0
            await asyncio.to_thread(
                checkpoints.save_round,
                self.checkpoint_dir,
                round_number=0,
                weights=weights,
                momentum=None,
                keep=2,
                base_round=0,
                digest=await asyncio.to_thread(weights_io.digest, weights),
            )
        else:
            expected = weights_io.signature(initial.weights)
            if weights_io.signature(state.weights) != expected:
                raise CheckpointError("the checkpoint's weights do not match the job's model")
            weights, momentum, completed = state.weights, state.momentum, state.round_number
            logger.info("resuming after round %d from %s", completed, self.checkpoint_dir)
            # A round saved without a base (an older server's) was uploaded with its weights: a base.
            self._checkpoint_base = completed if state.base_round is None else state.base_round
            self._checkpoint_chain = state.chain
            if state.result is not None and completed > 0:
                # Trainers that sent this round's update may not have fetched u_r from the previous server.
                result_path = _round_file(self.results_dir, completed)
                published = await asyncio.to_thread(weights_io.digest, weights)
                await asyncio.to_thread(
                    weights_io.save,
                    result_path,
                    state.result,  # in the job's encoding, as the round's result file was
                    metadata={**FILE_METADATA, **self.job.encoding.metadata()},
                    round_number=completed,
                    weights_digest=published,
                )
                last_result = RoundResult(
                    round_number=completed,
                    update=state.result,
                    participants=state.participants,
                    left_out=(),
                    refused={},
                    samples=0,
                    duration=0.0,
                    bytes_in=0,
                    stepped=True,
                    path=result_path,
                    digest=published,
                )
        resume = self.job.resume
        if resume is None or resume.round_number < completed:
            # The control plane keeps a copy of the last round: a server started elsewhere resumes from it.
            await self._upload_checkpoint(completed)
        weights_path = _round_file(self.global_dir, completed)
        await asyncio.to_thread(
            weights_io.save,
            weights_path,
            weights,
            metadata=FILE_METADATA,
            round_number=completed,
            weights_digest=await asyncio.to_thread(weights_io.digest, weights),
        )

        self.coordinator = RoundCoordinator(
            expected=self.job.expected_peers,
            weights=weights,
            momentum=momentum,
            rounds_completed=completed,
            update_rounds=self.job.update_rounds,
            round_timeout=self.job.round_timeout,
            weighted=self.job.weighted,
            learning_rate=self.job.learning_rate,
            momentum_factor=self.job.momentum,
            persist=self._persist,
            on_first_update=self._first_update,
            last_result=last_result,
            update_norm_ratio=self.job.update_norm_ratio,
            buffers=initial.buffers,
            encoding=self.job.encoding,
            fragments=fragments,
            aggregation=self.job.aggregation,
            evaluate=self._held_out_loss if self.evaluator is not None else None,
        )
        self.app = ParameterServerApp(
            job_id=self.job.job_id,
            transfer_key=self.settings.transfer_key,
            coordinator=self.coordinator,
            files=GlobalModelFiles(
                files_dir=initial.files_dir, weights_path=weights_path, rounds_completed=completed
            ),
            signature=weights_io.signature(weights),
            incoming_dir=self.work_dir / "incoming",
            canonicalize=initial.canonicalize,
            admit=self._admit,
            max_samples_per_update=self.job.max_samples_per_update,
            count_samples=self._count_samples,
            encoding=self.job.encoding,
        )
        # The round-0 weights are the coordinator's now (it replaces them after each round), and the model
        # object serves the eval only: kept here, each would hold one model size all job (issue 17).
        initial.weights = {}
        if self.evaluator is None:
            initial.model = None
        memory.release()
        self._runner, port = await start_http(
            self.app.make_app(), host=self.settings.host, port=self.settings.port
        )
        self._bound_port = port
        self.public_url = self.settings.public_url or f"http://{self.settings.host}:{port}"
        logger.info(
            "serving job %s at %s (listening on %s:%d), round %d of %d",
            self.job.job_id,
            self.public_url,
            self.settings.host,
            port,
            completed + 1,
            self.job.update_rounds,
        )

    def _fragments(self, initial: InitialModel) -> list[frozenset[str]] | None:
        """The names of each fragment of a streaming job (computed once, from the floating-point canonical
        weights and their aliases, as trainers compute them from their state dict); None for any other job.
        ``JobConfigError`` when the model cannot be split so (fewer blocks than fragments)."""
        count = self.job.fragments
        if count <= 1:
            return None
        try:
            parts = partition(initial.tied_groups(), count)
        except FragmentError as error:
            raise JobConfigError(f"rounds.fragments: {error}") from None
        elements = {name: size for names, size in initial.tied_groups() for name in names[:1]}
        logger.info(
            "streaming: %d fragments, one synced per round (the largest holds %.0f%% of the model)",
            count,
            100 * largest_share(parts, elements),
        )
        return parts

    async def _restore(self) -> checkpoints.RoundState | None:
        """The round to resume from: the work dir's last one, or the control plane's copy if that is newer
        (this server replaces one that was lost); None for a fresh start."""
        local = await asyncio.to_thread(checkpoints.load_latest, self.checkpoint_dir)
        resume = self.job.resume
        if resume is None or (local is not None and local.round_number >= resume.round_number):
            return local
        logger.info("fetching round %d's checkpoint from the control plane", resume.round_number)
        self.checkpoint_dir.mkdir(parents=True, exist_ok=True)
        partial = Path(
            tempfile.mkdtemp(prefix=f"{checkpoints.PARTIAL_PREFIX}download-", dir=self.checkpoint_dir)
        )
        try:
            await download_checkpoint(
                server_url=self.settings.server_url,
                uri=resume.uri,
                token=self.settings.current_token(),
                files={entry.name: (entry.size, entry.sha256) for entry in resume.files},
                directory=partial,
                deadline=self.settings.checkpoint_deadline,
            )
        except BaseException:
            shutil.rmtree(partial, ignore_errors=True)
            raise
        state = await asyncio.to_thread(checkpoints.adopt_round, self.checkpoint_dir, partial)
        if state.round_number != resume.round_number:
            raise CheckpointError(
                f"the control plane's checkpoint holds round {state.round_number}, not {resume.round_number}"
            )
        if state.base_round is not None and state.base_round < state.round_number:
            logger.info(
                "round %d replayed from round %d's weights and %d results: the digest %s checks",
                state.round_number,
                state.base_round,
                len(state.chain),
                state.digest,
            )
        return state

    async def _upload_checkpoint(self, round_number: int) -> None:
        await upload_checkpoint(
            server_url=self.settings.server_url,
            job_id=self.job.job_id,
            round_number=round_number,
            token=self.settings.current_token(),
            files=checkpoints.round_files(self.checkpoint_dir, round_number),
            deadline=self.settings.checkpoint_deadline,
        )

    async def _persist(self, result: RoundResult, weights: StateDict, momentum: StateDict | None) -> None:
        """Checkpoint (here and on the control plane), then the new global file and u_r's file; only then is
        the round published: a round trainers saw is never lost with this server."""
        assert self.app is not None
        number = result.round_number
        # θ_r's digest goes with everything published of round r: trainers check their merge against it,
        # and a server resumed from the control plane's copy checks its replay against it.
        result.digest = await asyncio.to_thread(weights_io.digest, weights)
        # The copy gets the full weights every checkpoint_every rounds; between, the round's result only.
        base = self._checkpoint_base
        chain = (*self._checkpoint_chain, checkpoints.ChainLink(number, result.stepped))
        if number - base >= self.job.checkpoint_every:
            base, chain = number, ()
        await asyncio.to_thread(
            checkpoints.save_round,
            self.checkpoint_dir,
            round_number=number,
            weights=weights,
            momentum=momentum,
            result=result.file_tensors(),
            participants=result.participants,
            keep=2,
            base_round=base,
            chain=chain,
            digest=result.digest,
            result_metadata=result.file_metadata(),
        )
        self._checkpoint_base, self._checkpoint_chain = base, chain
        await self._upload_checkpoint(number)
        weights_path = _round_file(self.global_dir, number)
        result_path = _round_file(self.results_dir, number)
        published = {"metadata": FILE_METADATA, "round_number": number, "weights_digest": result.digest}
        await asyncio.to_thread(weights_io.save, weights_path, weights, **published)
        encoded = {**published, "metadata": {**FILE_METADATA, **result.file_metadata()}}
        await asyncio.to_thread(weights_io.save, result_path, result.file_tensors(), **encoded)
        logger.info("round %d: the global weights' digest is %s", number, result.digest)
        result.path = result_path
        # One assignment: a download sees the old (file, round) or the new one, never a mix.
        self.app.files = GlobalModelFiles(
            files_dir=self.app.files.files_dir, weights_path=weights_path, rounds_completed=number
        )
        self._weights_after[number] = weights
        if self.relay is not None:
            self.relay.publish_result(result)
        _prune(self.global_dir, number - 1)
        _prune(self.results_dir, number - KEEP_RESULTS + 1)

    # --- serve -----------------------------------------------------------------------------------------------

    async def serve(self, stop: asyncio.Event) -> int:
        """Report ready, run the rounds, upload the final model, wait for the last fetches. Returns 0, or
        raises ``Stopped`` when ``stop`` is set and ``ParameterServerError`` on a fatal failure."""
        coordinator = self.coordinator
        assert coordinator is not None and self.app is not None
        ready = await self.reporter.send(
            {"ready": {"url": self.public_url, "round": coordinator.rounds_completed}}
        )
        if isinstance(ready, dict) and ready.get("path") == "relay":
            self._start_relay()
        stop_waiter = asyncio.ensure_future(stop.wait())
        try:
            # Until no round is open (or closing) and every published round is reported: a Done reply may
            # arrive while the next round is being closed, and that round is still reported.
            while coordinator.open_round is not None or not coordinator.published.empty():
                getter = asyncio.ensure_future(coordinator.published.get())
                done, _ = await asyncio.wait(
                    {getter, stop_waiter, coordinator.failure}, return_when=asyncio.FIRST_COMPLETED
                )
                if getter not in done:
                    getter.cancel()
                if stop_waiter in done:
                    raise Stopped()
                if coordinator.failure in done:
                    raise ParameterServerError(f"a round could not be closed: {coordinator.failure.result()}")
                reply = await self._report(getter.result())
                del getter  # the round's result (u) goes back to the pool now, not at the next round's
                # The pool keeps what the open round still needs (parameter_server/rounds: SPARE_SETS): less
                # the momentum's set when it is updated in place (float32), less the accumulator's when the
                # round has one already (its first update came before this report, while u was still held:
                # it took a set of its own). Else one model size more stays resident all job.
                spare = (
                    SPARE_SETS - (0 if self.job.encoding.lossy else 1) - (1 if coordinator.received else 0)
                )
                coordinator.pool.trim(spare)
                memory.release()  # what the round's reading and stepping left free in the C heaps
                if reply is not None and reply.get("type") == "Done":
                    logger.info("the control plane says the job is done")
                    coordinator.finish()
            await self._finish(stop_waiter)
        finally:
            stop_waiter.cancel()
        return 0

    def _start_relay(self) -> None:
        """The control plane says trainers reach this server through the relay: move their bytes there."""
        coordinator = self.coordinator
        assert coordinator is not None and self.app is not None
        self._relay_session = aiohttp.ClientSession()
        client = RelayClient(
            self.settings.server_url,
            self.job.job_id,
            self.settings.current_token,
            self._relay_session,
        )
        self.relay = RelayPump(
            client=client,
            session=self._relay_session,
            job_id=self.job.job_id,
            transfer_key=self.settings.transfer_key,
            local_base=f"http://{_url_host(loopback_host(self.settings.host))}:{self._bound_port}",
            coordinator=coordinator,
            incoming_dir=self.work_dir / "incoming",
            model_file=self._model_file,
        )
        self.relay.start()
        logger.info("trainers reach this server through the control plane's relay")
        last = coordinator.result(coordinator.rounds_completed)
        if last is not None and last.path is not None:
            self.relay.publish_result(last)  # a resumed server: u_r again for trainers that missed it

    def _model_file(self, filename: str) -> tuple[Path, int, str | None] | None:
        """(path, round, θ's digest) of a current global-model file, None for a name the model lacks."""
        assert self.app is not None
        files = self.app.files
        if filename == files.weights_filename:
            _, digest = weights_io.publication(files.weights_path)
            return files.weights_path, files.rounds_completed, digest
        if "\0" in filename:
            return None
        path = (files.files_dir / filename).resolve()
        if not path.is_relative_to(files.files_dir.resolve()) or not path.is_file():
            return None
        return path, files.rounds_completed, None

    def _first_update(self, round_number: int, peer: str) -> None:
        task = asyncio.create_task(self._ask_expected(round_number), name=f"expect round {round_number}")
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _ask_expected(self, round_number: int) -> None:
        """While round ``round_number`` waits for updates, ask the control plane every
        :data:`EXPECT_REFRESH` seconds whom it should still wait for (a trainer may die meanwhile)."""
        while await self._expect(round_number):
            await asyncio.sleep(EXPECT_REFRESH)

    async def _expect(self, round_number: int) -> bool:
        """Ask the control plane whom round ``round_number`` should wait for, and for how long: it answers
        ``{"type": "Expect", "peers": [...], "due_in": seconds | null, "samples": {peer: n}}`` (``samples``
        optional; any other answer, e.g. a scheduler that does not know the question, leaves the round as it
        is), and ``"discard": n`` when the job's owner discards round n (:meth:`_discard`). False once the
        round is no longer open."""
        coordinator = self.coordinator
        if coordinator is None or coordinator.open_round != round_number:
            return False
        reply = await self.reporter.send({"waiting": {"round": round_number}})
        if (
            not isinstance(reply, dict)
            or reply.get("type") != "Expect"
            or not isinstance(reply.get("peers"), list)
        ):
            return coordinator.open_round == round_number
        due = reply.get("due_in")
        timeout = None
        if isinstance(due, int | float) and not isinstance(due, bool) and math.isfinite(due) and due >= 0:
            timeout = EXPECT_FACTOR * float(due) + EXPECT_GRACE
        counted = reply.get("samples")
        samples = None
        if isinstance(counted, dict):
            # A count that is not a non-negative integer is no count: that trainer is bounded by the cap only.
            samples = {
                str(peer): count
                for peer, count in counted.items()
                if isinstance(count, int) and not isinstance(count, bool) and count >= 0
            }
        coordinator.expect(round_number, [str(peer) for peer in reply["peers"]], timeout, samples)
        if "discard" in reply:
            self._discard(reply["discard"])
        return coordinator.open_round == round_number

    def _discard(self, number: Any) -> None:
        """An ``Expect`` reply's ``"discard": n``: the job's owner discards round n, the last closed one
        (:meth:`RoundCoordinator.request_discard`); anything but a round number is ignored, and logged."""
        coordinator = self.coordinator
        if coordinator is None or number is None:
            return
        if (
            not isinstance(number, int)
            or isinstance(number, bool)
            or not 1 <= number <= self.job.update_rounds
        ):
            logger.warning(
                "ignoring the control plane's discard %r: not a round of this job", str(number)[:40]
            )
            return
        refused = coordinator.request_discard(number, functools.partial(self._previous_round, number - 1))
        if refused is not None:
            logger.warning("round %d cannot be discarded: %s", number, refused)

    def _previous_round(self, round_number: int) -> tuple[StateDict, StateDict | None] | None:
        """Round ``round_number``'s weights and momentum from its checkpoint (None when it is not kept)."""
        state = checkpoints.load_round(self.checkpoint_dir, round_number)
        return None if state is None else (state.weights, state.momentum)

    async def _count_samples(self, peer: str, round_number: int) -> int | None:
        """The samples the control plane counted for ``peer`` in round ``round_number``, asked now; None if it
        does not say."""
        coordinator = self.coordinator
        if coordinator is None:
            return None
        await self._expect(round_number)
        return coordinator.counted(round_number, peer)

    async def _admit(self, peer: str) -> bool:
        """A trainer token of this job for a peer the round does not expect (a replacement that joined): ask
        the control plane, and let it send if the control plane names it."""
        coordinator = self.coordinator
        if coordinator is None or coordinator.open_round is None:
            return False
        await self._expect(coordinator.open_round)
        return peer in coordinator.expected

    async def _report(self, result: RoundResult) -> dict[str, Any] | None:
        assert self.app is not None
        weights = self._weights_after.pop(result.round_number, None)
        # The coordinator's loss checks may have measured it already (parameter_server/rounds/validation.py).
        if self.evaluator is not None and weights is not None and result.eval_loss is None:
            result.eval_loss, result.eval_error = await self._eval_loss(weights)
        if self.relay is None and self.coordinator is not None:
            # The result's direct downloads count in its own round, not in whichever report comes after they
            # end (a round once showed bytes_out 0 while its trainers' downloads were still running). Through
            # the relay the result leaves once, as its upload (settled below), whoever fetches it.
            await self.coordinator.wait_result_fetched(result.round_number, self.settings.result_fetch_wait)
        bytes_out = self.app.take_bytes_out()
        relay_in = relay_out = 0
        if self.relay is not None:
            await self.relay.settle(result.round_number)  # the result's upload counts in its round
            relay_in, relay_out = self.relay.take_bytes(result.round_number)
        body = {
            "round": result.round_number,
            "participants": list(result.participants),
            "arrivals": dict(result.arrivals),
            "left_out": list(result.left_out),
            "refused": dict(result.refused),
            "samples": result.samples,
            "duration": result.duration,
            "bytes_in": result.bytes_in,
            "bytes_out": bytes_out,
            "encoding": result.encoding.name,
            # Which path the bytes took (docs/transfers.md): relay updates reach the API on loopback, so
            # bytes_in counts them too.
            "transfers": {
                "direct": {"in": max(result.bytes_in - relay_in, 0), "out": bytes_out},
                "relay": {"in": relay_in, "out": relay_out},
            },
            "eval_loss": result.eval_loss,
            "eval_error": result.eval_error,
            "discarded": result.discarded,
        }
        if result.verdicts:  # a round that verified or robustly aggregated its updates (none: as before)
            body["verdicts"] = dict(result.verdicts)
        logger.info("round %d report: %s", result.round_number, body)
        return await self.reporter.send({"round": body})

    async def _eval_loss(self, weights: StateDict) -> tuple[float | None, str | None]:
        """(the eval loss, None), or (None, why there is none): the round report says why, so that a model
        whose outputs turned NaN is not shown as a round without eval."""
        assert self.evaluator is not None and self.initial is not None
        if self._session is None:
            self._session = aiohttp.ClientSession()
        try:
            async with self._eval_lock:  # the first prepare downloads the slices: once, too
                await self.evaluator.prepare(self._session)
                loss = await asyncio.to_thread(self.evaluator.loss, self.initial.model, weights)
        except EvalNotFinite as error:
            logger.error("%s", error)
            return None, str(error)
        except EvalDataError as error:
            logger.warning("no eval loss this round: %s", error)
            return None, f"no eval data: {error}"
        except Exception as error:  # a model that cannot run on the eval inputs must not stop the training
            logger.exception("computing the eval loss failed")
            return None, f"computing the eval loss failed: {type(error).__name__}: {error}"[:500]
        if loss is None:
            return None, "the model gives no loss on the eval inputs (model.input-names must name the labels)"
        return loss, None

    async def _held_out_loss(self, weights: Mapping[str, Any]) -> float | None:
        """The coordinator's loss checks' eval (parameter_server/rounds/validation.py): inf for a loss that is
        not finite (a model made worse than any bound), None when there is none."""
        assert self.evaluator is not None and self.initial is not None
        if self._session is None:
            self._session = aiohttp.ClientSession()
        async with self._eval_lock:
            await self.evaluator.prepare(self._session)
            try:
                return await asyncio.to_thread(self.evaluator.loss, self.initial.model, weights)
            except EvalNotFinite:
                return math.inf

    async def _finish(self, stop_waiter: asyncio.Future[Any]) -> None:
        assert self.app is not None and self.initial is not None and self.coordinator is not None
        files = final_model_files(self.initial.files_dir, self.app.files.weights_path)
        upload = asyncio.ensure_future(
            upload_model(
                server_url=self.settings.server_url,
                job_id=self.job.job_id,
                token=self.settings.current_token(),
                files=files,
                deadline=self.settings.upload_deadline,
            )
        )
        done, _ = await asyncio.wait({upload, stop_waiter}, return_when=asyncio.FIRST_COMPLETED)
        if upload not in done:
            upload.cancel()
            raise Stopped()
        upload.result()  # UploadError propagates: exit 1
        fetched = asyncio.ensure_future(self.coordinator.wait_last_result_fetched(self.settings.final_wait))
        readers = None
        if self.relay is not None:
            readers = asyncio.ensure_future(self.relay.count_readers(self.coordinator.rounds_completed))
            fetched.add_done_callback(lambda _: readers.cancel())
        done, _ = await asyncio.wait({fetched, stop_waiter}, return_when=asyncio.FIRST_COMPLETED)
        if readers is not None:
            readers.cancel()
        if fetched not in done:
            fetched.cancel()
            raise Stopped()
        if not fetched.result():
            logger.warning("not every trainer fetched the last result within %g s", self.settings.final_wait)
        logger.info("job %s done after %d rounds", self.job.job_id, self.coordinator.rounds_completed)

    async def aclose(self) -> None:
        for task in list(self._background):
            task.cancel()
        if self.relay is not None:
            await self.relay.aclose()
        if self._relay_session is not None:
            await self._relay_session.close()
            self._relay_session = None
        if self._runner is not None:
            await stop_http(self._runner)
            self._runner = None
        if self.coordinator is not None:
            await self.coordinator.aclose()
        await self.reporter.aclose()
        if self._session is not None:
            await self._session.close()
            self._session = None


async def run(job: JobConfig, settings: Settings, stop: asyncio.Event) -> int:
    """Start, serve and close one parameter server; 0 when the job is done. Raises ``Stopped`` on ``stop``,
    ``ParameterServerError`` (and ``OSError``) on failures."""
    server = ParameterServer(job, settings)
    try:
        start = asyncio.ensure_future(server.start())
        stop_waiter = asyncio.ensure_future(stop.wait())
        done, _ = await asyncio.wait({start, stop_waiter}, return_when=asyncio.FIRST_COMPLETED)
        stop_waiter.cancel()
        if start not in done:
            # The model is being built in a thread that cannot be interrupted; do not wait for it.
            start.cancel()
            raise Stopped()
        start.result()
        return await server.serve(stop)
    finally:
        await server.aclose()
