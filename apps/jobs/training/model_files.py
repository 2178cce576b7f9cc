"""The final model: files the parameter server uploads, and the archive users download."""

from __future__ import annotations

from pathlib import Path

from django.conf import settings
from django.db import transaction

from apps.jobs.exceptions import TransferRefused
from apps.jobs.models import Job, Task
from apps.jobs.training.dispatch import MODEL_FILES
from apps.jobs.training.storage import MODEL_FILENAME, write_stream
from apps.jobs.training.tokens import server_task
from worker_daemon.protocol import MODEL_EXTRA_FILES

#: Every file the final model may have: what trainers fetch, and the data files the model's directory had.
FINAL_MODEL_FILES = (*MODEL_FILES, *MODEL_EXTRA_FILES)

# --- the final model -------------------------------------------------------------------------------------------


def model_directory(job_id) -> Path:
    return Path(settings.HYPHA_DATA_DIR) / "models" / str(job_id)


def authorise_model_upload(job: Job, token: str | None) -> Task:
    """The parameter-server task whose transfer token ``token`` is; :class:`TransferRefused` otherwise."""
    return server_task(job, token, action="uploads its model")


def store_model_file(job: Job, filename: str, chunks, *, limit: int) -> dict:
    """Write one uploaded model file atomically; returns ``{"size", "sha256"}`` (recorded on the job).

    Only the files the parameter server uploads (:data:`FINAL_MODEL_FILES`: the weights, ``config.json``
    and the model's data files, such as ``generation_config.json`` and the tokenizer's) are taken: any other
    name would be a stranger's file in the archive users download and run (``evil.py``). A 400, nothing
    written, otherwise.
    """
    if not MODEL_FILENAME.match(filename):
        raise TransferRefused(f"{filename!r} is not an allowed model file name", status=400)
    if filename not in FINAL_MODEL_FILES:
        raise TransferRefused(
            f"{filename!r} is not a file of the model: the parameter server uploads only "
            f"{', '.join(FINAL_MODEL_FILES)}",
            status=400,
        )
    directory = model_directory(job.pk)
    entry = write_stream(directory / filename, chunks, limit=limit)
    with transaction.atomic():
        locked = Job.objects.select_for_update().get(pk=job.pk)
        locked.model_files = {**locked.model_files, filename: entry}
        locked.save(update_fields=["model_files", "updated_at"])
    (directory / "model.zip").unlink(missing_ok=True)
    return entry


def model_archive(job: Job) -> Path | None:
    """A zip of the job's stored model files (built once), or ``None`` when no model is stored."""
    import zipfile

    if not job.model_files:
        return None
    directory = model_directory(job.pk)
    archive = directory / "model.zip"
    if not archive.exists():
        partial = directory / ".model.zip.part"
        # Stored, not deflated: safetensors barely compress and the archive is written once per job.
        with zipfile.ZipFile(partial, "w", compression=zipfile.ZIP_STORED) as bundle:
            # Only the model's files, also for a job stored before uploads were limited to them.
            for filename in sorted(set(job.model_files) & set(FINAL_MODEL_FILES)):
                bundle.write(directory / filename, arcname=filename)
        partial.replace(archive)
    return archive
