"""Path rules of the bridge: Hypha's two checks, plus a containment check that follows symlinks.

Hypha refuses absolute paths and ``..`` components and then joins under the work dir. We also resolve the
joined path (following symlinks, including those of parents that exist while the tail does not) and refuse
it unless it stays inside the resolved work dir, so a symlink planted by the executor cannot make the
bridge write or read elsewhere. A symlink swapped in after the check (a race with the executor itself) is
not covered; the executor runs as the same user, so it could write there directly anyway.
"""

from __future__ import annotations

import os
from pathlib import Path, PurePosixPath

from worker_daemon.bridge.exceptions import PathRejected

FILE_MODE = 0o600


def resolve_in(base: Path, relative: str) -> Path:
    """``base / relative`` as an absolute path, or :class:`PathRejected` if it breaks the rules.

    ``relative`` must be non-empty, relative, free of ``..`` components and NUL bytes, and must resolve
    (symlinks followed) to ``base`` itself or below it.
    """
    if not relative or "\x00" in relative:
        raise PathRejected(f"invalid path {relative!r}")
    pure = PurePosixPath(relative)
    if pure.is_absolute() or relative.startswith(("/", "\\")):
        raise PathRejected(f"absolute path not allowed: {relative!r}")
    if ".." in pure.parts:
        raise PathRejected(f"'..' not allowed in path: {relative!r}")
    root = base.resolve()
    candidate = (root / pure).resolve(strict=False)
    if not candidate.is_relative_to(root):
        raise PathRejected(f"path leaves the work dir: {relative!r}")
    return candidate


def relative_posix(path: Path, *, base: Path) -> str:
    """``path`` relative to ``base``, with forward slashes (as paths appear in responses)."""
    return path.relative_to(base.resolve()).as_posix()


def restrict_file(path: Path) -> None:
    """Make a file the bridge reports ``0600`` (``path`` comes from :func:`resolve_in`, so it is already
    symlink-free); a no-op for a file that vanished meanwhile."""
    try:
        os.chmod(path, FILE_MODE)
    except FileNotFoundError:
        pass
