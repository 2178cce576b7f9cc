"""Checkpoints: the parameter server's last round, kept to restart it elsewhere.

The copy is incremental (docs/training.md, "A parameter server lost"): the weights of the last *base* round
b, the results of the rounds b+1..r since, and round r's momentum and manifest. A server that resumes
replays the results on the base weights and checks the digest round r's manifest gives.

On disk, ``HYPHA_DATA_DIR/checkpoints/<job>/round-<n>/`` holds what round n uploaded: ``weights.safetensors``
(a base round only), ``momentum.safetensors``, ``result.safetensors`` and ``round.json``; once a later round
is saved, a round of the chain keeps only its result (and the base its weights too), and the rounds before
the base are gone. ``Job.checkpoint`` is ``{"round": r, "base": b, "files": {name: {"size", "sha256"}}}``,
under the names a server downloads them by (:func:`checkpoint_file`): ``round.json`` and
``momentum.safetensors`` (round r's), ``weights.safetensors`` (round b's) and ``result-<n>.safetensors``
for each round n of b+1..r, and for r itself. A copy saved before this scheme has no ``base`` (its round
is its own base) and names round r's result ``result.safetensors``.
"""

from __future__ import annotations

import json
import logging
import re
import shutil
from pathlib import Path

from django.conf import settings
from django.db import transaction
from django.utils import timezone

from apps.jobs import observers
from apps.jobs.exceptions import TransferRefused
from apps.jobs.models import Job
from apps.jobs.training.status import locked_round
from apps.jobs.training.storage import write_stream
from apps.jobs.training.tokens import server_task

logger = logging.getLogger(__name__)

# --- checkpoints: the parameter server's last round, kept to restart it elsewhere ---------------------------------

#: The files a round uploads (parameter_server.checkpoints); the manifest completes a copy.
CHECKPOINT_MANIFEST = "round.json"
CHECKPOINT_WEIGHTS = "weights.safetensors"
CHECKPOINT_MOMENTUM = "momentum.safetensors"
CHECKPOINT_RESULT = "result.safetensors"
CHECKPOINT_FILES = (CHECKPOINT_WEIGHTS, CHECKPOINT_MOMENTUM, CHECKPOINT_RESULT, CHECKPOINT_MANIFEST)
#: The name a round's result is downloaded by: ``result-<round>.safetensors``.
CHAIN_RESULT = re.compile(r"^result-(\d{1,9})\.safetensors$")
MAX_MANIFEST_BYTES = 1 << 20


def checkpoint_directory(job_id) -> Path:
    return Path(settings.HYPHA_DATA_DIR) / "checkpoints" / str(job_id)


def chain_result_name(round_number: int) -> str:
    return f"result-{round_number}.safetensors"


def _base_of(checkpoint: dict) -> int:
    """The base round of a saved copy (an older copy, without one, holds its round's full weights)."""
    return checkpoint.get("base", checkpoint.get("round", -1))


def _chain(manifest: dict, round_number: int) -> int:
    """The base round ``manifest`` builds on (``TransferRefused`` 400 unless its chain names exactly the
    rounds after it); a manifest without ``base_round`` is a base round itself."""
    base = manifest.get("base_round", round_number)
    if isinstance(base, bool) or not isinstance(base, int) or not 0 <= base <= round_number:
        raise TransferRefused(f"round.json: base_round must be a round from 0 to {round_number}", status=400)
    links = manifest.get("chain", [])
    rounds = (
        [link.get("round") if isinstance(link, dict) else None for link in links]
        if isinstance(links, list)
        else None
    )
    if rounds != list(range(base + 1, round_number + 1)):
        raise TransferRefused(
            f"round.json: the chain must name rounds {base + 1} to {round_number}", status=400
        )
    return base


