"""The commands of ``hypha``: each takes the parsed arguments and returns the process exit code.

Errors are raised (:mod:`hypha_cli.exceptions`) and turned into messages and exit codes by ``__main__``.
"""

from __future__ import annotations

import argparse
import getpass
import json
import sys
import zipfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from hypha_cli import config, inference, output
from hypha_cli import knobs as knob_options
from hypha_cli.client import HyphaClient
from hypha_cli.exceptions import (
    WATCH_EXIT_CODES,
    ExitCode,
    JobNotFoundError,
    RefusedError,
    ServerError,
    UsageError,
)

#: Job statuses that can have rounds: `hypha jobs` fetches the detail of these for their rounds and loss.
STARTED_STATUSES = ("running", "completed", "failed", "cancelled")


def dispatch(arguments: argparse.Namespace, *, environ: Mapping[str, str], transport: Any = None) -> int:
    handler = COMMANDS[arguments.command]
    return handler(arguments, environ=environ, transport=transport)


def _client(
    arguments: argparse.Namespace, *, environ: Mapping[str, str], transport: Any, need_token: bool = True
) -> HyphaClient:
    settings = config.resolve(
        server=getattr(arguments, "server", None),
        token=getattr(arguments, "token", None),
        timeout=getattr(arguments, "timeout", None),
        environ=environ,
        need_token=need_token,
    )
    return HyphaClient(settings, transport=transport)


# --- login / logout ----------------------------------------------------------------------------------------


def login(arguments: argparse.Namespace, *, environ: Mapping[str, str], transport: Any) -> int:
    server = arguments.server or environ.get("HYPHA_SERVER")
    if not server:
        raise UsageError("login needs --server URL (or HYPHA_SERVER)")
    server = config.normalise_server(server)
    token = arguments.token or environ.get("HYPHA_API_TOKEN") or _ask_token(server)
    settings = config.Settings(
        server=server, token=token, timeout=arguments.timeout or config.DEFAULT_TIMEOUT
    )
    with HyphaClient(settings, transport=transport) as client:
        count = client.verify()
    path = config.config_path(environ)
    config.save_config(path, {"server": server, "token": token})
    print(f"Logged in to {server} ({count} job{'s' if count != 1 else ''} visible); saved to {path}")
    return ExitCode.OK


def _ask_token(server: str) -> str:
    # Without a terminal to prompt on (`echo $TOKEN | hypha login --server URL`), the token is stdin's line.
    prompt = f"API token for {server}: "
    token = (getpass.getpass(prompt) if sys.stdin.isatty() else sys.stdin.readline()).strip()
    if not token:
        raise UsageError("no token given (pass --token, set HYPHA_API_TOKEN, or type it at the prompt)")
    return token


def logout(arguments: argparse.Namespace, *, environ: Mapping[str, str], transport: Any) -> int:
    path = config.config_path(environ)
    saved = config.load_config(path)
    if "token" not in saved:
        print(f"Not logged in ({path} holds no token)")
        return ExitCode.OK
    saved.pop("token")
    config.save_config(path, saved)
    print(f"Logged out of {saved.get('server', 'the server')}; the token was removed from {path}")
    return ExitCode.OK


# --- jobs ---------------------------------------------------------------------------------------------------


def submit(arguments: argparse.Namespace, *, environ: Mapping[str, str], transport: Any) -> int:
    content, content_type, kind = read_spec(
        arguments.file,
        name=arguments.name,
        encoding=arguments.encoding,
        block_size=arguments.encoding_block_size,
        overlap=arguments.overlap,
        fragments=arguments.fragments,
        mix=arguments.mix,
        knobs=knob_options.given(arguments),
    )
    with _client(arguments, environ=environ, transport=transport) as client:
        try:
            job = client.submit(
                content=content,
                content_type=content_type,
                name=arguments.name,
                endpoint=inference.ENDPOINTS[kind],
            )
        except RefusedError as refused:
            if arguments.json and refused.body is not None:
                output.print_json(refused.body)
            raise
    if arguments.json:
        output.print_json(job)
    else:
        print(job["id"])
        # On stderr: stdout stays the job id alone, for scripts (`JOB=$(hypha submit spec.json)`).
        for warning in job.get("warnings") or []:
            print(f"hypha: warning: {warning}", file=sys.stderr)
    return ExitCode.OK


