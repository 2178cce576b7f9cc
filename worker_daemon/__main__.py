"""``hypha-worker-daemon``: offer this machine's resources to a Hypha control plane.

This module parses the command line before importing anything heavy (pydantic, websockets), so ``--help``
and usage errors are instant; the daemon itself lives in :mod:`worker_daemon.connection`.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Mapping, Sequence

from worker_daemon.exceptions import ConfigError, ExitCode

PROG = "hypha-worker-daemon"
#: The traces' default ``service.name`` (``OTEL_SERVICE_NAME`` wins).
SERVICE_NAME = "hypha-worker-daemon"

DESCRIPTION = """\
Offer this machine's resources to a Hypha control plane. The daemon connects outbound to the control
plane's worker websocket, bids on the advertisements that fit its resources and price floor, and holds the
leases it wins for as long as the control plane renews them."""

EPILOG = f"""\
exit codes:
  {ExitCode.OK:d}  clean shutdown after SIGTERM or SIGINT (held leases were released)
  {ExitCode.USAGE:d}  usage or configuration error (the message names the bad flag, key or value)
  {ExitCode.TOKEN_REFUSED:d}  the control plane refused the token (missing, invalid or revoked)
  {ExitCode.UNSUPPORTED_VERSION:d}  the control plane does not support this daemon's protocol version
  {ExitCode.BENCHMARK_FAILED:d}  (benchmark subcommand) the benchmark failed or timed out
  {ExitCode.SUPERSEDED:d}  another daemon connected with the same token and took the worker over (run one
     daemon per token; a supervisor should not restart on this code, or the two take turns)
  Network failures are not fatal: the daemon reconnects with exponential backoff.

environment:
  HYPHA_SERVER             default for --server
  HYPHA_WORKER_TOKEN       the worker token (HYPHA_TOKEN, its older name, is read too)
  HYPHA_WORKER_TOKEN_FILE  a file holding the token, when no token is set (or HYPHA_TOKEN_FILE)
  HYPHA_WORK_DIR           overrides work_dir from the config file (--work-dir overrides both)
  HYPHA_LOG_LEVEL          default for --log-level
  OTEL_*                   OpenTelemetry tracing, off unless e.g. OTEL_EXPORTER_OTLP_ENDPOINT is set
  Pass the token by file or environment: --token puts it in the process list (ps) for every user to see.

