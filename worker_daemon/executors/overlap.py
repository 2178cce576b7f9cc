"""Eager updates: a trainer overlaps round r's communication with round r+1's steps (docs/training.md,
"Overlap: eager updates"; Kale, Douillard, Donchev, arXiv 2502.12996).

For a job whose trainer JSON carries ``"overlap": {"mode": "eager", "outer_learning_rate": lr,
"outer_momentum": μ}``. Notation as in docs/training.md: θ_{r−1} the global weights after round r−1 (the
trainer's ``global_previous``, digest-checked), u_{r−1} = θ_{r−1} − θ_{r−2} the last result it merged (absent —
zero — in its first round and after a fetch of the full weights). Trainer i:

a. ends round r's inner steps with θ_i^r and sends Q(Δ_i^r + e), Δ_i^r = θ_i^r − θ_{r−1}, exactly as a trainer
   that does not overlap (``training.send_update``: encoding and error feedback unchanged);
b. loads the proxy p_r = θ_{r−1} + û_i^r, û_i^r = μ²·u_{r−1} + lr·(1 + μ)·Δ_i^r (:func:`proxy_weights`: the
   parameter server's Nesterov step if the round's mean were its own delta and m_{r−1} ≈ u_{r−1}/lr) into the
   live model, in place (AdamW's state is kept), and starts round r+1's steps at once, while a background
   thread (:class:`PendingResult`) reads round r's result exactly as ``training.receive_result`` does for
   the others: merged into θ_r and digest-checked, or the full global weights θ_k (k ≥ r) fetched instead;
c. when that is done, between two steps, on the main thread: θ_live ← θ_live + (θ_r − p_r)
   (:func:`correct`: the others' contribution and the proxy's error), keeps u_r = θ_r − θ_{r−1}
   (:func:`applied_update`) and θ_r, and sends ``"update-received"``; ``Done`` ends the job at once (the
   partial round is dropped);
d. at the end of round r+1's steps, if round r's result is not merged yet, waits for it and merges (c) before
   sending round r+1's update (``Δ_i^{r+1} = θ_live − θ_r``): round r+1's ``"update"`` never precedes round
   r's ``"update-received"``.

Floating-point buffers (BatchNorm's running statistics: the parameter server averages them, never steps them)
get û = Δ_i, the mean taken as its own value. Every state dict here is tied like ``global_previous``
(:mod:`~worker_daemon.executors.pseudo_gradient`'s contracts): computed once per group of tied names, and the
live model corrected once per group.

Memory: besides what a trainer that waits holds (the model, AdamW's state, θ_{r−1}, the error-feedback residual,
and while they are made or merged the delta and θ_r), u_{r−1} and p_r: two float32 copies of the model, on the
CPU.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Collection, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from worker_daemon.executors.pseudo_gradient import StateDict, float_state, load_into, tied_groups

if TYPE_CHECKING:
    from accelerate import Accelerator

    from hypha_tensors.encoding import ErrorFeedback
    from worker_daemon.executors.bridge_client import BridgeClient, ReceiveStream
    from worker_daemon.executors.consistency import Merged, Published
    from worker_daemon.executors.job import TrainConfig

logger = logging.getLogger("worker_daemon.executors.training")

#: An experiment knob (``bench/diloco_quality.py --overlaps eager-local``), like ``HYPHA_SLOWDOWN``: ``local``
#: makes the proxy the trainer's own weights, p_r = θ_{r−1} + Δ_i^r (û = Δ: "train on from where it is"),
#: instead of the rule above (``nesterov``, the default).
PROXY_ENV = "HYPHA_EAGER_PROXY"
PROXIES = ("nesterov", "local")


def proxy_kind(environ: Mapping[str, str] | None = None) -> str:
    """The proxy :data:`PROXY_ENV` asks for (``nesterov`` when unset or unknown)."""
    value = (os.environ if environ is None else environ).get(PROXY_ENV, "nesterov").strip().lower()
    return value if value in PROXIES else "nesterov"


# --- the update arithmetic (pure, tested against a written-out reference) ------------------------------------


def proxy_weights(
    global_previous: Mapping[str, torch.Tensor],
    delta: Mapping[str, torch.Tensor],
    last_update: Mapping[str, torch.Tensor] | None,
    *,
    learning_rate: float,
    momentum: float,
    buffers: Collection[str] = (),
) -> StateDict:
    """p_r = θ_{r−1} + û, û = μ²·u_{r−1} + lr·(1 + μ)·Δ (``last_update`` None: u_{r−1} = 0, û = lr·(1 + μ)·Δ);
    for the names in ``buffers`` û = Δ. New CPU tensors in the global weights' dtypes, tied like
    ``global_previous``; ``delta`` and ``last_update`` must name its groups (any name of a group will do)."""
    carried = momentum * momentum
    scale = learning_rate * (1.0 + momentum)
    proxy: StateDict = {}
    for group in tied_groups(global_previous):
        previous = global_previous[group[0]]
        own = _member(delta, group, "delta").to("cpu", previous.dtype)
        if any(name in buffers for name in group):
            step = own
        elif last_update is None:
            step = scale * own
        else:
            step = (
                carried * _member(last_update, group, "last update").to("cpu", previous.dtype) + scale * own
            )
        value = previous + step
        for name in group:
            proxy[name] = value
    return proxy


def applied_update(
    merged: Mapping[str, torch.Tensor], global_previous: Mapping[str, torch.Tensor]
) -> StateDict:
    """u_r = θ_r − θ_{r−1}, the step the trainer just merged (the next proxy's u_{r−1}), tied like
    ``global_previous``."""
    update: StateDict = {}
    for group in tied_groups(global_previous):
        value = _member(merged, group, "merged weights") - global_previous[group[0]]
        for name in group:
            update[name] = value
    return update


@torch.no_grad()
def correct(
    model: torch.nn.Module, proxy: Mapping[str, torch.Tensor], merged: Mapping[str, torch.Tensor]
) -> None:
    """θ_live ← θ_live + (θ_r − p_r), in place on the model's floating-point entries, once per group of tied
    names (tied parameters share one storage: adding per name would add twice). ``proxy`` and ``merged`` must
    name the model's entries; every difference is computed before the model is touched."""
    from worker_daemon.executors.exceptions import UpdateError

    live = float_state(model)
    missing = sorted(set(live) - set(proxy)) or sorted(set(live) - set(merged))
    if missing:
        raise UpdateError(f"the correction has no tensor {missing[0]!r}")
    corrections = []
    for group in tied_groups(live):
        target = live[group[0]]
        for value in (merged[group[0]], proxy[group[0]]):
            if value.shape != target.shape:
                raise UpdateError(
                    f"the correction of {group[0]!r} has shape {tuple(value.shape)}, expected "
                    f"{tuple(target.shape)}"
                )
        corrections.append((target, merged[group[0]] - proxy[group[0]]))
    for target, difference in corrections:
        target.add_(difference.to(target.device, target.dtype))


def _member(state: Mapping[str, torch.Tensor], group: list[str], what: str) -> torch.Tensor:
    from worker_daemon.executors.exceptions import UpdateError

    for name in group:
        if name in state:
            return state[name]
    raise UpdateError(f"the {what} has no tensor {group[0]!r}")


def float_buffers(model: torch.nn.Module) -> frozenset[str]:
    """The names of the model's floating-point buffers in its state dict (the parameter server averages
    them instead of stepping them)."""
    state = model.state_dict()
    return frozenset(
        name for name, buffer in model.named_buffers() if name in state and buffer.dtype.is_floating_point
    )


# --- round r's result, read while round r+1 trains ------------------------------------------------------------


class PendingResult:
    """Round ``round_number``'s result read in a background thread by ``receive`` (which returns
    ``training.receive_result``'s pair); :meth:`done` says whether it has finished, :meth:`wait` returns the
    pair or raises what ``receive`` raised (``UpdateError``, ``BridgeCallError``: the job cannot go on).
    A streaming trainer (:mod:`~worker_daemon.executors.streaming`) uses it too, without a proxy."""

    def __init__(
        self,
        *,
        round_number: int,
        proxy: StateDict | None = None,
        receive: Callable[[], tuple[Merged, Published | None]],
    ) -> None:
        self.round_number = round_number
        #: p_r, the weights the model was set to when round r+1 started (None: the model was not changed).
        self.proxy = proxy
        self._receive = receive
        self._outcome: tuple[Merged, Published | None] | None = None
        self._error: BaseException | None = None
        self._finished = threading.Event()
        # A daemon thread: a SIGTERM (SystemExit in the main thread) must not wait for a result.
        self._thread = threading.Thread(target=self._run, name=f"round {round_number} result", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            self._outcome = self._receive()
        except BaseException as error:  # handed to the main thread, which raises it
            self._error = error
        finally:
            self._finished.set()

    def done(self) -> bool:
        return self._finished.is_set()

    def wait(self) -> tuple[Merged, Published | None]:
        self._finished.wait()
        if self._error is not None:
            raise self._error
        assert self._outcome is not None
        return self._outcome


class JobFinished(Exception):  # noqa: N818 — a signal, not an error
    """The reply to ``"update-received"`` was ``Done``: the job is over after ``rounds`` rounds."""

    def __init__(self, rounds: int) -> None:
        super().__init__(rounds)
        self.rounds = rounds


# --- the overlapped loop, shared by eager and streaming trainers ----------------------------------------------


class OverlappedRounds:
    """What eager and streaming trainers share: the round in progress, the pending result read in the
    background, :meth:`poll` between steps, the merge's bookkeeping and :meth:`train`'s loop. Subclasses say
    how a round ends (:meth:`finish_round`) and how a merged result enters the live model (:meth:`apply`).
    ``global_previous`` is θ of the last merged round; ``round_number`` the round being trained (renumbered
    after a fetch of the full weights)."""

    def __init__(
        self,
        *,
        client: BridgeClient,
        side_client: BridgeClient,
        results: ReceiveStream,
        model: torch.nn.Module,
        config: TrainConfig,
        work_dir: Path,
        global_previous: StateDict,
        published_dtypes: dict[str, torch.dtype],
        feedback: ErrorFeedback | None,
        round_number: int,
    ) -> None:
        self.client = client
        #: Used only by the background thread (a refetch): the bridge client is not thread-safe.
        self.side_client = side_client
        self.results = results
        self.model = model
        self.config = config
        self.work_dir = work_dir
        self.global_previous = global_previous
        self.published_dtypes = published_dtypes
        self.feedback = feedback
        self.round_number = round_number
        self.pending: PendingResult | None = None
        self._polls = 0

    def poll(self) -> None:
        """Between two steps: merge the pending result if it has come (raises :class:`JobFinished`)."""
        self._polls += 1
        if self.pending is not None and self.pending.done():
            self.merge(steps=self._polls - 1, waited=0.0)

    def finish_round(self, stats: Any) -> None:
        raise NotImplementedError

    def announce(self) -> None:
        """Log the job's overlap once, before its first step."""

    def apply(self, pending: PendingResult, merged: Merged) -> str:
        """Bring the merged result into the live model (before θ_r replaces ``global_previous``); returns how,
        for the merge's log line ("" for nothing to add)."""
        raise NotImplementedError

    def _wait_for_previous(self, stats: Any) -> float:
        """At a round's end: the previous round's result merged (waited for if need be); returns the
        ``perf_counter`` of the round's end."""
        ended = time.perf_counter()
        if self.pending is not None:
            self.pending.wait()
            self.merge(steps=stats.steps, waited=time.perf_counter() - ended)
        return ended

    def _receiver(
        self, round_number: int, fragment: frozenset[str] | None = None
    ) -> Callable[[], tuple[Merged, Published | None]]:
        from worker_daemon.executors.training import receive_result

        global_previous, dtypes = self.global_previous, dict(self.published_dtypes)

        def receive() -> tuple[Merged, Published | None]:
            return receive_result(
                client=self.side_client,
                results=self.results,
                config=self.config,
                work_dir=self.work_dir,
                round_number=round_number,
                global_previous=global_previous,
                published_dtypes=dtypes,
                fragment=fragment,
            )

        return receive

    def merge(self, *, steps: int, waited: float) -> None:
        """Take the pending result into the live model (:meth:`apply`), keep θ_r, send ``"update-received"``."""
        pending = self.pending
        assert pending is not None
        merged, publication = pending.wait()
        self.pending = None
        how = self.apply(pending, merged)
        del pending
        self.global_previous = merged.weights
        if publication is not None:
            self.published_dtypes.clear()
            self.published_dtypes.update(publication.dtypes)
        # After the full weights were fetched the round in progress is the one after theirs.
        self.round_number = merged.rounds_completed + 1
        reply = self.client.status("update-received")
        logger.info(
            "round %d merged after %d steps of round %d%s%s%s",
            merged.rounds_completed,
            steps,
            self.round_number,
            f" (waited {waited:.2f} s)" if waited > 0 else "",
            f", {how}" if how else "",
            "" if merged.digest is None else f", weights {merged.digest} (checked)",
        )
        if reply["type"] == "Done":
            raise JobFinished(merged.rounds_completed)

    def train(
        self,
        *,
        accelerator: Accelerator,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        lr_schedule: Any | None,
        batches: Iterator[dict[str, torch.Tensor]],
        slowdown: float,
        job_id: str | None,
    ) -> int:
        """Run the job to its end: rounds of steps (merging the previous round's result between two of them),
        each ended by :meth:`finish_round`; 0 when the scheduler said ``Done``."""
        from worker_daemon.executors.training import EXIT_OK, run_round

        self.announce()
        try:
            while True:
                stats = run_round(
                    accelerator=accelerator,
                    client=self.client,
                    model=model,
                    optimizer=optimizer,
                    lr_schedule=lr_schedule,
                    batches=batches,
                    input_names=self.config.model.input_names,
                    round_number=lambda: self.round_number,
                    slowdown=slowdown,
                    between_steps=self.poll,
                    max_grad_norm=self.config.training.max_grad_norm,
                )
                self.finish_round(stats)
        except JobFinished as finished:
            logger.info("job %s: done after %d rounds", job_id, finished.rounds)
            return EXIT_OK


# --- the eager loop ---------------------------------------------------------------------------------------------


class EagerRounds(OverlappedRounds):
    """The outer steps of an eager trainer (the module docstring's a–d): :meth:`poll` between steps,
    :meth:`finish_round` at the end of each round's steps."""

    def __init__(self, **state: Any) -> None:
        super().__init__(**state)
        overlap = self.config.overlap
        assert overlap is not None and overlap.eager
        assert overlap.outer_learning_rate is not None and overlap.outer_momentum is not None
        self.learning_rate = overlap.outer_learning_rate
        self.momentum = overlap.outer_momentum
        self.buffers = float_buffers(self.model)
        self.proxy_rule = proxy_kind()
        #: u_{r−1}: None in the first round and after a fetch of the full weights.
        self.last_update: StateDict | None = None

    def announce(self) -> None:
        if self.proxy_rule == "local":
            logger.warning(
                "eager updates with the local weights as the proxy (%s=local: an experiment)", PROXY_ENV
            )
        else:
            logger.info(
                "eager updates: outer lr %g, momentum %g (the proxy of each round's step)",
                self.learning_rate,
                self.momentum,
            )

    def finish_round(self, stats: Any) -> None:
        """After a round's steps: merge the previous round's result (waiting for it if need be), then send
        this round's update and start the next round from the proxy."""
        from worker_daemon.executors.training import send_update

        ended = self._wait_for_previous(stats)
        delta = send_update(
            client=self.client,
            model=self.model,
            global_previous=self.global_previous,
            config=self.config,
            work_dir=self.work_dir,
            round_number=self.round_number,
            stats=stats,
            feedback=self.feedback,
        )
        if self.proxy_rule == "local":
            proxy = proxy_weights(self.global_previous, delta, None, learning_rate=1.0, momentum=0.0)
        else:
            proxy = proxy_weights(
                self.global_previous,
                delta,
                self.last_update,
                learning_rate=self.learning_rate,
                momentum=self.momentum,
                buffers=self.buffers,
            )
        del delta
        load_into(self.model, proxy)
        sent = self.round_number
        self.pending = PendingResult(round_number=sent, proxy=proxy, receive=self._receiver(sent))
        self.round_number = sent + 1
        self._polls = 0
        # "sent in": from the end of the steps (a wait for the previous result and its merge included) to the
        # start of the next round (bench/wan.py reads it).
        logger.info(
            "round %d: %d steps, loss %.4f, %d samples, %.1f samples/s, sent in %.2f s; "
            "round %d starts from the proxy (eager)",
            sent,
            stats.steps,
            stats.mean_loss,
            stats.samples,
            stats.samples_per_second,
            time.perf_counter() - ended,
            self.round_number,
        )

    def apply(self, pending: PendingResult, merged: Merged) -> str:
        """(c): correct the live model by θ_r − p_r, keep u_r."""
        assert pending.proxy is not None
        correct(self.model, pending.proxy, merged.weights)
        # p_r and u_{r−1} go before u_r is made: two model copies more than a trainer that waits, not three.
        pending.proxy = None
        self.last_update = None
        if merged.refetched_because is None:
            self.last_update = applied_update(merged.weights, self.global_previous)
        return ""
