"""``hypha``: submit, watch, cancel and download DiLoCo and batch inference jobs and list workers from the
command line.

The arguments are parsed before anything heavy is imported (httpx, rich), so ``--help`` and usage errors are
instant; the commands live in :mod:`hypha_cli.commands`.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Mapping, Sequence
from typing import Any, NoReturn

from hypha_cli import knobs
from hypha_cli.exceptions import CLIError, ExitCode
from hypha_tensors.formats import ENCODINGS
from hypha_tensors.fragments import DEFAULT_FRAGMENTS, MAX_FRAGMENTS, MIN_FRAGMENTS

PROG = "hypha"
#: ``rounds.overlap`` of a spec (docs/training.md, "Overlap: eager updates", "Overlap: streaming"); the server
#: checks it again, and ``--fragments``/``--mix`` too.
OVERLAPS = ("none", "eager", "streaming")

DESCRIPTION = """\
The command line of a Hypha control plane: submit DiLoCo training jobs and batch inference jobs, watch
them, cancel them, download their models and results, list workers. Log in once with
`hypha login --server URL`."""

EPILOG = f"""\
exit codes:
  {ExitCode.OK:<3d} success; `watch`: the job completed
  {ExitCode.REFUSED:<3d} the server refused the request (invalid spec, not cancellable, round not
      discardable, no model yet);
      `watch`: the job failed
  {ExitCode.CANCELLED:<3d} `watch`: the job was cancelled
  {ExitCode.AUTHENTICATION:<3d} not logged in, or the server refused the token (HTTP 401/403)
  {ExitCode.NOT_FOUND:<3d} no such job, or not one of yours (HTTP 404); `logs --task`: no such task;
      `results --slice`: no result for that slice (yet)
  {ExitCode.WRONG_SERVER:<3d} wrong server: cannot connect or no answer in time, or not a Hypha control plane
  {ExitCode.SERVER_ERROR:<3d} the server failed (HTTP 5xx) or answered something unexpected
  {ExitCode.USAGE:<3d} usage error: bad flags or arguments, unreadable file, no server configured
  {ExitCode.INTERRUPTED:<3d} interrupted (Ctrl-C)

environment:
  HYPHA_SERVER      the control plane's URL (overrides the config file; --server overrides it)
  HYPHA_API_TOKEN   the API token (overrides the config file; --token overrides it)
  HYPHA_CONFIG      the config file (default: ~/.config/hypha/cli.json, written by `hypha login`, mode 0600)

