"""Writing uploaded streams to disk, and the file-name rule of uploaded files."""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

from apps.jobs.exceptions import TransferRefused

MODEL_FILENAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._-]{0,99}$")


def write_stream(path: Path, chunks, *, limit: int) -> dict:
    """Write ``chunks`` to ``path`` atomically (a partial file never appears there); ``{"size", "sha256"}``.
    :class:`TransferRefused` (413) past ``limit`` bytes, leaving nothing behind."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.part")
    digest = hashlib.sha256()
    size = 0
    try:
        with partial.open("wb") as handle:
            for chunk in chunks:
                size += len(chunk)
                if size > limit:
                    raise TransferRefused(f"the file exceeds {limit} bytes", status=413)
                digest.update(chunk)
                handle.write(chunk)
        partial.replace(path)
    finally:
        partial.unlink(missing_ok=True)
    return {"size": size, "sha256": digest.hexdigest()}
