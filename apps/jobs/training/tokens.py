"""Transfer keys and tokens of a job's tasks, and the check of a parameter server's token."""

from __future__ import annotations

import hashlib
import hmac
import time
from dataclasses import dataclass
from typing import Any

from django.conf import settings

from apps.jobs.exceptions import TransferRefused
from apps.jobs.models import PARAMETER_SERVER, Job, Task
from apps.leases.models import Lease
from worker_daemon import protocol


def transfer_key(job_id) -> str:
    """The job's transfer key: signs its tokens; the job's parameter server gets it to verify them."""
    return hmac.new(settings.SECRET_KEY.encode(), f"transfer:{job_id}".encode(), hashlib.sha256).hexdigest()


def transfer_token_lifetime() -> float:
    """``HYPHA_TRANSFER_TOKEN_LIFETIME``, but at least two lease TTLs: a token must outlive the renewal that
    brings the next one."""
    return max(settings.HYPHA_TRANSFER_TOKEN_LIFETIME, 2 * settings.HYPHA_LEASE_TTL)


def transfer_token(lease: Lease) -> str:
    """A token for the task on ``lease``: its job, its worker (``peer``), the lease, the role, and an expiry."""
    return protocol.sign_transfer_token(
        transfer_key(lease.job_id),
        {
            "job": str(lease.job_id),
            "peer": str(lease.worker_id),
            "lease": str(lease.pk),
            "role": lease.role,
            "exp": int(time.time() + transfer_token_lifetime()),
        },
    )


@dataclass(frozen=True)
class FreshToken:
    lease_id: Any
    token: protocol.TransferToken


def fresh_tokens(leases: list[Lease]) -> list[FreshToken]:
    """A new transfer token for each live task bound to one of ``leases`` (sent with their renewal)."""
    if not leases:
        return []
    tasks = Task.objects.filter(lease__in=leases, status__in=Task.LIVE).select_related("lease")
    return [
        FreshToken(
            lease_id=task.lease_id,
            token=protocol.TransferToken(task_id=task.pk, transfer_token=transfer_token(task.lease)),
        )
        for task in tasks
    ]


def token_task(job: Job, token: str | None, *, role: str, refused: str) -> Task:
    """The ``role`` task of ``job`` whose transfer token ``token`` is; :class:`TransferRefused` otherwise (401
    for a missing or bad token, 403 with ``refused`` for a token of another role or of no task of the job)."""
    if not token:
        raise TransferRefused("a transfer token is required (Authorization: Bearer …)", status=401)
    try:
        claims = protocol.verify_transfer_token(transfer_key(job.pk), token, job_id=str(job.pk))
    except protocol.TransferTokenError as error:
        raise TransferRefused(str(error), status=401) from None
    task = (
        Task.objects.select_related("lease").filter(job=job, role=role, lease_id=claims.get("lease")).first()
    )
    if claims.get("role") != role or task is None:
        raise TransferRefused(refused)
    return task


def server_task(job: Job, token: str | None, *, action: str) -> Task:
    """The live parameter-server task of ``job`` whose transfer token ``token`` is; :class:`TransferRefused`
    (401 for a missing or bad token, 403 for another role or an ended server, 409 once the job ended)."""
    task = token_task(job, token, role=PARAMETER_SERVER, refused=f"only the job's parameter server {action}")
    if job.status != Job.Status.RUNNING:
        raise TransferRefused(f"job {job.pk} is {job.status}", status=409)
    if not task.is_live:
        raise TransferRefused(f"this parameter server's task is {task.status}; it {action} no more")
    return task
