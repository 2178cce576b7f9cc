"""``hypha-data-node``: serve a dataset directory's slices over HTTP and register it with the control plane.

    HYPHA_DATA_NODE_TOKEN=hd_… hypha-data-node --server URL --dataset DIR [--host 127.0.0.1] [--port 0] \
        [--public-url URL] [--reachable true|false|auto] [--inline-limit BYTES]

The token comes from ``$HYPHA_DATA_NODE_TOKEN``, ``--token-file PATH`` or ``$HYPHA_DATA_NODE_TOKEN_FILE``;
``--token`` works too but puts it in the process list (``ps``) for every user of the machine to read.

The dataset's name is DIR's basename; its slices are DIR/00000.safetensors, … (see ``hypha-data``). The node
hashes every slice, starts listening, registers (retrying while the control plane is unreachable), logs one
line, and serves until SIGTERM or SIGINT. With ``--reachable false`` (behind NAT) it also publishes every slice
not published yet to the control plane's store, in the background (``data_node.publish``). Downloads need a
slice token signed with the download key the control plane answers the registration with
(``data_node.tokens``); until then they get 503.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path

EXIT_OK = 0
EXIT_USAGE = 2
EXIT_TOKEN_REFUSED = 3
EXIT_DATASET_INVALID = 4
EXIT_REGISTRATION_REFUSED = 5
EXIT_CANNOT_LISTEN = 6

EXIT_CODES = f"""exit codes:
  {EXIT_OK}  stopped by SIGTERM/SIGINT
  {EXIT_USAGE}  bad command line
  {EXIT_TOKEN_REFUSED}  the control plane refused the token (401)
  {EXIT_DATASET_INVALID}  DIR is not a dataset (no slices 00000.safetensors…, a gap, or a name that is no slug)
  {EXIT_REGISTRATION_REFUSED}  the control plane refused the dataset (400, or 409: other slices under that name),
     or its answer held no download key
  {EXIT_CANNOT_LISTEN}  cannot listen on --host/--port
"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hypha-data-node",
        description=__doc__.split("\n\n", 1)[0].strip("`").split(": ", 1)[1],
        epilog=EXIT_CODES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--server", required=True, help="control plane base URL, e.g. https://hypha.example")
    parser.add_argument(
        "--token", help="data node token hd_…; visible in ps, prefer $HYPHA_DATA_NODE_TOKEN or --token-file"
    )
    parser.add_argument(
        "--token-file",
        metavar="PATH",
        default=os.environ.get("HYPHA_DATA_NODE_TOKEN_FILE"),
        help="read the data node token from this file (default: $HYPHA_DATA_NODE_TOKEN_FILE)",
    )
    parser.add_argument("--dataset", required=True, type=Path, metavar="DIR", help="dataset directory")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=0, help="port to listen on (default 0: any free port)")
    parser.add_argument(
        "--public-url", help="base URL trainers download from (default http://HOST:PORT as bound)"
    )
    parser.add_argument(
        "--reachable",
        choices=["true", "false", "auto"],
        default="auto",
        help="whether trainers can connect to the public URL: false behind NAT or a firewall, and the "
        "node then publishes its slices to the control plane's store, from which trainers download them "
        "(default auto: not said, taken as reachable; registered with the dataset)",
    )
    parser.add_argument(
        "--inline-limit",
        type=_byte_count,
        default=1 << 20,
        metavar="BYTES",
        help="largest slice read straight into its answer, and the largest a batch request may hold; "
        "larger slices are streamed from the file (default 1048576; 0 streams every slice and refuses "
        "batches: for slices on a disk too slow to read on the event loop)",
    )
    parser.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    return parser


def _byte_count(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of bytes") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text!r}: a number of bytes cannot be negative")
    return value


