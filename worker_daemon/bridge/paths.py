"""Path rules of the bridge: Hypha's two checks, plus a containment check that follows symlinks.

Hypha refuses absolute paths and ``..`` components and then joins under the work dir (reference §1.5). We
also resolve the joined path (following symlinks, including those of parents that exist while the tail does
not) and refuse it unless it stays inside the resolved work dir, so a symlink planted by the executor
(``out -> /etc``, a file linked outside, a chain of links, a loop) cannot make the bridge read or write
elsewhere. A symlink that stays inside the work dir is fine: the resolved path is what the bridge uses.

Races: the executor may swap a checked component for a symlink between the check and the use. What the
bridge itself creates or changes goes through :func:`make_directory` and :func:`restrict_file`, which walk the
resolved (hence then symlink-free) path from a descriptor of the work dir with ``O_NOFOLLOW`` at every
component, so a swapped-in symlink is refused instead of followed. Files a backend reads or writes by path
(``send``, downloads) are checked when the request arrives and, for received and fetched files, again when
they are reported; the executor runs as the daemon's user, so winning that race gives it nothing it could
not read or write directly.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path, PurePosixPath

from worker_daemon.bridge.exceptions import PathRejected

FILE_MODE = 0o600
_DIRECTORY_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def resolve_in(base: Path, relative: str) -> Path:
    """``base / relative`` as an absolute path, or :class:`PathRejected` if it breaks the rules.

    ``relative`` must be non-empty, relative, free of ``..`` components and NUL bytes, and must resolve
    (symlinks followed) to ``base`` itself or below it; a symlink loop on the way is refused too.
    """
    if not relative or "\x00" in relative:
        raise PathRejected(f"invalid path {relative!r}")
    pure = PurePosixPath(relative)
    if pure.is_absolute() or relative.startswith(("/", "\\")):
        raise PathRejected(f"absolute path not allowed: {relative!r}")
    if ".." in pure.parts:
        raise PathRejected(f"'..' not allowed in path: {relative!r}")
    root = base.resolve()
    try:
        candidate = (root / pure).resolve(strict=False)
    except (RuntimeError, OSError) as error:  # Python 3.11 raises RuntimeError for a symlink loop
        raise PathRejected(f"path cannot be resolved: {relative!r}: {error}") from None
    if not candidate.is_relative_to(root):
        raise PathRejected(f"path leaves the work dir: {relative!r}")
    return candidate


def relative_posix(path: Path, *, base: Path) -> str:
    """``path`` relative to ``base``, with forward slashes (as paths appear in responses)."""
    return path.relative_to(base.resolve()).as_posix()


def make_directory(base: Path, relative: str) -> Path:
    """Create ``base / relative`` and its missing parents (``mkdir -p``) within the path rules; return it.

    The path is checked with :func:`resolve_in`, then created component by component beneath a descriptor
    of ``base`` without following symlinks, so a link swapped in after the check is refused
    (:class:`PathRejected`) rather than created through. Directories get the default mode, as in Hypha.
    """
    path = resolve_in(base, relative)
    os.close(_open_directory_beneath(base.resolve(), path, create=True))
    return path


def restrict_file(path: Path, *, base: Path) -> None:
    """Make a regular file the bridge reports ``0600``.

    ``path`` (from :func:`resolve_in`) must lie below ``base`` and is opened beneath it with ``O_NOFOLLOW`` at
    every component, so the mode change cannot land on a file a swapped-in symlink points to. A path that
    left ``base`` meanwhile, or is no regular file, is :class:`PathRejected`; a file that vanished is left
    alone.
    """
    root = base.resolve()
    if not path.is_relative_to(root) or path == root:
        raise PathRejected(f"not a file below the work dir: {str(path)!r}")
    try:
        directory = _open_directory_beneath(root, path.parent, create=False)
    except FileNotFoundError:
        return
    try:
        # O_NONBLOCK: a FIFO planted under the reported name must not block the bridge in open().
        flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
        try:
            descriptor = os.open(path.name, flags, dir_fd=directory)
        except FileNotFoundError:
            return
        except OSError as error:
            _refuse_if_symlink(error, directory, path.name, path)
            raise
    finally:
        os.close(directory)
    try:
        if not stat.S_ISREG(os.fstat(descriptor).st_mode):
            raise PathRejected(f"not a regular file: {str(path)!r}")
        os.fchmod(descriptor, FILE_MODE)
    finally:
        os.close(descriptor)


def _open_directory_beneath(root: Path, path: Path, *, create: bool) -> int:
    """A descriptor of directory ``path`` (at or below the resolved ``root``), opened one component at a
    time from ``root`` with ``O_NOFOLLOW``; missing components are created when ``create``."""
    if not path.is_relative_to(root):
        raise PathRejected(f"path leaves the work dir: {str(path)!r}")
    directory = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for part in path.relative_to(root).parts:
            if create:
                try:
                    os.mkdir(part, dir_fd=directory)
                except FileExistsError:
                    pass
            try:
                child = os.open(part, _DIRECTORY_FLAGS, dir_fd=directory)
            except OSError as error:
                _refuse_if_symlink(error, directory, part, path)
                raise
            os.close(directory)
            directory = child
    except BaseException:
        os.close(directory)
        raise
    return directory


def _refuse_if_symlink(error: OSError, directory: int, name: str, path: Path) -> None:
    """Turn the error of an ``O_NOFOLLOW`` open into :class:`PathRejected` when ``name`` is a symlink."""
    if error.errno == errno.ELOOP:
        raise PathRejected(f"a symlink appeared in the path: {str(path)!r}") from None
    if error.errno == errno.ENOTDIR:
        try:
            is_link = stat.S_ISLNK(os.lstat(name, dir_fd=directory).st_mode)
        except OSError:
            return
        if is_link:
            raise PathRejected(f"a symlink appeared in the path: {str(path)!r}") from None
