"""``python -m worker_daemon.warm``: a spare interpreter that does a built-in executor's imports ahead of time,
waits for a task, and then becomes that task's executor.

Most of a task's start-up is the CPU its interpreter spends importing torch, transformers and accelerate
(docs/benchmarks.md, "Utilisation"). A daemon with ``warm_start`` on (:mod:`worker_daemon.spares`) keeps one
such process while it is idle and hands it the next task of a built-in runtime (``trainer``: the built-in
trainer, ``parameter-server``). The process is started the way the job manager starts a task (its own
session, killed with its daemon, stdin/stdout/stderr pipes to the daemon), so once it has become the executor
it is supervised exactly as a cold one: same pid, process group, signals, output and exit code.

The protocol, between the daemon and this process:

1. ``python -m worker_daemon.warm --ready-fd N --runtime trainer [--runtime parameter-server]``: ``N`` is
   the write end of a pipe to the daemon.
2. With its stdout and stderr redirected to an unlinked temporary file (nothing reaches the daemon before it
   is a task), it imports :data:`WARM_IMPORTS` of each runtime and then builds a tiny GPT-2 from a config
   (:func:`exercise`: transformers' lazy imports), with torch's RNG state put back afterwards. Nothing of it
   initialises CUDA (checked on an H200 by asking the driver, ``cuDeviceGetCount``: a forward or backward
   pass would, so none is run), so ``CUDA_VISIBLE_DEVICES`` given with the task still applies.
3. It writes one JSON line on fd ``N`` and closes it: ``{"seconds": …, "failed": "…" | null, "notes": […]}``.
   ``failed`` names an import that failed: the daemon then retires it and starts its tasks cold (and so does
   this process, should a task reach it first: it ``exec``s the task's command). ``notes`` are what went
   wrong in the exercise, which is only a speed-up.
4. It reads one JSON line on stdin, the task: ``{"argv": [python, "-m", module, *args], "env": {…},
   "cwd": "…"}``. End of file (the daemon retires it, or shuts down): it exits 0.
5. It becomes the task: stdin from ``/dev/null`` (as a cold task's), stdout and stderr back on the daemon's
   pipes (what the imports printed first, on stderr), the environment replaced by ``env``, the working
   directory ``cwd``, and ``module`` run as ``__main__`` with ``sys.argv`` set, as ``python -m module args``
   would. Only :data:`RUNNABLE` modules are run in place; any other command is ``exec``'d.

Environment variables that libraries read at import time (``OMP_NUM_THREADS``, ``HF_HOME``, …) come from the
daemon's environment when the spare started; the daemon hands a spare out only while its own environment is
still the same (a task's variables are its own: ``SOCKET_PATH``, ``JOB_JSON``, tokens…, read at run time).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import runpy
import sys
import tempfile
import time
from collections.abc import Iterable
from typing import Any, BinaryIO

#: What each built-in runtime imports, heaviest first. The model modules are the demo's GPT-2: a
#: ``from_pretrained`` spends most of its first 2–3 s importing ``modeling_gpt2`` (27 ms the second time).
#: Not the executors' own modules (``worker_daemon.executors.training``, ``parameter_server.__main__``):
#: they are run as ``__main__``, as ``python -m`` runs them, and import their heavy modules lazily anyway.
WARM_IMPORTS: dict[str, tuple[str, ...]] = {
    "trainer": (
        "torch",
        "torch.utils.data",
        "transformers",
        "transformers.models.auto.modeling_auto",
        "transformers.models.gpt2.configuration_gpt2",
        "transformers.models.gpt2.modeling_gpt2",
        "accelerate",
        "safetensors.torch",
        "httpx",
        "hypha_tensors.encoding",
        "hypha_tensors.formats",
        "hypha_tensors.weights",
        "worker_daemon.executors.job",
        "worker_daemon.executors.bridge_client",
        "worker_daemon.executors.consistency",
        "worker_daemon.executors.data",
        "worker_daemon.executors.pseudo_gradient",
        "worker_daemon.executors.exceptions",
        "worker_daemon.executors.setup",
        "worker_daemon.executors.rounds",
    ),
    "parameter-server": (
        "torch",
        "transformers",
        "transformers.models.auto.modeling_auto",
        "transformers.models.gpt2.configuration_gpt2",
        "transformers.models.gpt2.modeling_gpt2",
        "aiohttp",
        "safetensors.torch",
        "parameter_server.service",
        "parameter_server.job",
        "worker_daemon.telemetry",
        "worker_daemon.redaction",
    ),
}

#: The modules a spare runs in place (``python -m <module> …``): the built-in executors.
RUNNABLE = frozenset({"worker_daemon.executors.training", "parameter_server"})

#: What the tiny model of :func:`exercise` is (transformers' GPT-2 config keys): small enough to cost
#: milliseconds once imported.
EXERCISE_MODEL = {
    "vocab_size": 16,
    "n_positions": 8,
    "n_embd": 8,
    "n_layer": 1,
    "n_head": 2,
    "bos_token_id": 0,
    "eos_token_id": 0,
}


def warm_up(runtimes: Iterable[str]) -> tuple[str | None, list[str]]:
    """Import what ``runtimes`` need and exercise it; (the first import that failed or None, notes)."""
    modules: list[str] = []
    for runtime in runtimes:
        modules += [module for module in WARM_IMPORTS[runtime] if module not in modules]
    for module in modules:
        try:
            importlib.import_module(module)
        except Exception as error:  # any failure means: run the task cold
            return f"import {module}: {type(error).__name__}: {error}", []
    notes: list[str] = []
    try:
        exercise()
    except Exception as error:  # only a speed-up: the task meets a real problem itself
        notes.append(f"exercise: {type(error).__name__}: {error}")
    return None, notes


def exercise() -> None:
    """Build a tiny GPT-2 from a config on the CPU, with torch's RNG state put back afterwards: this loads what
    transformers imports lazily when it first builds a model (its attention and loss registries, generation
    config, weight init), which the executor would otherwise do on the clock. Not a forward or backward pass:
    on a GPU host either initialises the CUDA driver (seen on an H200 with torch 2.11: the autograd engine
    and the attention path ask for the device count), after which a task's ``CUDA_VISIBLE_DEVICES`` would no
    longer apply. ``fork_rng(devices=[])`` leaves the CUDA generators alone."""
    import torch
    import transformers

    with torch.random.fork_rng(devices=[]):
        config = transformers.AutoConfig.for_model("gpt2", **EXERCISE_MODEL)
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        torch.optim.AdamW(model.parameters(), lr=1e-3)  # its construction only: a step would touch CUDA
        model.state_dict()


class Captured:
    """The process's stdout and stderr (the file descriptors 1 and 2) sent to an unlinked temporary file until
    :meth:`release` puts them back and writes what was captured to stderr."""

    def __init__(self) -> None:
        self.file: BinaryIO = tempfile.TemporaryFile()  # noqa: SIM115 - closed by release()
        self.saved = (os.dup(1), os.dup(2))  # not inheritable (Python's default): no executor gets them
        self._flush()
        os.dup2(self.file.fileno(), 1)
        os.dup2(self.file.fileno(), 2)

    @staticmethod
    def _flush() -> None:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()

    def release(self) -> None:
        self._flush()
        for target, saved in zip((1, 2), self.saved, strict=True):
            os.dup2(saved, target)
            os.close(saved)
        self.file.seek(0)
        output = self.file.read()
        self.file.close()
        while output:
            output = output[os.write(2, output) :]


def read_task(stream: BinaryIO) -> dict[str, Any] | None:
    """The task line on ``stream``, or None at end of file. Raises ValueError for anything else."""
    line = stream.readline()
    if not line:
        return None
    task = json.loads(line)
    argv, environment, cwd = task.get("argv"), task.get("env"), task.get("cwd")
    if (
        not isinstance(argv, list)
        or not argv
        or not all(isinstance(part, str) for part in argv)
        or not isinstance(environment, dict)
        or not all(isinstance(key, str) and isinstance(value, str) for key, value in environment.items())
        or not isinstance(cwd, str)
    ):
        raise ValueError("a task is {argv: [str, …], env: {str: str}, cwd: str}")
    return task


def become(task: dict[str, Any], *, cold: bool) -> None:
    """Turn this process into the task's executor: returns only by raising SystemExit (the executor's exit)
    or an executor's uncaught exception, which the interpreter prints and exits 1 on, as a cold one would."""
    argv: list[str] = task["argv"]
    environment: dict[str, str] = task["env"]
    os.chdir(task["cwd"])
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    runnable = len(argv) >= 3 and argv[0] == sys.executable and argv[1] == "-m" and argv[2] in RUNNABLE
    if cold or not runnable:
        os.execve(argv[0], argv, environment)
    os.environ.clear()
    os.environ.update(environment)
    # `python -m` puts the working directory first on the path.
    sys.path[0] = os.getcwd()
    sys.argv = [argv[0], *argv[3:]]  # run_module replaces argv[0] with the module's file
    runpy.run_module(argv[2], run_name="__main__", alter_sys=True)


def parse_arguments(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m worker_daemon.warm",
        description="A worker daemon's warm spare: imports a built-in executor's modules, then runs the task "
        "it reads on stdin (started by the daemon, not by hand).",
    )
    parser.add_argument("--ready-fd", type=int, required=True, help="file descriptor to report readiness on")
    parser.add_argument(
        "--runtime", action="append", choices=sorted(WARM_IMPORTS), required=True, help="runtime to warm for"
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    arguments = parse_arguments(argv)
    began = time.monotonic()
    captured = Captured()
    failed, notes = warm_up(arguments.runtime)
    report = {"seconds": round(time.monotonic() - began, 3), "failed": failed, "notes": notes}
    with contextlib.suppress(OSError):  # a daemon that stopped listening: the task line (or EOF) decides
        os.write(arguments.ready_fd, (json.dumps(report) + "\n").encode())
    with contextlib.suppress(OSError):
        os.close(arguments.ready_fd)
    try:
        task = read_task(sys.stdin.buffer)
    except ValueError as error:
        captured.release()
        print(f"worker_daemon.warm: bad task line: {error}", file=sys.stderr)
        return 2
    if task is None:
        return 0  # retired
    captured.release()
    become(task, cold=failed is not None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