def read_spec(
    file: str,
    *,
    name: str | None,
    encoding: str | None = None,
    block_size: int | None = None,
    overlap: str | None = None,
    fragments: int | None = None,
    mix: float | None = None,
    knobs: dict[str, Any] | None = None,
) -> tuple[bytes, str, str]:
    """The request body, content type and kind (:mod:`hypha_cli.inference`: training or inference) of a spec
    file: TOML by its ``.toml`` suffix, else JSON (checked
    here, so a syntax error names its line; ``--name``, ``--encoding``, ``--encoding-block-size``,
    ``--overlap``, ``--fragments`` and ``--mix`` are set in it: ``rounds.encoding``,
    ``rounds.encoding_block_size``, ``rounds.overlap``, ``rounds.fragments``, ``rounds.mix``; the server checks
    them, fragments and mix being streaming's alone). ``knobs``: the training knobs' options
    (:mod:`hypha_cli.knobs`), set in a JSON spec, refused for a TOML one; all but ``--name`` are training's
    and refused for an inference spec."""
    try:
        raw = sys.stdin.buffer.read() if file == "-" else Path(file).read_bytes()
    except OSError as error:
        raise UsageError(f"cannot read {file}: {error.strerror or error}") from None
    training_options = {
        "--encoding": encoding,
        "--encoding-block-size": block_size,
        "--overlap": overlap,
        "--fragments": fragments,
        "--mix": mix,
    }
    training_options.update({f"--{key.replace('_', '-')}": value for key, value in (knobs or {}).items()})

    def refuse_training_options() -> None:
        given = [option for option, value in training_options.items() if value is not None]
        if given:
            raise UsageError(f"{', '.join(given)}: training options; {file} is an inference job")

    if file.lower().endswith(".toml"):
        if inference.toml_kind(raw) == inference.INFERENCE:
            refuse_training_options()
            return raw, "application/toml", inference.INFERENCE
        if encoding is not None or block_size is not None:
            # Rewriting the user's TOML would lose its comments and layout: the key goes in the file.
            raise UsageError(
                "--encoding and --encoding-block-size set a JSON spec's rounds; in a TOML spec write "
                'encoding = "int8" (and encoding_block_size = N) under [scheduler.job.rounds]'
            )
        if overlap is not None:
            raise UsageError(
                '--overlap sets a JSON spec\'s rounds; in a TOML spec write overlap = "eager" under '
                "[scheduler.job.rounds]"
            )
        if fragments is not None or mix is not None:
            raise UsageError(
                "--fragments and --mix set a JSON spec's rounds; in a TOML spec write fragments = N and "
                'mix = A (with overlap = "streaming") under [scheduler.job.rounds]'
            )
        knob_options.refuse_for_toml(knobs or {})
        return raw, "application/toml", inference.TRAINING
    try:
        spec = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise RefusedError(f"{file} is not valid JSON: {error}", status=0) from None
    if not isinstance(spec, dict):
        raise RefusedError(
            f"{file} must hold a JSON object (the DiLoCo spec), not {type(spec).__name__}", status=0
        )
    if name is not None:
        spec["name"] = name
    if inference.json_kind(spec) == inference.INFERENCE:
        refuse_training_options()
        return json.dumps(spec).encode(), "application/json", inference.INFERENCE
    rounds_options = {
        "encoding": encoding,
        "encoding_block_size": block_size,
        "overlap": overlap,
        "fragments": fragments,
        "mix": mix,
    }
    if any(value is not None for value in rounds_options.values()):
        rounds = spec.setdefault("rounds", {})
        if not isinstance(rounds, dict):
            raise RefusedError(
                f"{file}: rounds must be a JSON object for --encoding, --encoding-block-size, --overlap, "
                "--fragments or --mix",
                status=0,
            )
        rounds.update({key: value for key, value in rounds_options.items() if value is not None})
    knob_options.apply(spec, knobs or {}, file=file)
    return json.dumps(spec).encode(), "application/json", inference.TRAINING


def jobs(arguments: argparse.Namespace, *, environ: Mapping[str, str], transport: Any) -> int:
    with _client(arguments, environ=environ, transport=transport) as client:
        listed = client.jobs(
            limit=arguments.limit,
            status=getattr(arguments, "status", None),
            name=getattr(arguments, "name", None),
        )
        if arguments.json:
            output.print_json(listed)
            return ExitCode.OK
        # The list has no rounds: a started job's rounds and loss come from its detail.
        shown = [
            client.job(job["id"]) if job.get("status") in STARTED_STATUSES else {**job, "rounds": []}
            for job in listed
        ]
    if not shown:
        if getattr(arguments, "status", None) or getattr(arguments, "name", None):
            print("No job matches the filter.")
            return ExitCode.OK
        print("No jobs yet: submit one with `hypha submit FILE`")
        return ExitCode.OK
    output.console().print(output.jobs_table(shown))
    return ExitCode.OK


