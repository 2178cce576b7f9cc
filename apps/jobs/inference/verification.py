"""Verification of inference results, Golem's pattern (docs/inference.md, "Verification").

A spec'd fraction of the slices — chosen from the job's id and the slice's index, so the choice is the same on
every read and no worker can tell ahead which of its slices are checked by anything it sees — is computed by
two different workers. Their files are compared on the control plane: JSON Lines results must be equal row
for row, safetensors results must hold the same tensors, equal within the spec's tolerance. Two that agree
are ACCEPTED and the slice is USED; two that disagree are DISPUTED and the slice goes to a third worker: the
result it agrees with is ACCEPTED, the other REJECTED and counted against its worker's record. Each result is
settled once, under the job's lock, so nothing is counted twice.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy
from django.conf import settings
from django.db.models import Count

from apps.jobs.models import InferenceResult, Job
from apps.jobs.spec.inference import VerificationSpec

Status = InferenceResult.Status


def is_verified(job_id, index: int, fraction: float) -> bool:
    """Whether slice ``index`` of job ``job_id`` is computed twice: a hash of both, as a number in [0, 1),
    below ``fraction``."""
    if fraction <= 0:
        return False
    if fraction >= 1:
        return True
    digest = hashlib.sha256(f"{job_id}:{index}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < fraction


def _path(result: InferenceResult) -> Path:
    return Path(settings.HYPHA_DATA_DIR) / result.path


def _jsonl(path: Path) -> list | None:
    try:
        return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    except (OSError, ValueError):
        return None


def _tensors(path: Path) -> dict | None:
    from safetensors.numpy import load

    try:
        return load(path.read_bytes())
    except Exception:  # a malformed upload agrees with nothing
        return None


def agree(first: InferenceResult, second: InferenceResult, tolerance: float) -> bool:
    """Whether two computations of the same slice agree: the same bytes; or equal JSON Lines rows; or the same
    tensor names, shapes and dtypes with every value within ``tolerance`` (``allclose``, NaN equal to NaN)."""
    if first.sha256 == second.sha256:
        return True
    if first.format != second.format:
        return False
    if first.format == InferenceResult.Format.JSONL:
        rows = _jsonl(_path(first))
        return rows is not None and rows == _jsonl(_path(second))
    one, other = _tensors(_path(first)), _tensors(_path(second))
    if one is None or other is None or one.keys() != other.keys():
        return False
    for name, value in one.items():
        theirs = other[name]
        if value.shape != theirs.shape or value.dtype != theirs.dtype:
            return False
        if value.dtype.kind in "fc":
            if not numpy.allclose(value, theirs, rtol=tolerance, atol=tolerance, equal_nan=True):
                return False
        elif not numpy.array_equal(value, theirs):
            return False
    return True


def settle(job: Job, new: InferenceResult, spec: VerificationSpec) -> list[InferenceResult]:
    """Compare a verified slice's new computation with the earlier ones and set their statuses (the caller
    holds the job's lock). Returns the results REJECTED now (their workers lost); the slice is settled when
    ``new`` is ACCEPTED afterwards.

    * the first computation stays PENDING;
    * one that agrees with an earlier PENDING or DISPUTED result: both ACCEPTED, every other DISPUTED one
      REJECTED (a second agreeing pair cannot exist: the slice was settled by the first);
    * one that agrees with none: it and every earlier one DISPUTED (another worker computes the slice)."""
    earlier = list(
        InferenceResult.objects.select_for_update()
        .filter(job=job, index=new.index, status__in=(Status.PENDING, Status.DISPUTED))
        .exclude(pk=new.pk)
        .order_by("created_at", "pk")
    )
    if not earlier:
        _set([new], Status.PENDING)
        return []
    match = next((result for result in earlier if agree(result, new, spec.tolerance)), None)
    if match is None:
        _set([new, *earlier], Status.DISPUTED)
        return []
    losers = [result for result in earlier if result.pk != match.pk]
    _set([match, new], Status.ACCEPTED)
    _set(losers, Status.REJECTED)
    return losers


def _set(results: list[InferenceResult], status: str) -> None:
    for result in results:
        result.status = status
    InferenceResult.objects.filter(pk__in=[result.pk for result in results]).update(status=status)


def counts(job: Job) -> dict:
    """How many slices were verified (settled by two agreeing computations) and how many are in dispute now,
    and the results rejected: the job's progress shows them."""
    results = InferenceResult.objects.filter(job=job)
    accepted = results.filter(status=Status.ACCEPTED).values("index").distinct().count()
    single = (
        results.filter(status=Status.ACCEPTED).values("index").annotate(n=Count("pk")).filter(n=1).count()
    )
    return {
        "verified": accepted - single,
        "disputed": results.filter(status=Status.DISPUTED).values("index").distinct().count(),
        "rejected": results.filter(status=Status.REJECTED).count(),
    }
