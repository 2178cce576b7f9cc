"""An owner's discard of a round (docs/training.md, "Discarding a round"): the request is recorded on the
round, and the parameter server hears it in its next ``Expect`` reply (``"discard": n``,
:func:`pending_discard`); round n + 1 then closes by going back to round n − 1's weights and momentum, and
its report says so. A request the parameter server did not hear before round n + 1 closed lapses: round n
is no longer the last closed round, and that round's report says it was not discarded."""

from __future__ import annotations

from django.db import transaction
from django.db.models import Max
from django.utils import timezone

from apps.jobs.exceptions import RoundNotDiscardable, SpecError
from apps.jobs.models import Job, Round
from apps.jobs.spec.base import OVERLAP_NONE
from apps.jobs.training.plans import plan
from hypha_tensors.formats import FLOAT32

#: How the parameter server's report of round n + 1 begins its ``discarded`` when it took an owner's discard.
OWNER_DISCARD = "the owner discarded round "


def request_discard(job: Job, number: int, *, by: str) -> Round:
    """Record that ``by`` discards round ``number`` of ``job``. ``Round.DoesNotExist`` if the job has no
    closed round ``number``; :class:`RoundNotDiscardable` (why) unless the job is running, the round is its
    last closed one, not its last round, not discarded or asked to be already, and the job's rounds can go
    back exactly (no overlap, the float32 encoding)."""
    with transaction.atomic():
        job = Job.objects.select_for_update().get(pk=job.pk)
        round_ = Round.objects.select_for_update().get(job=job, number=number, closed=True)
        if job.status != Job.Status.RUNNING:
            raise RoundNotDiscardable(f"the job is {job.status}, not running")
        last = Round.objects.filter(job=job, closed=True).aggregate(last=Max("number"))["last"]
        if number != last:
            raise RoundNotDiscardable(f"round {number} is not the job's last closed round (round {last} is)")
        try:
            rounds = plan(job).spec.rounds
        except SpecError:  # a job from before DiLoCo specs: its rounds are not the parameter server's
            raise RoundNotDiscardable("the job has no DiLoCo specification") from None
        if number >= rounds.update_rounds:
            raise RoundNotDiscardable(f"round {number} is the job's last round: no round follows to go back")
        if rounds.overlap != OVERLAP_NONE:
            raise RoundNotDiscardable(
                f"rounds.overlap is {rounds.overlap}: trainers train on while a round's result is out, so "
                "going back would not take them back"
            )
        if rounds.encoding != FLOAT32:
            raise RoundNotDiscardable(
                f"rounds.encoding is {rounds.encoding}: the way back cannot be sent exactly (float32 only)"
            )
        if round_.discarded:
            raise RoundNotDiscardable(f"round {number} is discarded already: {round_.discard_reason}")
        if round_.discard_requested_at is not None:
            raise RoundNotDiscardable(f"round {number}'s discard was requested already")
        round_.discard_requested_at = timezone.now()
        round_.save(update_fields=["discard_requested_at"])
        job.transition(
            Job.Status.RUNNING,
            reason=f"RUNNING: round {number} discarded by {by}: round {number + 1} goes back to the weights "
            f"and momentum of round {number - 1}",
        )
    return round_


def pending_discard(job: Job, round_number: int) -> int | None:
    """What the ``Expect`` reply for open round ``round_number`` says to discard: round ``round_number − 1``
    when its owner asked and it is still the job's last closed round, else None."""
    last = (
        Round.objects.filter(job=job, closed=True)
        .order_by("-number")
        .values_list("number", "discard_requested_at")
        .first()
    )
    if last is None or last[0] != round_number - 1 or last[1] is None:
        return None
    return last[0]
