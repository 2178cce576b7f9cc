"""One trainer, several processes (docs/training.md, "One trainer, several processes"): the launcher that starts
the ranks and the few collective calls the ranks make besides DDP's.

A trainer whose job sets ``training.processes`` to N > 1 (0: one per CUDA device the lease shows) runs as N
processes of one ``torch.distributed`` process group: gloo on a CPU, nccl on CUDA with rank r on ``cuda:r``
(the lease's r-th device: the daemon shows a task only its lease's devices). The model is wrapped in DDP by
``accelerator.prepare``, so the ranks' weights stay identical; every step each rank trains an equal share of
the job's batch (``batch_size / N``; DDP averages the gradients, so one step equals one step over the whole
batch).

Rank 0 is the only one that talks to the bridge: it fetches the model, the data slices, sends the statuses, the
pseudo-gradient and the metrics, and merges the parameter server's result. What the other ranks need it hands
them with :meth:`Ranks.lead`: the model's directory, each step's batch, the scheduler's decision (stop or go
on), the round's end and the merged global weights (:meth:`Ranks.copy_weights`).

No rank hangs when a peer dies or stalls: every collective has the process group's timeout (the job's
``training.process_timeout``), and while rank 0 waits on the bridge (a slice not assigned yet, a round's
result that waits for the slowest trainer) it keeps its peers waiting with heartbeats every quarter of it,
so a long wait is not mistaken for a dead peer and a dead rank 0 is noticed within the timeout.

Launch: ``python -m worker_daemon.executors.training …`` started without ``WORLD_SIZE`` for a job that asks for
N > 1 processes becomes the launcher (:func:`launch`): it starts the N ranks as children in its own process group
(the daemon signals the whole group on cancel), waits, and exits with rank 0's exit code (or, when rank 0 ended
well, the first failing rank's); when one rank fails the others are given the timeout to end by themselves,
then killed. A trainer started by another launcher (``accelerate launch --num_processes N``, ``torchrun``:
``WORLD_SIZE``, ``RANK``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT`` set) runs as that rank directly.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from datetime import timedelta
from typing import TYPE_CHECKING, Any, TypeVar

from worker_daemon.executors.exceptions import ExecutorError, JobConfigError

if TYPE_CHECKING:
    import torch

logger = logging.getLogger("worker_daemon.executors.training")

T = TypeVar("T")

#: The environment of a rank, as torchrun and ``accelerate launch`` set it.
RANK_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
#: Set by :func:`launch` for its children: the rank knows it has a supervising launcher.
LAUNCHER_VARIABLE = "HYPHA_TRAINER_LAUNCHER"


class PeerError(ExecutorError):
    """Another rank of this trainer failed or stopped answering: this one cannot go on (exit 1)."""

    exit_code = 1


def world_size(environ: dict[str, str] | None = None) -> int:
    """The number of ranks this process belongs to (``WORLD_SIZE``; 1 when unset or not a number)."""
    value = (os.environ if environ is None else environ).get("WORLD_SIZE", "1")
    try:
        return max(1, int(value))
    except ValueError:
        return 1


def processes_wanted(setting: int) -> int:
    """The processes a trainer with ``training.processes = setting`` runs as: ``setting``, or for 0 one per
    visible CUDA device (the lease's), 1 without CUDA."""
    if setting != 0:
        return setting
    import torch

    return max(1, torch.cuda.device_count()) if torch.cuda.is_available() else 1


# --- the launcher -----------------------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _die_with_parent() -> None:
    """In a rank between fork and exec: SIGTERM when the launcher dies (a launcher killed outright would
    otherwise leave its ranks waiting for the timeout). Linux only."""
    if sys.platform != "linux":
        return
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG


def launch(argv: list[str], *, processes: int, timeout: float) -> int:
    """Run ``python -m worker_daemon.executors.training *argv`` as ``processes`` ranks (see the module
    docstring) and return the trainer's exit code."""
    port = _free_port()
    children: list[subprocess.Popen[bytes]] = []
    for rank in range(processes):
        environment = dict(os.environ)
        environment.update(
            {
                "RANK": str(rank),
                "LOCAL_RANK": str(rank),
                "WORLD_SIZE": str(processes),
                "LOCAL_WORLD_SIZE": str(processes),
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port),
                LAUNCHER_VARIABLE: str(os.getpid()),
            }
        )
        command = [sys.executable, "-m", "worker_daemon.executors.training", *argv]
        # Same process group as the launcher: the daemon's signal to the group reaches every rank.
        children.append(subprocess.Popen(command, env=environment, preexec_fn=_die_with_parent))
    logger.info("trainer of %d processes: ranks are pids %s", processes, [child.pid for child in children])
    try:
        return _supervise(children, grace=timeout)
    finally:
        for child in children:
            if child.poll() is None:
                child.kill()
            child.wait()


def _supervise(children: list[subprocess.Popen[bytes]], *, grace: float) -> int:
    """Wait for the ranks; after the first failure give the rest ``grace`` seconds (+ a few) to end, then
    terminate them. Rank 0's code wins when it failed (it knows why: the bridge, the data, the job)."""
    failed_at: float | None = None
    first_failure: int | None = None
    while True:
        codes = [child.poll() for child in children]
        for code in codes:
            if code not in (None, 0) and first_failure is None:
                first_failure, failed_at = code, time.monotonic()
                logger.warning("a rank of this trainer exited with %s; waiting for the others", code)
        if all(code is not None for code in codes):
            break
        if failed_at is not None and time.monotonic() - failed_at > grace + 5.0:
            logger.warning("ranks still running %.0f s after a failure: terminating them", grace + 5.0)
            for child in children:
                if child.poll() is None:
                    child.terminate()
            deadline = time.monotonic() + 5.0
            while time.monotonic() < deadline and any(child.poll() is None for child in children):
                time.sleep(0.05)
            break
        time.sleep(0.05)
    root = children[0].poll()
    if root not in (None, 0) and root > 0:
        return root
    if first_failure is None:
        return 0 if root == 0 else 1
    return first_failure if first_failure > 0 else 1