async def run(
    *,
    server: str,
    token: str,
    directory: Path,
    host: str,
    port: int,
    public_url: str | None,
    reachable: str = "auto",
    inline_limit: int = 1 << 20,
) -> int:
    import asyncio
    import signal

    from aiohttp import web

    from data_node.server import (
        RegistrationRefused,
        ServedDataset,
        TokenRefused,
        build_app,
        log,
        register,
        set_download_key,
    )
    from data_node.slices import InvalidDatasetDirectory, dataset_name, scan

    try:
        dataset = ServedDataset(name=dataset_name(directory), slices=scan(directory))
    except InvalidDatasetDirectory as error:
        log.error("%s", error)
        return EXIT_DATASET_INVALID

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)

    # Answers 503 to downloads until the registration brings the download key.
    app = build_app(dataset, inline_limit=inline_limit)
    # No access log: a slice URL's query holds its download token.
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    try:
        site = web.TCPSite(runner, host, port)
        try:
            await site.start()
        except OSError as error:
            log.error("cannot listen on %s:%s: %s", host, port, error)
            return EXIT_CANNOT_LISTEN
        bound_host, bound_port = runner.addresses[0][:2]
        url = public_url or f"http://{host if ':' not in host else f'[{host}]'}:{bound_port}"
        registration = asyncio.create_task(
            register(
                server=server,
                token=token,
                dataset=dataset,
                public_url=url.rstrip("/"),
                reachable=_reachable(reachable),
            )
        )
        stopping = asyncio.create_task(stop.wait())
        await asyncio.wait({registration, stopping}, return_when=asyncio.FIRST_COMPLETED)
        if not registration.done():  # SIGTERM while the control plane was still unreachable
            registration.cancel()
            return EXIT_OK
        try:
            answer = registration.result()
        except TokenRefused as error:
            log.error("%s: check the token", error)
            return EXIT_TOKEN_REFUSED
        except RegistrationRefused as error:
            log.error("%s", error)
            return EXIT_REGISTRATION_REFUSED
        download_key = answer.get("download_key") if isinstance(answer, dict) else None
        if not isinstance(download_key, str) or not download_key:
            log.error("the control plane's answer holds no download_key: is it older than this data node?")
            return EXIT_REGISTRATION_REFUSED
        set_download_key(app, download_key)
        log.info(
            "serving dataset %s (%d slices, %d bytes) at %s on %s:%s; registered with %s",
            dataset.name,
            len(dataset.slices),
            dataset.total_bytes,
            url,
            bound_host,
            bound_port,
            server,
        )
        publishing = None
        if reachable == "false":
            # Nobody can download from this node: its slices go to the control plane's store, from which
            # trainers download them, while the node serves (docs/transfers.md, "Data nodes behind NAT").
            publishing = asyncio.create_task(_publish(server=server, token=token, dataset=dataset))
        try:
            await stopping
        finally:
            if publishing is not None and not publishing.done():
                publishing.cancel()
                await asyncio.gather(publishing, return_exceptions=True)
        return EXIT_OK
    finally:
        await runner.cleanup()


async def _publish(*, server: str, token: str, dataset) -> None:
    """Publish ``dataset``'s slices (:mod:`data_node.publish`); a refusal is logged, the node serves on."""
    from data_node.publish import Publisher, PublishRefused
    from data_node.server import log

    try:
        await Publisher(server=server, token=token, dataset=dataset.name, slices=dataset.slices).run()
    except PublishRefused as error:
        log.error("publishing the slices of %s stopped: %s", dataset.name, error)
    except Exception:  # a bug must not end the node silently: it still answers health checks
        log.exception("publishing the slices of %s stopped", dataset.name)


def _reachable(word: str) -> bool | str:
    """``--reachable``'s word as the registration spells it: true, false or "auto"."""
    return word if word == "auto" else word == "true"


def _token(parser: argparse.ArgumentParser, arguments: argparse.Namespace) -> str:
    """The data node token: ``--token`` (with a warning), else ``$HYPHA_DATA_NODE_TOKEN``, else the file of
    ``--token-file`` / ``$HYPHA_DATA_NODE_TOKEN_FILE``; a usage error (exit 2) when none gives one."""
    if arguments.token:
        print(
            "hypha-data-node: warning: --token puts the token in the process list (ps); "
            "use --token-file PATH or HYPHA_DATA_NODE_TOKEN instead",
            file=sys.stderr,
        )
        return arguments.token.strip()
    token = os.environ.get("HYPHA_DATA_NODE_TOKEN", "").strip()
    if not token and arguments.token_file:
        try:
            token = Path(arguments.token_file).read_text(encoding="utf-8").strip()
        except (OSError, UnicodeDecodeError) as error:
            parser.error(f"token file {arguments.token_file} cannot be read: {error}")
    if not token:
        parser.error("no token: set HYPHA_DATA_NODE_TOKEN, or pass --token-file PATH (or --token)")
    return token


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    arguments = parser.parse_args(argv)
    token = _token(parser, arguments)
    import asyncio
    import logging

    from worker_daemon import redaction

    log_format = "%(asctime)s %(levelname)s %(name)s: %(message)s"
    logging.basicConfig(level=arguments.log_level, format=log_format)
    redaction.install(log_format)  # no token in a log line, whatever a library prints at DEBUG
    return asyncio.run(
        run(
            server=arguments.server,
            token=token,
            directory=arguments.dataset,
            host=arguments.host,
            port=arguments.port,
            public_url=arguments.public_url,
            reachable=arguments.reachable,
            inline_limit=arguments.inline_limit,
        )
    )


if __name__ == "__main__":
    sys.exit(main())
