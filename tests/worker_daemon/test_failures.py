"""A failed task's reason is its root cause, not the launcher's wrapper of it: :func:`worker_daemon.failures.root_cause`
on real output — a real process that nests its failure the way ``accelerate launch`` does, and the real
``accelerate launch`` of a tiny failing script — and the job manager reporting it in ``job_exited``."""

from __future__ import annotations

import asyncio
import logging
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path

import pytest

from worker_daemon import protocol
from worker_daemon.config import ACCELERATE_LAUNCH_OPTIONS, WorkerConfig
from worker_daemon.failures import root_cause
from worker_daemon.jobs import JobManager
from worker_daemon.leases import LeaseBook

#: A child that fails as the built-in trainer does when its bridge cannot reach the parameter server: it logs
#: its own error at ERROR and exits 3.
CHILD = textwrap.dedent(
    """
    import logging, sys
    logging.basicConfig(stream=sys.stdout, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("worker_daemon.executors.training").error(
        "%s: %s",
        "BridgeCallError",
        '/resources/fetch: HTTP 500: {"error":"connector_error","detail":"model file config.json: Cannot '
        "connect to host 10.0.0.3:7070 ssl:default [Connect call failed ('10.0.0.3', 7070)]\\"}",
    )
    sys.exit(3)
    """
)
#: A launcher that runs the child and re-raises its failure, as accelerate's simple_launcher does.
LAUNCHER = textwrap.dedent(
    """
    import subprocess, sys
    process = subprocess.Popen([sys.executable, sys.argv[1]])
    process.wait()
    if process.returncode != 0:
        raise subprocess.CalledProcessError(returncode=process.returncode, cmd=[sys.executable, sys.argv[1]])
    """
)
ROOT = (
    "BridgeCallError: /resources/fetch: connector_error: model file config.json: Cannot connect to host "
    "10.0.0.3:7070 ssl:default [Connect call failed ('10.0.0.3', 7070)]"
)


def output_of(*argv: str) -> tuple[int, list[str]]:
    result = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    return result.returncode, (result.stdout + result.stderr).splitlines()


def test_a_launcher_wrapped_failure_gives_the_childs_own_error(tmp_path):
    child, launcher = tmp_path / "child.py", tmp_path / "launcher.py"
    child.write_text(CHILD)
    launcher.write_text(LAUNCHER)

    # when
    code, lines = output_of(sys.executable, str(launcher), str(child))

    # then: the last line is the launcher's wrapper; the cause is the child's
    assert code == 1
    assert lines[-1].startswith("subprocess.CalledProcessError: Command '[")
    assert root_cause(lines) == ROOT


def test_the_real_accelerate_launch_of_a_failing_script_gives_the_scripts_error(tmp_path):
    pytest.importorskip("accelerate")
    child = tmp_path / "child.py"
    child.write_text(CHILD)

    # when
    code, lines = output_of(
        sys.executable, "-m", "accelerate.commands.launch", *ACCELERATE_LAUNCH_OPTIONS, "--cpu", str(child)
    )

    # then
    assert code == 1
    assert any(line.startswith("subprocess.CalledProcessError") for line in lines), lines
    assert root_cause(lines) == ROOT
    # and with every value passed, the launcher warns of none (issue 16, item 8)
    assert not [line for line in lines if "were not passed to `accelerate launch`" in line], lines


def test_the_accelerate_launch_options_leave_accelerate_nothing_to_warn_about(caplog):
    """accelerate's own check of a launch command, on the options a ``process`` executor under the launcher
    uses: it warns about every value left to a default (issue 16, item 8)."""
    pytest.importorskip("accelerate")
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser

    def warnings_of(*options: str) -> list[str]:
        caplog.clear()
        arguments = launch_command_parser().parse_args(
            [*options, "--cpu", "-m", "worker_daemon.executors.training"]
        )
        with caplog.at_level(logging.WARNING):
            _validate_launch_command(arguments)
        return [
            record.getMessage() for record in caplog.records if "accelerate launch" in record.getMessage()
        ]

    # the check warns about a bare launch (the capture sees it)
    assert warnings_of("--num_processes", "1")
    # and about nothing with the options, CPU threads included
    assert warnings_of(*ACCELERATE_LAUNCH_OPTIONS) == []


def test_an_uncaught_exception_chain_gives_the_innermost_exception(tmp_path):
    script = tmp_path / "chain.py"
    script.write_text(
        textwrap.dedent(
            """
            print("loading the model")
            try:
                raise ConnectionRefusedError(111, "Connect call failed ('10.0.0.3', 7070)")
            except OSError as error:
                raise RuntimeError("model file config.json: cannot download") from error
            """
        )
    )

    # when
    code, lines = output_of(sys.executable, str(script))

    # then
    assert code == 1
    assert lines[-1] == "RuntimeError: model file config.json: cannot download"
    assert root_cause(lines) == "ConnectionRefusedError: [Errno 111] Connect call failed ('10.0.0.3', 7070)"