def store_checkpoint_file(
    job: Job, round_number: int, filename: str, token: str | None, chunks, *, limit: int
):
    """Store one file of round ``round_number``'s checkpoint, uploaded by the job's live parameter server.

    Files are kept aside until the manifest (``round.json``, sent last) arrives: it must name the round and
    the files it says the round has — the weights only at a base round (``base_round`` the round itself, or
    none). A round that builds on an earlier base must follow the round kept, on the same base (409
    otherwise: the copy could not be replayed). The round then replaces the job's checkpoint in one step,
    and what no later resume needs is deleted. A round older than the one kept is refused (409); the one
    kept again is answered with what is stored (a retry)."""
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
        name = chain_result_name(round_number) if filename == CHECKPOINT_RESULT else filename
        files = job.checkpoint["files"]
        return files.get(name, files.get(filename, {}))
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
    base = _chain(manifest, round_number)
    if base < round_number and not manifest.get("has_result"):
        raise TransferRefused(
            f"round {round_number} builds on round {base}'s weights: its result is needed", status=400
        )
    wanted = [CHECKPOINT_WEIGHTS] if base == round_number else []
    wanted += [CHECKPOINT_MOMENTUM] if manifest.get("has_momentum") else []
    wanted += [CHECKPOINT_RESULT] if manifest.get("has_result") else []
    missing = [name for name in wanted if not (partial / f".{name}.json").is_file()]
    if missing:
        raise TransferRefused(f"round {round_number} is missing {', '.join(missing)}", status=409)
    uploaded = {name: json.loads((partial / f".{name}.json").read_text()) for name in wanted}
    files = {}
    if base < round_number:
        # The copy must be replayable: the rounds before this one on the same base are the ones kept.
        previous = job.checkpoint or {}
        if kept != round_number - 1 or _base_of(previous) != base:
            raise TransferRefused(
                f"round {round_number} builds on round {base}'s weights and the results since, but the "
                f"control plane keeps round {kept} on round {_base_of(previous)}'s weights: upload round "
                f"{round_number} with its weights",
                status=409,
            )
        needed = [CHECKPOINT_WEIGHTS, *(chain_result_name(n) for n in range(base + 1, round_number))]
        absent = [name for name in needed if name not in previous.get("files", {})]
        if absent:
            raise TransferRefused(
                f"the saved copy lacks {', '.join(absent)}: upload round {round_number} with its weights",
                status=409,
            )
        files = {name: previous["files"][name] for name in needed}
    else:
        files[CHECKPOINT_WEIGHTS] = uploaded[CHECKPOINT_WEIGHTS]
    if CHECKPOINT_MOMENTUM in uploaded:
        files[CHECKPOINT_MOMENTUM] = uploaded[CHECKPOINT_MOMENTUM]
    if CHECKPOINT_RESULT in uploaded:
        files[chain_result_name(round_number)] = uploaded[CHECKPOINT_RESULT]
    files[CHECKPOINT_MANIFEST] = entry
    final = directory / f"round-{round_number}"
    shutil.rmtree(final, ignore_errors=True)
    partial.rename(final)
    with transaction.atomic():
        locked = Job.objects.select_for_update().get(pk=job.pk)
        if locked.checkpoint and locked.checkpoint.get("round", -1) >= round_number:
            return entry  # a concurrent upload of the same round won
        locked.checkpoint = {"round": round_number, "base": base, "files": files}
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
                observers.round_recorded(round_)
    _prune(directory, round_number=round_number, base=base)
    logger.info(
        "job %s: round %d checkpoint saved (base round %d; uploaded %s)",
        job.pk,
        round_number,
        base,
        ", ".join(f"{name} {uploaded[name]['size']} bytes" for name in sorted(uploaded)),
    )
    return entry


def _prune(directory: Path, *, round_number: int, base: int) -> None:
    """Delete what a resume from round ``round_number`` on round ``base``'s weights no longer needs: the
    rounds before the base, the momentum and manifests of the rounds before this one, and partial uploads
    of rounds up to this one."""
    for stale in directory.iterdir():
        name = stale.name
        if not name.startswith(("round-", ".partial-round-")):
            continue
        number = name.removeprefix(".partial-").removeprefix("round-").partition("-")[0]
        if not number.isdigit():
            shutil.rmtree(stale, ignore_errors=True)
        elif int(number) > round_number or name == f"round-{round_number}":
            continue
        elif name.startswith(".partial-") or int(number) < base:
            shutil.rmtree(stale, ignore_errors=True)
        else:  # a round of the chain: only its result is replayed (and the base's weights)
            for gone in (CHECKPOINT_MOMENTUM, CHECKPOINT_MANIFEST):
                (stale / gone).unlink(missing_ok=True)
                (stale / f".{gone}.json").unlink(missing_ok=True)


def discard_checkpoint(job_id) -> None:
    """Remove an ended job's saved round (its files; the job keeps the record of what it was)."""
    shutil.rmtree(checkpoint_directory(job_id), ignore_errors=True)


def checkpoint_file(job: Job, filename: str, token: str | None) -> Path:
    """The path of a file of the job's saved copy, by the name ``Job.checkpoint`` gives it, for its live
    parameter server (a restarted one): round r's ``round.json`` and ``momentum.safetensors``, the base
    round's ``weights.safetensors``, round n's ``result-<n>.safetensors``."""
    server_task(job, token, action="fetches checkpoints")
    if not job.checkpoint or filename not in job.checkpoint.get("files", {}):
        raise TransferRefused(f"job {job.pk} has no saved {filename!r}", status=404)
    round_number = job.checkpoint["round"]
    directory = checkpoint_directory(job.pk)
    if filename == CHECKPOINT_WEIGHTS:
        return directory / f"round-{_base_of(job.checkpoint)}" / filename
    chained = CHAIN_RESULT.fullmatch(filename)
    if chained:
        return directory / f"round-{int(chained.group(1))}" / CHECKPOINT_RESULT
    return directory / f"round-{round_number}" / filename
