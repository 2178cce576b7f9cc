"""``python -m parameter_server``: the built-in parameter server a worker daemon starts for an ``aggregate`` task.

Environment: ``HYPHA_TRANSFER_KEY`` (required: verifies the trainers' transfer tokens),
``HYPHA_TRANSFER_TOKEN`` and ``HYPHA_SERVER_URL`` (required: the final model's upload), and optionally
``HYPHA_TRANSFER_TOKEN_FILE`` (a file the daemon rewrites with each fresh, short-lived token). torch and
transformers are imported only after the arguments are parsed, so ``--help`` and argument errors are instant.
Logs go to stderr through the ``parameter_server`` logger; the daemon re-prints them.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from parameter_server.job import JobConfig
    from parameter_server.service import Settings

EXIT_DONE = 0
EXIT_FAILED = 1
EXIT_BAD_ARGUMENTS = 2
EXIT_TERMINATED = 128 + signal.SIGTERM

EXIT_CODES_HELP = f"""exit codes:
  {EXIT_DONE}    the job is done: every round closed and the final model was uploaded
  {EXIT_FAILED}    an unexpected failure (model source, checkpoint, upload that never succeeded, ...)
  {EXIT_BAD_ARGUMENTS}    bad arguments, environment or job JSON
  {EXIT_TERMINATED}  stopped by SIGTERM or SIGINT (the last completed round is checkpointed in the work dir)
"""

logger = logging.getLogger("parameter_server")

#: The traces' default ``service.name`` (``OTEL_SERVICE_NAME`` wins).
SERVICE_NAME = "hypha-parameter-server"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m parameter_server",
        description="Hypha's DiLoCo parameter server for one job (started by a worker daemon).",
        epilog=EXIT_CODES_HELP
        + "\nenvironment: HYPHA_TRANSFER_KEY, HYPHA_TRANSFER_TOKEN, HYPHA_SERVER_URL (all required)",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--socket", required=True, help="the daemon's bridge socket for this job")
    parser.add_argument("--work-dir", required=True, help="the job's work directory (created if missing)")
    job = parser.add_mutually_exclusive_group(required=True)
    # The daemon passes --job-file: the job holds slice URLs with their tokens, which ps shows on a command line.
    job.add_argument("--job-file", metavar="FILE", help="read the aggregate JOB_JSON from FILE")
    job.add_argument(
        "--job", help="the aggregate JOB_JSON inline (visible in ps), or @FILE to read it from FILE"
    )
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=0, help="port to bind; 0 picks a free one (default)")
    parser.add_argument("--public-url", default=None, help="base URL trainers use (default http://HOST:PORT)")
    parser.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    try:
        arguments = parser.parse_args(argv)
    except SystemExit as exit_:  # argparse exits 2 on errors and 0 on --help
        return int(exit_.code or 0)
    log_format = "%(asctime)s %(levelname)s %(name)s: %(message)s"
    logging.basicConfig(level=arguments.log_level, stream=sys.stderr, format=log_format)
    from worker_daemon import redaction

    redaction.install(log_format)  # no credential in a log line, whatever a library prints at DEBUG
    if not 0 <= arguments.port <= 65535:
        logger.error("--port must be in 0..65535, got %d", arguments.port)
        return EXIT_BAD_ARGUMENTS
    # Tracing, if the OTEL_* variables (inherited from the daemon) ask for it.
    from worker_daemon import telemetry

    try:
        telemetry.configure(service_name=SERVICE_NAME)
    except telemetry.TelemetryConfigError as error:
        logger.error("%s", error)
        return EXIT_BAD_ARGUMENTS
    try:
        return _main(arguments)
    finally:
        telemetry.shutdown()  # export the spans still queued (not reached after a SIGTERM's os._exit)


def _main(arguments: argparse.Namespace) -> int:
    environment = {
        name: os.environ.get(name, "")
        for name in ("HYPHA_TRANSFER_KEY", "HYPHA_TRANSFER_TOKEN", "HYPHA_SERVER_URL")
    }
    missing = [name for name, value in environment.items() if not value]
    if missing:
        logger.error("missing environment variable(s): %s", ", ".join(missing))
        return EXIT_BAD_ARGUMENTS

    from parameter_server.exceptions import JobConfigError
    from parameter_server.job import parse_job

    text = arguments.job
    try:
        if arguments.job_file is not None:
            text = Path(arguments.job_file).read_text(encoding="utf-8")
        elif text.startswith("@"):
            text = Path(text[1:]).read_text(encoding="utf-8")
        job = parse_job(text)
    except (OSError, JobConfigError) as error:
        logger.error("bad job: %s", error)
        return EXIT_BAD_ARGUMENTS

    # Heavy imports (torch, transformers via the service) only now.
    from parameter_server import memory
    from parameter_server.service import Settings

    memory.configure_allocator()  # large blocks go back to the system when freed (parameter_server/memory.py)

    work_dir = Path(arguments.work_dir).resolve()
    try:
        work_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    except OSError as error:
        logger.error("cannot use the work dir %s: %s", work_dir, error)
        return EXIT_BAD_ARGUMENTS
    settings = Settings(
        work_dir=work_dir,
        socket_path=Path(arguments.socket),
        host=arguments.host,
        port=arguments.port,
        public_url=arguments.public_url.rstrip("/") if arguments.public_url else None,
        transfer_key=environment["HYPHA_TRANSFER_KEY"],
        transfer_token=environment["HYPHA_TRANSFER_TOKEN"],
        server_url=environment["HYPHA_SERVER_URL"],
        transfer_token_file=Path(token_file)
        if (token_file := os.environ.get("HYPHA_TRANSFER_TOKEN_FILE"))
        else None,
    )
    loop = asyncio.new_event_loop()
    try:
        code = loop.run_until_complete(_run(job, settings))
        if code == EXIT_TERMINATED:
            # A model download or build may still run in a worker thread, which a normal shutdown would wait
            # for; the daemon wants us gone now (and SIGKILLs after 5 s). Rounds are checkpointed already.
            from worker_daemon import telemetry

            telemetry.flush(timeout=1.0)
            logging.shutdown()
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
        loop.run_until_complete(loop.shutdown_asyncgens())
        loop.run_until_complete(loop.shutdown_default_executor())
    finally:
        loop.close()
    return code


async def _run(job: JobConfig, settings: Settings) -> int:
    from parameter_server.exceptions import ERRORS, JobConfigError
    from parameter_server.service import Stopped, run

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signal_number in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signal_number, stop.set)
    try:
        return await run(job, settings, stop)
    except Stopped:
        logger.info("stopped by a signal")
        return EXIT_TERMINATED
    except JobConfigError as error:
        logger.error("bad job: %s", error)
        return EXIT_BAD_ARGUMENTS
    except (*ERRORS, OSError) as error:
        logger.error("%s", error)
        return EXIT_FAILED
    except Exception:
        logger.exception("unexpected failure")
        return EXIT_FAILED


if __name__ == "__main__":
    sys.exit(main())
