from __future__ import annotations

import os
from pathlib import Path

import pytest

from worker_daemon.bridge.exceptions import InvalidRequest, PathRejected
from worker_daemon.bridge.paths import resolve_in


def test_relative_paths_resolve_under_the_base(tmp_path: Path) -> None:
    assert (
        resolve_in(tmp_path, "updates/delta.safetensors") == tmp_path.resolve() / "updates/delta.safetensors"
    )
    assert resolve_in(tmp_path, "./a/./b") == tmp_path.resolve() / "a/b"


@pytest.mark.parametrize("path", ["/etc/passwd", "..", "../x", "a/../b", "a/..", "", "a\x00b"])
def test_bad_paths_are_rejected(tmp_path: Path, path: str) -> None:
    with pytest.raises(PathRejected):
        resolve_in(tmp_path, path)


def test_a_symlink_leaving_the_base_is_rejected_even_below_a_missing_tail(tmp_path: Path) -> None:
    # given
    base = tmp_path / "work"
    outside = tmp_path / "outside"
    base.mkdir()
    outside.mkdir()
    os.symlink(outside, base / "escape")
    os.symlink(tmp_path / "outside" / "missing", base / "dangling")
    # when / then
    with pytest.raises(PathRejected, match="leaves the work dir"):
        resolve_in(base, "escape/new/file.bin")
    with pytest.raises(PathRejected, match="leaves the work dir"):
        resolve_in(base, "dangling")


def test_a_symlink_staying_inside_is_allowed(tmp_path: Path) -> None:
    (tmp_path / "real").mkdir()
    os.symlink(tmp_path / "real", tmp_path / "alias")
    assert resolve_in(tmp_path, "alias/f") == tmp_path.resolve() / "real/f"


def test_path_rejected_is_an_invalid_request() -> None:
    assert issubclass(PathRejected, InvalidRequest)
    assert (PathRejected.kind, PathRejected.status) == ("invalid_request", 400)