def show(arguments: argparse.Namespace, *, environ: Mapping[str, str], transport: Any) -> int:
    with _client(arguments, environ=environ, transport=transport) as client:
        job = client.job(arguments.job_id)
    if arguments.json:
        output.print_json(job)
        return ExitCode.OK
    console = output.console()
    console.print(output.jobs_table([job]))
    console.print(f"\nstatus reason: {job.get('status_reason') or '-'}", markup=False)
    if "cost" in job:
        spec = job.get("spec") if isinstance(job.get("spec"), dict) else {}
        limit = f" (max_cost {output.credits_text(spec['max_cost'])})" if spec.get("max_cost") else ""
        console.print(f"cost: {output.credits_text(job['cost'])}{limit}", markup=False)
    if inference.is_inference(job):
        console.print(inference.progress_line(job), markup=False)
    data = job.get("data") or {}
    if data:
        console.print(
            f"data: epoch {output.number_text(data.get('epoch'))}, {data.get('used')} used, "
            f"{data.get('assigned')} assigned, {data.get('available')} available of {data.get('total')} slices",
            markup=False,
        )
    for lease in job.get("leases") or []:
        console.print(
            f"lease: {lease.get('role')} on {lease.get('worker')} ({lease.get('status')}, "
            f"{output.price_text(lease.get('price'))})",
            markup=False,
        )
    total = output.rounds_total(job)
    for round_ in output.closed_rounds(job):
        console.print(output.round_line(round_, total), markup=False)
        if (line := output.throughput_line(round_, total)) is not None:
            console.print(line, markup=False)
    for line in output.trainer_throughput_lines(job):
        console.print(line, markup=False)
    if job.get("model_files"):
        console.print(f"model: {', '.join(job['model_files'])} (hypha download {job['id']})", markup=False)
    return ExitCode.OK


def watch(arguments: argparse.Namespace, *, environ: Mapping[str, str], transport: Any) -> int:
    from hypha_cli import watch as watching

    with _client(arguments, environ=environ, transport=transport) as client:
        first = client.job(arguments.job_id)  # a missing job or a bad token fails now, not after retries
        if arguments.json:
            reporter: watching.Reporter = watching.QuietReporter()
        elif sys.stdout.isatty():
            reporter = watching.ProgressReporter(output.console())
        else:
            reporter = watching.PlainReporter(sys.stdout)
        answers = iter([first])
        try:
            job = watching.follow(
                lambda: next(answers, None) or client.job(arguments.job_id),
                reporter=reporter,
                patience=arguments.patience or watching.DEFAULT_PATIENCE,
            )
        finally:
            reporter.close()
    if arguments.json:
        output.print_json(job)
    else:
        print(inference.summary(job) if inference.is_inference(job) else output.job_summary(job))
    return WATCH_EXIT_CODES[job["status"]]


def cancel(arguments: argparse.Namespace, *, environ: Mapping[str, str], transport: Any) -> int:
    with _client(arguments, environ=environ, transport=transport) as client:
        job = client.cancel(arguments.job_id)
    if arguments.json:
        output.print_json(job)
    else:
        print(f"job {job['id']} {job.get('status')}: {job.get('status_reason') or ''}".rstrip(": "))
    return ExitCode.OK


def discard(arguments: argparse.Namespace, *, environ: Mapping[str, str], transport: Any) -> int:
    """Ask the server to discard a round (docs/training.md, "Discarding a round"); a refusal (409) exits 1
    with the server's reason."""
    with _client(arguments, environ=environ, transport=transport) as client:
        job = client.discard_round(arguments.job_id, arguments.round)
    if arguments.json:
        output.print_json(job)
    else:
        print(
            f"job {job['id']}: round {arguments.round} will be discarded: the next round goes back to the "
            f"weights and momentum of round {arguments.round - 1}"
        )
    return ExitCode.OK


def download(arguments: argparse.Namespace, *, environ: Mapping[str, str], transport: Any) -> int:
    directory = Path(arguments.output)
    with _client(arguments, environ=environ, transport=transport) as client:
        archive = client.download_model(arguments.job_id, directory)
    extracted = extract(archive, directory / f"model-{arguments.job_id}") if arguments.extract else None
    if arguments.json:
        output.print_json(
            {
                "path": str(archive),
                "bytes": archive.stat().st_size,
                "extracted": str(extracted) if extracted else None,
            }
        )
    else:
        print(archive)
        if extracted:
            print(extracted)
    return ExitCode.OK