def test_the_latest_failure_wins_and_a_logged_exception_gives_its_exception_line():
    lines = [
        "2026-03-01 10:00:00,000 ERROR parameter_server: round 1: an update was refused",
        "training goes on",
        "2026-03-01 10:05:00,000 ERROR worker_daemon.executors.training: the trainer failed unexpectedly",
        "Traceback (most recent call last):",
        '  File "training.py", line 626, in main',
        "    return training_function(arguments, job)",
        "           ^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^",
        "KeyError: 'labels'",
    ]
    assert root_cause(lines) == "KeyError: 'labels'"
    assert root_cause(lines[:2]) == "round 1: an update was refused"


def test_two_tracebacks_that_are_not_chained_give_the_later_one():
    lines = [
        "Traceback (most recent call last):",
        '  File "a.py", line 1, in <module>',
        "ValueError: first",
        "Traceback (most recent call last):",
        '  File "b.py", line 1, in <module>',
        "TypeError: second",
    ]
    assert root_cause(lines) == "TypeError: second"


@pytest.mark.parametrize(
    "lines",
    [
        [],
        ["step 1 loss 2.0", "step 2 loss 1.9"],
        [
            "Traceback (most recent call last):",
            '  File "x", line 1',
            "subprocess.CalledProcessError: Command 'x'",
        ],
    ],
    ids=["no output", "no failure", "only the wrapper"],
)
def test_output_without_a_failure_gives_nothing(lines):
    assert root_cause(lines) == ""


def test_a_long_cause_is_cut(tmp_path: Path):
    assert len(root_cause(["Traceback (most recent call last):", "ValueError: " + "x" * 2000])) == 500


async def test_the_job_manager_reports_the_childs_failure_not_the_launchers(short_dir, link, answerer):
    child, launcher = short_dir / "child.py", short_dir / "launcher.py"
    child.write_text(CHILD)
    launcher.write_text(LAUNCHER)
    config = WorkerConfig.model_validate(
        {
            "work_dir": str(short_dir / "w"),
            "resources": {"cpu": 8, "memory": 32, "storage": 100, "gpu": 0},
            "executors": [
                {
                    "class": "train",
                    "name": "wrapped",
                    "runtime": "process",
                    "cmd": sys.executable,
                    "args": [str(launcher), str(child)],
                }
            ],
        }
    )
    lease, job = uuid.UUID(int=7), uuid.UUID(int=42)
    book = LeaseBook(capacity=config.capacity)
    book.activate(
        lease_id=lease, job_id=job, role="trainer", resources=protocol.Resources(), price=1.0, ttl=60.0
    )
    manager = JobManager(config=config, book=book, server_url="wss://cp.example", link=link)
    spec = {
        "job_id": str(job),
        "executor": {"class": "train", "descriptor": {"name": "wrapped"}, "config": {}},
    }
    try:
        # when
        task = manager.start(
            protocol.DispatchJob(task_id=uuid.uuid4(), lease_id=lease, job_id=job, role="trainer", spec=spec)
        )
        exited = await asyncio.wait_for(task.runner, 30)
    finally:
        await manager.stop_all(timeout=5.0)

    # then
    assert (exited.exit_code, exited.cancelled, exited.reason) == (1, False, ROOT)
    assert exited.log_tail.splitlines()[-1].startswith("subprocess.CalledProcessError")


#: A trainer that runs out of CUDA memory, as PyTorch 2.x says it (raised on CPU: the exception is the same).
OOM_CHILD = textwrap.dedent(
    """
    import torch
    raise torch.OutOfMemoryError(
        "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 1 has a total capacity of 79.15 GiB of which "
        "1.02 GiB is free. Including non-PyTorch memory, this process has 78.12 GiB memory in use. Of the "
        "allocated memory 76.50 GiB is allocated by PyTorch, and 1.10 GiB is reserved by PyTorch but "
        "unallocated. If reserved but unallocated memory is large try setting "
        "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation."
    )
    """
)


def test_a_cuda_out_of_memory_error_under_a_launcher_gives_the_device_and_the_allocation(tmp_path):
    pytest.importorskip("torch")
    child, launcher = tmp_path / "child.py", tmp_path / "launcher.py"
    child.write_text(OOM_CHILD)
    launcher.write_text(LAUNCHER)

    # when
    code, lines = output_of(sys.executable, str(launcher), str(child))

    # then
    assert code == 1
    assert any(line.startswith("torch.OutOfMemoryError: CUDA out of memory.") for line in lines)
    assert root_cause(lines) == (
        "CUDA out of memory on device 1 (tried to allocate 2.00 GiB; total capacity 79.15 GiB, 1.02 GiB free)"
    )


def test_an_older_pytorchs_out_of_memory_message_and_a_logged_one_are_put_the_same_way():
    old = [
        "Traceback (most recent call last):",
        '  File "train.py", line 3, in <module>',
        "torch.cuda.OutOfMemoryError: CUDA out of memory. Tried to allocate 20.00 MiB (GPU 0; 15.90 GiB total "
        "capacity; 14.50 GiB already allocated; 3.75 MiB free; 14.60 GiB reserved in total by PyTorch)",
    ]
    logged = ["2026-01-01 00:00:00 ERROR worker_daemon.executors.training: CUDA out of memory."]

    assert (
        root_cause(old)
        == "CUDA out of memory on device 0 (tried to allocate 20.00 MiB; total capacity 15.90 GiB)"
    )
    assert root_cause(logged) == "CUDA out of memory"