Every command takes --server, --token and --timeout; read commands take --json (the API's JSON on stdout).
Manual: docs/cli.md."""


class ArgumentParser(argparse.ArgumentParser):
    """argparse with usage errors exiting 64: exit code 2 means "cancelled" for `hypha watch`."""

    def error(self, message: str) -> NoReturn:
        self.print_usage(sys.stderr)
        self.exit(ExitCode.USAGE, f"{self.prog}: error: {message}\n")


class _VersionAction(argparse.Action):
    """``--version``, looked up only when asked for (importlib.metadata is not free)."""

    def __init__(self, option_strings: Sequence[str], dest: str = argparse.SUPPRESS, **kwargs: Any) -> None:
        super().__init__(option_strings, dest=dest, nargs=0, help="print the version and exit")

    def __call__(self, parser: argparse.ArgumentParser, *args: Any, **kwargs: Any) -> None:
        from importlib import metadata

        try:
            version = metadata.version("hypha")
        except metadata.PackageNotFoundError:
            version = "0.1.0"
        print(f"{PROG} {version}")
        parser.exit()


def _positive(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be positive: {text!r}")
    return value


def _count(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1: {text!r}")
    return value


def _round_number(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if not 1 <= value <= 999_999_999:  # the URL takes nine digits; round 0 has no round before it
        raise argparse.ArgumentTypeError(f"must be from 1 to 999999999: {text!r}")
    return value


def _slice_index(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if not 0 <= value <= 2**31 - 1:  # the server's slice indices
        raise argparse.ArgumentTypeError(f"must be from 0 to {2**31 - 1}: {text!r}")
    return value


def _fragments(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if not MIN_FRAGMENTS <= value <= MAX_FRAGMENTS:
        raise argparse.ArgumentTypeError(f"must be from {MIN_FRAGMENTS} to {MAX_FRAGMENTS}: {text!r}")
    return value


def _mix(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not 0 <= value < 1:  # also refuses nan
        raise argparse.ArgumentTypeError(f"must be at least 0 and less than 1: {text!r}")
    return value


def _job_id(text: str) -> str:
    """A job id is a UUID: checked here so a typo is a usage error, not a confusing 404 from the server."""
    import uuid

    try:
        return str(uuid.UUID(text.strip()))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"not a job id: {text!r} (job ids are UUIDs, see `hypha jobs`)"
        ) from None


def _connection_options(*, suppress: bool) -> argparse.ArgumentParser:
    """--server, --token, --timeout: accepted before and after the command name. After it, the defaults are
    suppressed so that a subcommand does not overwrite a value given before it."""
    default = argparse.SUPPRESS if suppress else None
    options = argparse.ArgumentParser(add_help=False)
    group = options.add_argument_group("connection")
    group.add_argument(
        "--server",
        metavar="URL",
        default=default,
        help="the control plane (default: $HYPHA_SERVER, then the config)",
    )
    group.add_argument(
        "--token",
        metavar="TOKEN",
        default=default,
        help="API token (default: $HYPHA_API_TOKEN, then the config)",
    )
    group.add_argument(
        "--timeout",
        metavar="SECONDS",
        type=_positive,
        default=default,
        help="limit of every HTTP call: connecting, each read and write (default: 30)",
    )
    return options


def build_parser() -> argparse.ArgumentParser:
    """The command line parser (exposed for documentation and tests)."""
    parser = ArgumentParser(
        prog=PROG,
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        parents=[_connection_options(suppress=False)],
    )
    parser.add_argument("--version", action=_VersionAction)
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=ArgumentParser)
    connection = [_connection_options(suppress=True)]

    def command(name: str, summary: str, *, json_help: str | None = None) -> argparse.ArgumentParser:
        sub = commands.add_parser(name, help=summary, description=summary, parents=connection)
        if json_help:
            sub.add_argument("--json", action="store_true", help=json_help)
        return sub

    login = command("login", "check a server and token, and save both in the config file")
    login.epilog = "Without --token (or $HYPHA_API_TOKEN) the token is prompted for, or read from stdin."

    command("logout", "forget the saved token")

    submit = command(
        "submit",
        "submit a DiLoCo or batch inference job from a spec file; prints the job id",
        json_help="print the created job as JSON (a refusal: the API's error body)",
    )
    submit.add_argument(
        "file",
        metavar="FILE",
        help="the spec: JSON (.json) or Hypha scheduler TOML (.toml); - for stdin (JSON). An inference job "
        '(a TOML job table with type = "inference", a JSON spec with a "task") goes to /api/jobs/inference/',
    )
    submit.add_argument("--name", metavar="NAME", help="the job's name (overrides a name in a JSON spec)")
    submit.add_argument(
        "--encoding",
        choices=ENCODINGS,
        help="how pseudo-gradients and results travel (sets rounds.encoding of a JSON spec): float32 "
        "(exact), float16 or bfloat16 (half the bytes), int8 (a quarter); the lossy ones with error feedback",
    )
    submit.add_argument(
        "--encoding-block-size",
        type=_count,
        metavar="N",
        help="int8: values per scale (sets rounds.encoding_block_size; the server's default: 256)",
    )
    submit.add_argument(
        "--overlap",
        choices=OVERLAPS,
        help="how trainers overlap a round's communication with computation (sets rounds.overlap of a JSON "
        "spec): none (wait for each round's result; the default), eager (send the update and train the "
        "next round at once) or streaming (sync one fragment of the model a round while training on)",
    )
    submit.add_argument(
        "--fragments",
        type=_fragments,
        metavar="N",
        help=f"streaming: fragments of the model, synced one a round in turn (sets rounds.fragments; "
        f"{MIN_FRAGMENTS} to {MAX_FRAGMENTS}, the server's default: {DEFAULT_FRAGMENTS})",
    )
    submit.add_argument(
        "--mix",
        type=_mix,
        metavar="A",
        help="streaming: a fragment's weights become A x local + (1 - A) x global when its result arrives "
        "(sets rounds.mix; 0 <= A < 1, the server's default: 0.5)",
    )
    knobs.add_arguments(submit)

    jobs = command("jobs", "list your jobs, newest first", json_help="print the API's job objects as JSON")
    jobs.add_argument(
        "--limit", type=_count, default=20, metavar="N", help="show the newest N jobs (default: 20)"
    )
    jobs.add_argument(
        "--status",
        choices=["pending", "allocating", "allocated", "running", "completed", "cancelled", "failed"],
        help="only the jobs in this status",
    )
    jobs.add_argument("--name", metavar="TEXT", help="only the jobs whose name contains TEXT (any case)")

    show = command("show", "show one job in full", json_help="print the API's job detail as JSON")
    show.add_argument("job_id", metavar="ID", type=_job_id, help="the job's id")

    watch = command(
        "watch",
        "follow a job until it ends (rounds; an inference job: slices done/total and an ETA); exit 0 "
        "completed, 1 failed, 2 cancelled",
        json_help="print nothing while watching, then the final job as JSON",
    )
    watch.add_argument("job_id", metavar="ID", type=_job_id, help="the job's id")
    watch.add_argument(
        "--patience",
        type=_positive,
        default=None,
        metavar="SECONDS",
        help="keep retrying an unreachable or failing server this long before giving up (default: 120)",
    )

    cancel = command("cancel", "cancel a job", json_help="print the cancelled job as JSON")
    cancel.add_argument("job_id", metavar="ID", type=_job_id, help="the job's id")

    discard = command(
        "discard",
        "discard a running job's latest closed round: the next round goes back to the round before it",
        json_help="print the job as JSON",
    )
    discard.add_argument("job_id", metavar="ID", type=_job_id, help="the job's id")
    discard.add_argument("round", metavar="ROUND", type=_round_number, help="the round's number")

    download = command(
        "download",
        "save a completed job's model (a zip)",
        json_help='print {"path", "bytes", "extracted"} as JSON',
    )
    download.add_argument("job_id", metavar="ID", type=_job_id, help="the job's id")
    download.add_argument(
        "-o", "--output", metavar="DIR", default=".", help="directory to save in (default: .)"
    )
    download.add_argument("--extract", action="store_true", help="also unpack the zip into DIR/model-<ID>/")

    results = command(
        "results",
        "save an inference job's results: every one so far as a zip (with manifest.json), or one slice's",
        json_help='print {"path", "bytes", "slice"} as JSON',
    )
    results.add_argument("job_id", metavar="ID", type=_job_id, help="the job's id")
    results.add_argument(
        "-o",
        "--output",
        metavar="FILE",
        help="the file to write, or a directory to save the server's file name in "
        "(default: ./results-<ID>.zip, or ./<N>.safetensors|jsonl with --slice)",
    )
    results.add_argument(
        "--slice", type=_slice_index, metavar="N", help="only slice N's result file (N from 0)"
    )

    logs = command(
        "logs",
        "print a job's task logs, each under a header line (--task: one task's log alone)",
        json_help='print [{"id", "role", "worker", "status", "log"}] as JSON',
    )
    logs.add_argument("job_id", metavar="ID", type=_job_id, help="the job's id")
    logs.add_argument(
        "--task",
        metavar="TASK",
        help="only this task's log: its id or the start of it (`hypha logs ID` heads each log with its task's id)",
    )

    workers = command(
        "workers",
        "list the pool's workers: each one's public facts, yours in full",
        json_help="print the API's worker objects as JSON",
    )
    workers.add_argument(
        "--limit", type=_count, default=100, metavar="N", help="show at most N (default: 100)"
    )
    workers.add_argument("--mine", action="store_true", help="only the workers you own")
    return parser


def run(
    argv: Sequence[str] | None = None,
    *,
    environ: Mapping[str, str] | None = None,
    transport: Any = None,
) -> int:
    """Run one command; its exit code. ``environ`` and ``transport`` (an ``httpx`` transport) are for tests."""
    parser = build_parser()
    arguments = parser.parse_args(argv)
    if arguments.command is None:
        parser.error("a command is required (see `hypha --help`)")
    try:
        from hypha_cli import commands

        return commands.dispatch(
            arguments, environ=os.environ if environ is None else environ, transport=transport
        )
    except CLIError as error:
        _print_error(error)
        return error.exit_code
    except KeyboardInterrupt:
        print(f"\n{PROG}: interrupted", file=sys.stderr)
        return ExitCode.INTERRUPTED


def _print_error(error: CLIError) -> None:
    from hypha_cli.exceptions import RefusedError

    if isinstance(error, RefusedError) and error.status == 400 and error.errors:
        print(f"{PROG}: error: the server refused the request (HTTP {error.status}):", file=sys.stderr)
        for path, message in error.errors:
            print(f"  {path}: {message}" if path else f"  {message}", file=sys.stderr)
    else:
        print(f"{PROG}: error: {error}", file=sys.stderr)


def main(argv: Sequence[str] | None = None) -> int:
    """The ``hypha`` console script."""
    try:
        return run(argv)
    except BrokenPipeError:  # `hypha jobs | head`: the reader left; that is not an error
        sys.stderr.close()
        return ExitCode.OK


if __name__ == "__main__":
    sys.exit(main())