# --- the ranks ------------------------------------------------------------------------------------------------


class Ranks:
    """This process's place in its trainer's process group, and the calls rank 0 makes to lead the others.

    Every method is a collective: all ranks call it, in the same order."""

    def __init__(self, *, timeout: float, environ: dict[str, str] | None = None) -> None:
        environ = dict(os.environ if environ is None else environ)
        self.rank = int(environ.get("RANK", "0"))
        self.local_rank = int(environ.get("LOCAL_RANK", str(self.rank)))
        self.world_size = world_size(environ)
        self.timeout = timeout
        #: How often rank 0 tells the others it is still there while it waits on the bridge.
        self.heartbeat = max(0.5, timeout / 4.0)
        self.cuda = False

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def initialise(self) -> None:
        """Join the process group: nccl with this rank on ``cuda:LOCAL_RANK`` when CUDA is there, gloo else."""
        import torch
        import torch.distributed as distributed

        self.cuda = torch.cuda.is_available()
        if self.cuda:
            visible = torch.cuda.device_count()
            if self.local_rank >= visible:
                raise JobConfigError(
                    f"rank {self.rank} needs CUDA device {self.local_rank}, and this trainer sees {visible}: "
                    "the lease must hold one device a process"
                )
            torch.cuda.set_device(self.local_rank)
        backend = "nccl" if self.cuda else "gloo"
        options: dict[str, Any] = {}
        if self.cuda:
            options["device_id"] = torch.device("cuda", self.local_rank)
        distributed.init_process_group(
            backend=backend,
            init_method="env://",
            rank=self.rank,
            world_size=self.world_size,
            timeout=timedelta(seconds=self.timeout),
            **options,
        )
        logger.info(
            "rank %d of %d joined the process group (%s, timeout %g s)",
            self.rank,
            self.world_size,
            backend,
            self.timeout,
        )

    def close(self, *, finished: bool) -> None:
        """Leave the process group: after a barrier when every rank ``finished`` the job (gloo aborts a
        process that tears its group down while a peer still uses it); a rank that failed leaves it as is."""
        import torch.distributed as distributed

        if not finished:
            return
        with contextlib.suppress(RuntimeError, ValueError):
            distributed.barrier()
        if distributed.is_initialized():
            distributed.destroy_process_group()

    def _broadcast(self, value: Any) -> Any:
        import torch.distributed as distributed

        holder = [value]
        try:
            distributed.broadcast_object_list(holder, src=0)
        except (RuntimeError, ValueError) as error:  # gloo and nccl report a lost or silent peer so
            raise PeerError(f"rank {self.rank}: a peer of this trainer is gone ({error})") from error
        return holder[0]

    def lead(self, work: Callable[[], T]) -> T:
        """Rank 0 runs ``work`` (its bridge calls) and every rank returns its value (which must pickle);
        the others wait for it, however long it takes, as long as rank 0 is alive. When ``work`` raises, rank
        0 raises it and the others raise :class:`PeerError`."""
        if not self.is_main:
            while True:
                kind, value = self._broadcast(None)
                if kind == "value":
                    return value
                if kind == "failed":
                    raise PeerError(f"rank 0 of this trainer failed: {value}")
        future: Future[T] = Future()

        def run() -> None:
            try:
                future.set_result(work())
            except BaseException as error:  # handed to the caller, on the main thread
                future.set_exception(error)

        # A daemon thread: a rank 0 that must end (a peer is gone) does not wait for a bridge call to return.
        threading.Thread(target=run, name="rank-0-bridge", daemon=True).start()
        while True:
            try:
                value = future.result(timeout=self.heartbeat)
            except FutureTimeout:
                self._broadcast(("waiting", None))
                continue
            except Exception as error:
                # Tell the others first, so that they end now rather than at the timeout.
                self._broadcast(("failed", f"{type(error).__name__}: {error}"))
                raise
            self._broadcast(("value", value))
            return value

    def mean(self, tensor: torch.Tensor) -> torch.Tensor:
        """The mean of ``tensor`` over the ranks (a new tensor)."""
        import torch.distributed as distributed

        total = tensor.detach().clone()
        try:
            distributed.all_reduce(total, op=distributed.ReduceOp.SUM)
        except (RuntimeError, ValueError) as error:
            raise PeerError(f"rank {self.rank}: a peer of this trainer is gone ({error})") from error
        return total / self.world_size

    def share(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """This rank's share of a batch: the ``rank``-th of ``world_size`` equal parts along dimension 0."""
        size = int(next(iter(batch.values())).shape[0])
        if size % self.world_size:
            raise JobConfigError(
                f"a batch of {size} samples does not split between {self.world_size} processes"
            )
        part = size // self.world_size
        return {name: tensor[self.rank * part : (self.rank + 1) * part] for name, tensor in batch.items()}

    def copy_weights(self, model: torch.nn.Module) -> None:
        """Rank 0's parameters and buffers into every rank's ``model``, in place (after a round's merge)."""
        import torch.distributed as distributed

        tensors = [*model.parameters(), *model.buffers()]  # each shared tensor once
        try:
            for tensor in tensors:
                distributed.broadcast(tensor.data, src=0)
        except (RuntimeError, ValueError) as error:
            raise PeerError(f"rank {self.rank}: a peer of this trainer is gone ({error})") from error
