"""Checkpoints: the parameter server's last round, kept to restart it elsewhere."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

from django.conf import settings
from django.db import transaction
from django.utils import timezone

from apps.jobs.exceptions import TransferRefused
from apps.jobs.models import Job
from apps.jobs.training.status import locked_round
from apps.jobs.training.storage import write_stream
from apps.jobs.training.tokens import server_task

logger = logging.getLogger(__name__)

# --- checkpoints: the parameter server's last round, kept to restart it elsewhere ---------------------------------

#: The files of a saved round (parameter_server.checkpoints); the manifest completes a copy.
CHECKPOINT_MANIFEST = "round.json"
CHECKPOINT_FILES = ("weights.safetensors", "momentum.safetensors", "result.safetensors", CHECKPOINT_MANIFEST)
MAX_MANIFEST_BYTES = 1 << 20


def checkpoint_directory(job_id) -> Path:
    return Path(settings.HYPHA_DATA_DIR) / "checkpoints" / str(job_id)


def store_checkpoint_file(
    job: Job, round_number: int, filename: str, token: str | None, chunks, *, limit: int
):
    """Store one file of round ``round_number``'s checkpoint, uploaded by the job's live parameter server.

    Files are kept aside until the manifest (``round.json``, sent last) arrives: it must name the round and
    the files it says the round has; the round then replaces the job's checkpoint in one step. A round older
    than the one kept is refused (409); the one kept again is answered with what is stored (a retry)."""
    task = server_task(job, token, action="saves checkpoints")
    if filename not in CHECKPOINT_FILES:
        raise TransferRefused(
            f"{filename!r} is not a checkpoint file (one of {', '.join(CHECKPOINT_FILES)})", status=400
        )
    kept = job.checkpoint.get("round", -1) if job.checkpoint else -1
    if round_number < kept:
        raise TransferRefused(f"round {round_number} is older than the saved round {kept}", status=409)
    if round_number == kept:
        for _ in chunks:  # drain the body: the client is still sending it
            pass
        return job.checkpoint["files"].get(filename, {})
    directory = checkpoint_directory(job.pk)
    partial = directory / f".partial-round-{round_number}-{task.pk}"
    if filename != CHECKPOINT_MANIFEST:
        entry = write_stream(partial / filename, chunks, limit=limit)
        (partial / f".{filename}.json").write_text(json.dumps(entry))
        return entry
    entry = write_stream(partial / filename, chunks, limit=MAX_MANIFEST_BYTES)
    try:
        manifest = json.loads((partial / filename).read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError):
        manifest = None
    if not isinstance(manifest, dict) or manifest.get("round_number") != round_number:
        raise TransferRefused(f"round.json does not describe round {round_number}", status=400)
    wanted = ["weights.safetensors"]
    wanted += ["momentum.safetensors"] if manifest.get("has_momentum") else []
    wanted += ["result.safetensors"] if manifest.get("has_result") else []
    missing = [name for name in wanted if not (partial / f".{name}.json").is_file()]
    if missing:
        raise TransferRefused(f"round {round_number} is missing {', '.join(missing)}", status=409)
    files = {name: json.loads((partial / f".{name}.json").read_text()) for name in wanted}
    files[CHECKPOINT_MANIFEST] = entry
    final = directory / f"round-{round_number}"
    shutil.rmtree(final, ignore_errors=True)
    partial.rename(final)
    with transaction.atomic():
        locked = Job.objects.select_for_update().get(pk=job.pk)
        if locked.checkpoint and locked.checkpoint.get("round", -1) >= round_number:
            return entry  # a concurrent upload of the same round won
        locked.checkpoint = {"round": round_number, "files": files}
        locked.save(update_fields=["checkpoint", "updated_at"])
        job.checkpoint = locked.checkpoint
        if round_number >= 1:
            # The round is applied once it is saved: its report follows with the details, unless the server
            # dies first — a server that resumes starts after it and never reports it.
            round_ = locked_round(locked, round_number)
            if not round_.closed:
                participants = manifest.get("participants")
                round_.closed, round_.closed_at = True, timezone.now()
                if isinstance(participants, list):
                    round_.participants = [str(peer)[:64] for peer in participants[:1024]]
                round_.save()
    for stale in directory.iterdir():
        if stale != final and (stale.name.startswith("round-") or stale.name.startswith(".partial-round-")):
            number = stale.name.removeprefix(".partial-").removeprefix("round-").partition("-")[0]
            if not number.isdigit() or int(number) <= round_number:
                shutil.rmtree(stale, ignore_errors=True)
    logger.info("job %s: round %d checkpoint saved (%s)", job.pk, round_number, ", ".join(sorted(files)))
    return entry


def discard_checkpoint(job_id) -> None:
    """Remove an ended job's saved round (its files; the job keeps the record of what it was)."""
    shutil.rmtree(checkpoint_directory(job_id), ignore_errors=True)


def checkpoint_file(job: Job, filename: str, token: str | None) -> Path:
    """The path of a file of the job's saved round, for its live parameter server (a restarted one)."""
    server_task(job, token, action="fetches checkpoints")
    if not job.checkpoint or filename not in job.checkpoint.get("files", {}):
        raise TransferRefused(f"job {job.pk} has no saved {filename!r}", status=404)
    return checkpoint_directory(job.pk) / f"round-{job.checkpoint['round']}" / filename