def results(arguments: argparse.Namespace, *, environ: Mapping[str, str], transport: Any) -> int:
    """Save an inference job's results: every one so far as a zip (with ``manifest.json``), or with
    ``--slice N`` that slice's result file (``N.safetensors`` or ``N.jsonl``). ``-o`` is the file to write, or
    a directory (an existing one, or a path ending in ``/``) to save the server's file name in."""
    target = Path(arguments.output) if arguments.output else Path(".")
    if arguments.output and not (target.is_dir() or arguments.output.endswith(("/", "\\"))):
        directory, name = target.parent, target.name
    else:
        directory, name = target, None
    with _client(arguments, environ=environ, transport=transport) as client:
        saved = client.download_results(arguments.job_id, directory, name=name, index=arguments.slice)
    if arguments.json:
        output.print_json({"path": str(saved), "bytes": saved.stat().st_size, "slice": arguments.slice})
    else:
        print(saved)
    return ExitCode.OK


def logs(arguments: argparse.Namespace, *, environ: Mapping[str, str], transport: Any) -> int:
    """Every task's full log, each under a header line; with ``--task``, that task's log alone."""
    with _client(arguments, environ=environ, transport=transport) as client:
        job = client.job(arguments.job_id)
        tasks = [task for task in job.get("tasks") or [] if isinstance(task, dict) and task.get("id")]
        if arguments.task:
            tasks = [task for task in tasks if str(task["id"]).startswith(arguments.task.lower())]
            if len(tasks) != 1:
                what = "no task" if not tasks else "more than one task"
                raise JobNotFoundError(
                    f"job {job['id']} has {what} {arguments.task!r} (`hypha logs {job['id']}` lists its tasks)"
                )
        logged = [(task, client.task_log(job["id"], task["id"])) for task in tasks]
    if arguments.json:
        output.print_json(
            [
                {key: task.get(key) for key in ("id", "role", "worker", "status")} | {"log": log}
                for task, log in logged
            ]
        )
    elif arguments.task:
        sys.stdout.write(logged[0][1])
    elif not logged:
        print(f"job {job['id']} has no tasks yet ({job.get('status')})", file=sys.stderr)
    else:
        for number, (task, log) in enumerate(logged):
            exit_code = f", exit {task['exit_code']}" if task.get("exit_code") is not None else ""
            header = f"==> {task.get('role')} on {task.get('worker')} ({task['id']}, {task.get('status')}{exit_code}) <=="
            print(("\n" if number else "") + header)
            sys.stdout.write(log if log.endswith("\n") or not log else log + "\n")
    return ExitCode.OK


def extract(archive: Path, destination: Path) -> Path:
    """Unpack ``archive`` into ``destination``, refusing members that would land outside it."""
    try:
        with zipfile.ZipFile(archive) as bundle:
            root = destination.resolve()
            for member in bundle.namelist():
                target = (root / member).resolve()
                if not target.is_relative_to(root):
                    raise ServerError(f"{archive} holds a file outside its directory: {member!r}")
            bundle.extractall(destination)
    except zipfile.BadZipFile as error:
        raise ServerError(f"{archive} is not a zip: {error}") from None
    except OSError as error:
        raise UsageError(f"cannot extract into {destination}: {error.strerror or error}") from None
    return destination


# --- workers ------------------------------------------------------------------------------------------------


def workers(arguments: argparse.Namespace, *, environ: Mapping[str, str], transport: Any) -> int:
    with _client(arguments, environ=environ, transport=transport) as client:
        listed = client.workers(limit=arguments.limit, mine=arguments.mine)
    if arguments.json:
        output.print_json(listed)
    elif not listed:
        print(
            f"{'You own no workers' if arguments.mine else 'No workers in the pool yet'}: register one with "
            "POST /api/workers/ and start `hypha-worker-daemon`"
        )
    else:
        output.console().print(output.workers_table(listed))
    return ExitCode.OK


COMMANDS = {
    "login": login,
    "logout": logout,
    "submit": submit,
    "jobs": jobs,
    "show": show,
    "watch": watch,
    "cancel": cancel,
    "discard": discard,
    "download": download,
    "results": results,
    "logs": logs,
    "workers": workers,
}
