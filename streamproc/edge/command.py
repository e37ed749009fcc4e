"""``streamproc edge`` on the command line. Importing this module does not import the web stack."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from typing import TYPE_CHECKING, Mapping

from ..config import print_config, unknown_environment_warnings
from .settings import SCHEMA, EdgeConfigError, add_arguments

if TYPE_CHECKING:
    import ssl

EXIT_OK, EXIT_FAILURE, EXIT_USAGE = 0, 1, 2

DESCRIPTION = """\
Serve results over HTTP: GET /v1/results/<request_id> streams them as server-sent events
(data: <result body> ... data: [DONE]); Accept: application/json or ?stream=false answers with one
JSON body. GET / is a live page, /healthz and /metrics are for operators. Clients can attach late
and resume with Last-Event-ID when a JetStream stream stores P.results.> (--ensure-results-stream
creates one); without it only results published after the client connected are seen."""


def add_cli(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register ``edge`` on the ``streamproc`` sub-command parser; ``args.func(args)`` runs it."""
    parser = subparsers.add_parser(
        "edge",
        help="serve results as server-sent events, with a live page",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_arguments(parser)
    add_print_config(parser)
    parser.set_defaults(func=main_edge)
    return parser


def add_print_config(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--print-config", action="store_true",
                        help="validate the settings as start-up would, print each value with its source "
                             "(default, env, flag) as JSON, and exit")


def main_edge(args: argparse.Namespace, environ: Mapping[str, str] | None = None) -> int:
    """Run the edge until SIGINT/SIGTERM. Exit codes: 0 stopped, 1 failed to start, 2 bad configuration."""
    import anyio

    from ..cli import collect_rarely
    from ..core.errors import StreamprocError, UnknownFormat
    from ..logs import configure as configure_logging
    from ..logs import log_event
    from ..nats.connection import connect_options
    from .app import create_app
    from .connections import raise_descriptor_limit
    from .server import server_class, server_config
    from .heap import tune_allocator
    from ..core.errors import NatsPyUnsupported
    from .pending import require_support

    environ = os.environ if environ is None else environ
    try:
        settings, origin = SCHEMA.explain_arguments(args, environ)
        for line in unknown_environment_warnings(environ, "edge"):
            print(f"streamproc edge: warning: {line}", file=sys.stderr)
        try:
            app = create_app(settings)
        except UnknownFormat as exc:
            raise EdgeConfigError(f"invalid {origin['format']}={settings.format!r}: {exc}") from None
        except ValueError as exc:  # OTEL_* variables naming no installed exporter (streamproc.tracing)
            raise EdgeConfigError(str(exc)) from None
        connect_options(settings)  # unreadable credential or certificate files: exit 2 before serving
        tls = check_tls(settings)
    except EdgeConfigError as exc:
        print(f"streamproc edge: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    if getattr(args, "print_config", False):
        print(print_config(settings, origin))
        return EXIT_OK
    configure_logging(settings.log_level, settings.log_format)
    source = app.state.edge.source
    try:
        # Here before the server is set up; the reason goes to the source, whose start then checks no more.
        source.support = require_support()
    except NatsPyUnsupported as exc:
        print(f"streamproc edge: error: {exc}", file=sys.stderr)
        return EXIT_FAILURE
    tune_allocator()  # this process serves results only: freed bodies go back to the system (heap.py)
    descriptors = raise_descriptor_limit(settings.max_connections)
    if descriptors is not None:
        log_event(logging.getLogger("streamproc.edge"), logging.WARNING, "descriptor_limit", problem=descriptors)
    config = server_config(app, settings, tls=tls)  # the key checked is the key served: read once
    server = server_class(app.state.edge.stop_streams)(config)
    quiet = _StartupFailureFilter(app)
    logging.getLogger("uvicorn.error").addFilter(quiet)

    async def serve() -> int:
        # Connect first, with our own signal handling: Uvicorn only watches SIGTERM/SIGINT once it
        # serves, and a connect that waits for NATS must stop on them too.
        with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            async with anyio.create_task_group() as tasks:

                async def stop_on_signal() -> None:
                    async for _ in signals:
                        tasks.cancel_scope.cancel()
                        return

                tasks.start_soon(stop_on_signal)
                failure: StreamprocError | None = None
                try:
                    await source.start()
                except StreamprocError as exc:
                    failure = exc
                tasks.cancel_scope.cancel()
            if failure is not None:
                await source.stop()
                app.state.startup_error = failure
                return EXIT_FAILURE
            if source.nc is None or not source.connected:  # a signal while connecting
                await source.stop()
                return EXIT_OK
        await server.serve()
        return EXIT_OK if server.started else EXIT_FAILURE

    collect_rarely()  # as the processor: GC pauses were part of the SSE tail (docs/benchmarks.md)
    failed_exit = False
    code = EXIT_FAILURE
    try:
        code = anyio.run(serve, backend_options={"use_uvloop": _use_uvloop(environ)})
    except SystemExit as exc:  # Uvicorn's sys.exit(1) for a busy port
        failed_exit = exc.code not in (None, 0)
    finally:
        logging.getLogger("uvicorn.error").removeFilter(quiet)
    failure = getattr(app.state, "startup_error", None)
    if failure is not None:  # NATS unreachable or refusing us, a mismatched results stream: one line
        print(f"streamproc edge: error: {failure}", file=sys.stderr)
        return EXIT_FAILURE
    if failed_exit:  # Uvicorn logged why (a busy --port, an address not ours); say it in the one error line
        why = quiet.last_error or "the HTTP server did not start"
        print(f"streamproc edge: error: cannot serve on {settings.host}:{settings.port}: {why}", file=sys.stderr)
        return EXIT_FAILURE
    return code


def _use_uvloop(environ: Mapping[str, str]) -> bool:
    """STREAMPROC_EDGE_LOOP=uvloop (uvloop installed by hand) runs the edge on uvloop: measured
    ~10% less CPU per SSE event, and RSS after slow readers 81 instead of 114 MiB
    (docs/benchmarks.md); opt-in until the edge-memory work decides on it."""
    if environ.get("STREAMPROC_EDGE_LOOP", "") != "uvloop":
        return False
    import uvloop  # noqa: F401 - a clear ImportError when asked for and missing

    return True


def check_tls(settings) -> ssl.SSLContext | None:
    """The HTTPS context the edge serves with, loaded now: an unreadable, encrypted or mismatched
    certificate/key pair fails as bad configuration (exit 2), in one line, instead of as Uvicorn's
    traceback once NATS is connected. None without --tls-cert-file."""
    if not settings.tls_cert_file:
        return None
    import ssl

    from .server import tls_context
    from .settings import EdgeConfigError

    try:
        return tls_context(settings)
    except (OSError, ssl.SSLError, ValueError) as exc:  # ValueError: no_key_passphrase
        raise EdgeConfigError(f"cannot use --tls-cert-file {settings.tls_cert_file!r} with --tls-key-file "
                              f"{settings.tls_key_file!r}: {exc}") from None


# uvicorn.protocols.http.h11_impl (and httptools_impl) RequestResponseCycle.run_asgi, when the app returns mid-body
STALLED_STREAM_MESSAGE = "ASGI callable returned without completing response."


class _StartupFailureFilter(logging.Filter):
    """Once the app recorded a start-up error it reports itself, drop Uvicorn's traceback of it;
    drop Uvicorn's error line for a stream the edge closed because its client stopped reading."""

    def __init__(self, app) -> None:
        super().__init__()
        self._app = app
        self.last_error: str | None = None  # Uvicorn's last error line (its sys.exit(1) says nothing)

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno >= logging.ERROR:
            self.last_error = record.getMessage()[:500]
        if record.msg == STALLED_STREAM_MESSAGE:  # a stream dropped after --write-timeout: counted and logged
            return False  # as event=stream_stalled; an error line per slow client would be log spam
        if getattr(self._app.state, "startup_error", None) is None or record.levelno < logging.ERROR:
            return True
        return False


def main(argv: list[str] | None = None) -> int:
    """``python -m streamproc.edge``: the same command without the ``streamproc`` front end."""
    parser = argparse.ArgumentParser(
        prog="streamproc edge", description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_arguments(parser)
    add_print_config(parser)
    return main_edge(parser.parse_args(argv))
