"""Each task's full output, kept on the control plane: size-capped and rotated.

Daemons send a running task's output lines in ``task_log`` frames (and its last lines in ``job_exited``);
:func:`append` adds them to ``HYPHA_DATA_DIR/logs/<job>/<task>.log``. The cap (``HYPHA_TASK_LOG_MAX_BYTES``)
holds whatever a worker sends: when the file would pass half of it, it becomes ``<task>.log.1`` (the one before
is dropped) and a new file starts, so the two hold at most the cap and always the newest output. What was
dropped is counted in ``<task>.log.dropped`` and :func:`read` says so in its first line.

:func:`sweep` (the ``task-log-sweep`` clock) deletes the logs of jobs that ended more than
``HYPHA_TASK_LOG_RETENTION_DAYS`` ago (0 keeps them for ever) and directories no job owns, so that a control
plane that runs for months does not fill its disk; :func:`deleted_note` is what the log says then.
"""

from __future__ import annotations

import fcntl
import logging
import shutil
import uuid
from collections.abc import Iterable
from contextlib import contextmanager
from datetime import datetime, timedelta
from pathlib import Path

from django.conf import settings
from django.utils import timezone

logger = logging.getLogger(__name__)

#: The first line of a log whose head was dropped (``{dropped}``: bytes, ``{cap}``: the setting).
DROPPED_NOTE = (
    "[hypha: the first {dropped} bytes of this log were dropped (HYPHA_TASK_LOG_MAX_BYTES = {cap})]\n"
)


def log_directory(job_id) -> Path:
    return Path(settings.HYPHA_DATA_DIR) / "logs" / str(job_id)


def _paths(job_id, task_id) -> tuple[Path, Path, Path]:
    """(current file, previous file, dropped-bytes counter) of a task's log."""
    current = log_directory(job_id) / f"{task_id}.log"
    return current, current.with_name(f"{current.name}.1"), current.with_name(f"{current.name}.dropped")


@contextmanager
def _locked(job_id):
    """One writer at a time per job (two frames of a task may be handled by two processes)."""
    directory = log_directory(job_id)
    directory.mkdir(parents=True, exist_ok=True, mode=0o700)
    with (directory / ".lock").open("a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return 0


def _dropped(counter: Path) -> int:
    try:
        return int(counter.read_text() or 0)
    except (FileNotFoundError, ValueError):
        return 0


def encode(lines: Iterable[str]) -> bytes:
    """Lines as the file holds them: UTF-8 (what cannot be encoded, e.g. a lone surrogate, becomes ``?``),
    one per line."""
    return "".join(f"{line}\n" for line in lines).encode("utf-8", errors="replace")


def append(job_id, task_id, lines: Iterable[str]) -> None:
    """Add ``lines`` to the task's log, dropping its oldest output past the cap."""
    data = encode(lines)
    if not data:
        return
    half = max(settings.HYPHA_TASK_LOG_MAX_BYTES // 2, 1)
    current, previous, counter = _paths(job_id, task_id)
    with _locked(job_id):
        dropped = 0
        size = _size(current)
        if size + len(data) > half:
            dropped += _size(previous)
            if size:
                current.replace(previous)
            else:
                previous.unlink(missing_ok=True)
            if len(data) > half:
                # More than half the cap at once: only its newest half-cap is kept, from a line's start if
                # one begins there.
                cut = len(data) - half
                newline = data.find(b"\n", cut - 1, len(data) - 1)
                cut = newline + 1 if newline >= 0 else cut
                dropped += cut
                data = data[cut:]
        with current.open("ab") as handle:
            handle.write(data)
        if dropped:
            counter.write_text(str(_dropped(counter) + dropped))


def has_log(job_id, task_id) -> bool:
    current, previous, _ = _paths(job_id, task_id)
    return current.exists() or previous.exists()


def read(job_id, task_id) -> str | None:
    """The task's kept log (with a first line saying how much was dropped, if any); ``None`` if it has none."""
    current, previous, counter = _paths(job_id, task_id)
    if not has_log(job_id, task_id):
        return None
    with _locked(job_id):
        parts = []
        for path in (previous, current):
            try:
                parts.append(path.read_bytes())
            except FileNotFoundError:
                pass
        dropped = _dropped(counter)
    if not parts:
        return None
    text = b"".join(parts).decode("utf-8", errors="replace")
    if dropped:
        text = DROPPED_NOTE.format(dropped=dropped, cap=settings.HYPHA_TASK_LOG_MAX_BYTES) + text
    return text


def _retention() -> timedelta | None:
    days = settings.HYPHA_TASK_LOG_RETENTION_DAYS
    return timedelta(days=days) if days else None


def sweep(now: datetime | None = None) -> int:
    """Delete the log directories of jobs that ended more than the retention ago, and those of no job;
    returns how many went. Nothing when the retention is 0."""
    from apps.jobs.models import Job

    retention = _retention()
    root = Path(settings.HYPHA_DATA_DIR) / "logs"
    if retention is None or not root.is_dir():
        return 0
    directories = {}
    for path in root.iterdir():
        try:
            directories[uuid.UUID(path.name)] = path
        except ValueError:
            continue  # not ours
    if not directories:
        return 0
    cutoff = (now or timezone.now()) - retention
    known = dict(Job.objects.filter(pk__in=list(directories)).values_list("pk", "ended_at"))
    gone = [
        path
        for job_id, path in directories.items()
        if job_id not in known or (known[job_id] is not None and known[job_id] <= cutoff)
    ]
    for path in gone:
        shutil.rmtree(path, ignore_errors=True)
    if gone:
        logger.info("deleted the task logs of %d job(s) (retention %s)", len(gone), retention)
    return len(gone)


def deleted_note(ended_at: datetime | None, now: datetime | None = None) -> str | None:
    """What a log deleted by :func:`sweep` reads as (``None`` while the job's logs are kept)."""
    retention = _retention()
    if retention is None or ended_at is None or ended_at > (now or timezone.now()) - retention:
        return None
    return (
        f"[hypha: this log was deleted {retention.days} days after its job ended "
        f"(HYPHA_TASK_LOG_RETENTION_DAYS = {settings.HYPHA_TASK_LOG_RETENTION_DAYS:g})]\n"
    )