config file (TOML, Hypha's worker keys): work_dir, [resources] cpu/memory/storage/gpu,
[offer] price/floor/strategy, [[executors]] class/name/runtime/cmd/args. Absent resources are measured.
Ours: kill_grace, benchmark, slowdown, byzantine, [parameter_server] host/port/public_url/reachable.

benchmark:
  At start (unless --no-benchmark or benchmark = false) and when the control plane asks, the daemon runs a
  short training benchmark (a fixed small model, AdamW, a few seconds, in a child process) and reports its
  score, training samples per second, with its resources; it makes no offers while it runs.
  `{PROG} benchmark [--config FILE] [--slowdown F] [--json]` runs it once, prints the score
  and exits."""

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")


class _VersionAction(argparse.Action):
    """``--version``, looked up only when asked for (importlib.metadata is not free)."""

    def __init__(
        self, option_strings: Sequence[str], dest: str = argparse.SUPPRESS, **kwargs: object
    ) -> None:
        super().__init__(option_strings, dest=dest, nargs=0, help="print the version and exit")

    def __call__(self, parser: argparse.ArgumentParser, *args: object, **kwargs: object) -> None:
        from importlib import metadata

        try:
            version = metadata.version("hypha")
        except metadata.PackageNotFoundError:
            version = "0.1.0"
        print(f"{PROG} {version}")
        parser.exit()


def build_parser() -> argparse.ArgumentParser:
    """The command line parser (exposed for documentation and tests)."""
    parser = argparse.ArgumentParser(
        prog=PROG,
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--server",
        metavar="URL",
        help="the control plane, http(s)://host:port[/prefix] or its ws(s)://…/ws/worker/ URL "
        "(default: $HYPHA_SERVER)",
    )
    parser.add_argument(
        "--token",
        help="the worker token; visible in ps, prefer --token-file or $HYPHA_WORKER_TOKEN "
        "(default: $HYPHA_WORKER_TOKEN, or the file $HYPHA_WORKER_TOKEN_FILE names)",
    )
    parser.add_argument("--token-file", metavar="PATH", help="read the worker token from this file")
    parser.add_argument("--config", metavar="FILE", help="worker config TOML (default: none, all defaults)")
    parser.add_argument(
        "--work-dir", metavar="DIR", help="base directory for job work dirs (overrides work_dir)"
    )
    parser.add_argument(
        "--price", type=float, metavar="P", help="counter-offer price (overrides offer.price)"
    )
    parser.add_argument(
        "--floor", type=float, metavar="F", help="lowest bid to accept (overrides offer.floor)"
    )
    parser.add_argument(
        "--ps-host",
        metavar="HOST",
        help="address the built-in parameter server binds (overrides parameter_server.host)",
    )
    parser.add_argument(
        "--ps-port",
        type=int,
        metavar="PORT",
        help="port the built-in parameter server binds, 0 for any (overrides parameter_server.port)",
    )
    parser.add_argument(
        "--ps-public-url",
        metavar="URL",
        help="base URL trainers use to reach the parameter server (overrides parameter_server.public_url)",
    )
    parser.add_argument(
        "--reachable",
        choices=["true", "false", "auto"],
        help="whether trainers can connect to the parameter server's public URL: false behind NAT or a "
        "firewall (the control plane's relay carries the transfers) (overrides parameter_server.reachable; "
        "default auto: not said)",
    )
    parser.add_argument(
        "--benchmark",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="run the worker benchmark at start (overrides benchmark; default: on)",
    )
    parser.add_argument(
        "--slowdown",
        type=float,
        metavar="FACTOR",
        help="experiments and tests only: make this worker deliberately FACTOR (>= 1) times slower; "
        "executors get HYPHA_SLOWDOWN and sleep (FACTOR-1) x each step's time, and so does the benchmark "
        "(overrides slowdown; default 1.0)",
    )
    parser.add_argument(
        "--byzantine",
        metavar="MODE",
        help="experiments and tests only: the trainer sends a deliberately corrupted pseudo-gradient, MODE one "
        "of scale:K (K x the honest one, e.g. scale:100), sign_flip, random (Gaussian of the honest norm), zero; "
        "executors get HYPHA_BYZANTINE (overrides byzantine; default: honest)",
    )
    parser.add_argument(
        "--log-level",
        type=str.upper,
        choices=LOG_LEVELS,
        default=None,
        help="log verbosity on stderr (default: $HYPHA_LOG_LEVEL or INFO)",
    )
    parser.add_argument("--version", action=_VersionAction)
    return parser


def build_benchmark_parser() -> argparse.ArgumentParser:
    """The parser of ``hypha-worker-daemon benchmark``."""
    parser = argparse.ArgumentParser(
        prog=f"{PROG} benchmark",
        description="Run the worker benchmark once on this machine (as the daemon would: the config's "
        "device, threads and slowdown), print its score in training samples per second, and exit.",
    )
    parser.add_argument("--config", metavar="FILE", help="worker config TOML (default: none, all defaults)")
    parser.add_argument(
        "--slowdown", type=float, metavar="FACTOR", help="as the daemon's --slowdown (overrides slowdown)"
    )
    parser.add_argument("--json", action="store_true", help="print the result as one JSON object")
    return parser


def benchmark_main(argv: Sequence[str]) -> int:
    """``hypha-worker-daemon benchmark``: run the benchmark once and print the score."""
    args = build_benchmark_parser().parse_args(argv)
    configure_logging(os.environ.get("HYPHA_LOG_LEVEL", "WARNING").upper())
    import asyncio

    from worker_daemon import benchmark
    from worker_daemon.config import load_config
    from worker_daemon.exceptions import BenchmarkError

    try:
        config = load_config(args.config, slowdown=args.slowdown)
    except ConfigError as error:
        print(f"{PROG} benchmark: error: {error}", file=sys.stderr)
        return ExitCode.USAGE
    try:
        result = asyncio.run(benchmark.measure(config))
    except BenchmarkError as error:
        print(f"{PROG} benchmark: error: {error}", file=sys.stderr)
        return error.exit_code
    except KeyboardInterrupt:
        return ExitCode.OK
    print(result.model_dump_json() if args.json else f"benchmark: {benchmark.describe(result)}")
    return ExitCode.OK


#: Where the worker token may come from besides the flags, in order: the environment variables holding it, and
#: those naming a file that holds it (the ``HYPHA_TOKEN*`` names are the older ones, still read).
TOKEN_VARIABLES = ("HYPHA_WORKER_TOKEN", "HYPHA_TOKEN")
TOKEN_FILE_VARIABLES = ("HYPHA_WORKER_TOKEN_FILE", "HYPHA_TOKEN_FILE")
TOKEN_FLAG_WARNING = (
    "warning: --token puts the worker token in the process list (ps); "
    "use --token-file PATH or HYPHA_WORKER_TOKEN instead"
)


def resolve_token(*, token: str | None, token_file: str | None, environ: Mapping[str, str]) -> str:
    """The worker token: ``--token``, then ``--token-file``, then ``HYPHA_WORKER_TOKEN`` (or ``HYPHA_TOKEN``),
    then the file named by ``HYPHA_WORKER_TOKEN_FILE`` (or ``HYPHA_TOKEN_FILE``), contents stripped. Raises
    :class:`ConfigError` when none is set, the file cannot be read, or the token is empty."""
    variable = next((name for name in TOKEN_VARIABLES if environ.get(name)), None)
    file_variable = next((name for name in TOKEN_FILE_VARIABLES if environ.get(name)), None)
    if token is not None:
        source, value = "--token", token
    elif token_file is not None:
        source, value = f"--token-file {token_file}", _read_token_file(token_file, source="--token-file")
    elif variable is not None:
        source, value = variable, environ[variable]
    elif file_variable is not None:
        path = environ[file_variable]
        source, value = f"{file_variable} {path}", _read_token_file(path, source=file_variable)
    else:
        raise ConfigError(
            "no worker token: pass --token-file PATH, or set HYPHA_WORKER_TOKEN or HYPHA_WORKER_TOKEN_FILE"
        )
    value = value.strip()
    if not value:
        raise ConfigError(f"the worker token from {source} is empty")
    return value


def _read_token_file(path: str, *, source: str) -> str:
    try:
        with open(path, encoding="utf-8") as file:
            return file.read()
    except FileNotFoundError:
        raise ConfigError(f"{source}: token file {path} not found") from None
    except (OSError, UnicodeDecodeError) as error:
        raise ConfigError(f"{source}: token file {path} cannot be read: {error}") from None


LOG_FORMAT = "%(asctime)s %(levelname)-7s %(name)s: %(message)s"


def configure_logging(level: str) -> None:
    """Timestamped lines on stderr, one per event, so an operator can follow the daemon. Credentials are
    masked in every line (websockets logs the handshake's ``Authorization`` header at DEBUG)."""
    from worker_daemon import redaction

    logging.basicConfig(stream=sys.stderr, level=level, format=LOG_FORMAT, force=True)
    redaction.install(LOG_FORMAT)
    if level != "DEBUG":
        # websockets reports every handshake and keepalive detail at INFO; we log what matters ourselves.
        logging.getLogger("websockets").setLevel(logging.WARNING)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the daemon; return the process exit code (see the ``--help`` epilog)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["benchmark"]:
        return benchmark_main(argv[1:])
    parser = build_parser()
    args = parser.parse_args(argv)
    environ = os.environ
    log_level = args.log_level or environ.get("HYPHA_LOG_LEVEL", "INFO").upper()
    if log_level not in LOG_LEVELS:
        parser.error(f"HYPHA_LOG_LEVEL={log_level!r} is not one of {', '.join(LOG_LEVELS)}")
    server = args.server or environ.get("HYPHA_SERVER")
    if not server:
        parser.error("no control plane address: pass --server URL or set HYPHA_SERVER")
    try:
        token = resolve_token(token=args.token, token_file=args.token_file, environ=environ)
    except ConfigError as error:
        parser.error(str(error))
    if args.token is not None:
        print(f"{PROG}: {TOKEN_FLAG_WARNING}", file=sys.stderr)
    configure_logging(log_level)
    # Light (opentelemetry itself is imported only when tracing is on), but not needed by --help.
    from worker_daemon import telemetry

    try:
        # Heavy imports only now that the arguments are known to be usable.
        from worker_daemon.config import load_config, websocket_url

        url = websocket_url(server)
        config = load_config(
            args.config,
            environ=environ,
            work_dir=args.work_dir,
            price=args.price,
            floor=args.floor,
            ps_host=args.ps_host,
            ps_port=args.ps_port,
            ps_public_url=args.ps_public_url,
            reachable=args.reachable,
            benchmark=args.benchmark,
            slowdown=args.slowdown,
            byzantine=args.byzantine,
        )
        # Tracing, if the OTEL_* variables ask for it (opentelemetry is imported only then).
        telemetry.configure(service_name=SERVICE_NAME)
    except (ConfigError, telemetry.TelemetryConfigError) as error:
        print(f"{PROG}: error: {error}", file=sys.stderr)
        return ExitCode.USAGE
    except KeyboardInterrupt:
        return ExitCode.OK

    logger = logging.getLogger("worker_daemon")
    logger.info("config: %s", config.summary())
    try:
        import asyncio

        from worker_daemon.connection import run_daemon

        return asyncio.run(
            run_daemon(
                config=config,
                server_url=url,
                token=token,
                install_signal_handlers=True,
                benchmark_at_start=config.benchmark,
                warm_start=config.warm_start,
            )
        )
    except KeyboardInterrupt:
        # A Ctrl-C before the signal handlers were installed: nothing was held yet.
        return ExitCode.OK
    finally:
        telemetry.shutdown()  # export the spans still queued


if __name__ == "__main__":
    sys.exit(main())
