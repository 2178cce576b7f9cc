from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from worker_daemon.bridge.exceptions import InvalidRequest, PathRejected
from worker_daemon.bridge.paths import make_directory, resolve_in, restrict_file


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


# --- symlinks (hardened beyond Hypha's rules) ---------------------------------------------------------------------


@pytest.fixture
def outside(tmp_path: Path) -> Path:
    """A directory beside the work dir, with one file the executor must not reach through the bridge."""
    path = tmp_path / "outside"
    path.mkdir()
    (path / "secret").write_text("not yours")
    (path / "secret").chmod(0o644)
    return path


@pytest.fixture
def base(tmp_path: Path) -> Path:
    path = tmp_path / "work"
    path.mkdir()
    return path


def test_a_directory_symlink_to_etc_is_rejected(base: Path) -> None:
    # given: the executor plants out -> /etc
    os.symlink("/etc", base / "out")
    # when / then
    for path in ["out/passwd", "out", "out/new-dir/file"]:
        with pytest.raises(PathRejected, match="leaves the work dir"):
            resolve_in(base, path)


def test_a_file_symlink_pointing_outside_is_rejected(base: Path, outside: Path) -> None:
    os.symlink(outside / "secret", base / "delta.safetensors")
    with pytest.raises(PathRejected, match="leaves the work dir"):
        resolve_in(base, "delta.safetensors")


def test_a_symlink_chain_leaving_the_base_is_rejected(base: Path, outside: Path) -> None:
    # given: a -> b -> c -> outside, every link itself inside the work dir
    os.symlink(outside, base / "c")
    os.symlink("c", base / "b")
    os.symlink(base / "b", base / "a")
    # when / then
    with pytest.raises(PathRejected, match="leaves the work dir"):
        resolve_in(base, "a/secret")


def test_a_symlink_chain_staying_inside_is_allowed(base: Path) -> None:
    (base / "real").mkdir()
    os.symlink("real", base / "b")
    os.symlink(base / "b", base / "a")
    assert resolve_in(base, "a/f") == base.resolve() / "real/f"


def test_a_symlink_loop_is_rejected(base: Path) -> None:
    os.symlink("loop-b", base / "loop-a")
    os.symlink("loop-a", base / "loop-b")
    with pytest.raises(PathRejected, match="cannot be resolved"):
        resolve_in(base, "loop-a/f")


def test_make_directory_creates_the_missing_parents(base: Path) -> None:
    # given: an inside link on the way
    (base / "real").mkdir()
    os.symlink("real", base / "alias")
    # when
    path = make_directory(base, "alias/results/r1")
    # then
    assert path == base.resolve() / "real/results/r1"
    assert path.is_dir()
    assert make_directory(base, "alias/results/r1") == path  # exists: fine


def test_make_directory_through_a_symlink_out_creates_nothing_there(base: Path, outside: Path) -> None:
    os.symlink(outside, base / "out")
    with pytest.raises(PathRejected, match="leaves the work dir"):
        make_directory(base, "out/incoming")
    assert sorted(path.name for path in outside.iterdir()) == ["secret"]


def test_restrict_file_makes_a_file_0600(base: Path) -> None:
    (base / "f").write_bytes(b"x")
    (base / "f").chmod(0o644)
    restrict_file(resolve_in(base, "f"), base=base)
    assert stat.S_IMODE((base / "f").stat().st_mode) == 0o600


def test_restrict_file_refuses_a_file_swapped_for_a_symlink_after_the_check(
    base: Path, outside: Path
) -> None:
    # given: a path checked while it was a plain file, then replaced by a link out (the race)
    (base / "f").write_bytes(b"x")
    path = resolve_in(base, "f")
    (base / "f").unlink()
    os.symlink(outside / "secret", base / "f")
    # when / then: refused, and the file outside keeps its mode
    with pytest.raises(PathRejected, match="symlink appeared"):
        restrict_file(path, base=base)
    assert stat.S_IMODE((outside / "secret").stat().st_mode) == 0o644


def test_restrict_file_refuses_a_parent_swapped_for_a_symlink_after_the_check(
    base: Path, outside: Path
) -> None:
    (base / "incoming").mkdir()
    path = resolve_in(base, "incoming/secret")
    (base / "incoming").rmdir()
    os.symlink(outside, base / "incoming")
    with pytest.raises(PathRejected, match="symlink appeared"):
        restrict_file(path, base=base)
    assert stat.S_IMODE((outside / "secret").stat().st_mode) == 0o644


def test_restrict_file_refuses_what_is_not_a_regular_file(base: Path) -> None:
    # a FIFO must neither block the bridge nor pass as a file
    os.mkfifo(base / "pipe")
    with pytest.raises(PathRejected, match="not a regular file"):
        restrict_file(resolve_in(base, "pipe"), base=base)
    with pytest.raises(PathRejected, match="not a file below the work dir"):
        restrict_file(base.resolve().parent / "elsewhere", base=base)


def test_restrict_file_leaves_a_vanished_file_alone(base: Path) -> None:
    restrict_file(resolve_in(base, "gone/f"), base=base)
    restrict_file(resolve_in(base, "gone"), base=base)
