"""One trainer, several processes (issue 17): not implemented yet, so a trainer started as several processes
refuses the job, on every rank, without hanging (docs/training.md, "One trainer, one process")."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

from .conftest import REPOSITORY, executor_environment, train_job

#: Generous: two interpreters import torch and accelerate on a loaded 2-core machine.
PROCESS_TIMEOUT = 120.0


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_a_trainer_started_as_two_processes_refuses_the_job_on_both_ranks(tmp_path: Path) -> None:
    # given: two ranks of one gloo process group, as ``accelerate launch --num_processes 2 --cpu`` starts them
    port = free_port()
    job = json.dumps(train_job(), separators=(",", ":"))
    processes = []
    for rank in (0, 1):
        environment = executor_environment()
        environment.update(
            {
                "RANK": str(rank),
                "LOCAL_RANK": str(rank),
                "WORLD_SIZE": "2",
                "LOCAL_WORLD_SIZE": "2",
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port),
                "ACCELERATE_USE_CPU": "true",
            }
        )
        command = [
            sys.executable,
            "-m",
            "worker_daemon.executors.training",
            "--socket",
            str(tmp_path / "no-bridge.sock"),  # the refusal comes before any bridge call
            "--work-dir",
            str(tmp_path),
            "--job",
            job,
        ]
        processes.append(
            subprocess.Popen(
                command,
                cwd=str(REPOSITORY),
                env=environment,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                start_new_session=True,
            )
        )

    # when
    outputs = []
    try:
        for process in processes:
            outputs.append(process.communicate(timeout=PROCESS_TIMEOUT)[0])
    finally:
        for process in processes:
            process.kill()
            process.wait()

    # then: both exit 4 (the job is unusable here) with a reason, neither waits for the other
    for process, output in zip(processes, outputs, strict=True):
        assert process.returncode == 4, output
        assert "run one process per job (--num_processes 1), not 2" in output
        assert "multi-process trainers are not implemented yet" in output
