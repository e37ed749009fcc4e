"""``streamproc edge`` on the command line. Importing this module does not import the web stack."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import Mapping

from .settings import EdgeConfigError, add_arguments, from_arguments

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
    parser.set_defaults(func=main_edge)
    return parser


def main_edge(args: argparse.Namespace, environ: Mapping[str, str] | None = None) -> int:
    """Run the edge until SIGINT/SIGTERM. Exit codes: 0 stopped, 1 failed to start, 2 bad configuration."""
    import uvicorn

    from ..core.errors import UnknownFormat
    from .app import create_app

    try:
        settings = from_arguments(args, os.environ if environ is None else environ)
        app = create_app(settings)
    except (EdgeConfigError, UnknownFormat) as exc:
        print(f"streamproc edge: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    logging.basicConfig(
        level=settings.log_level, stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s %(message)s"
    )
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        lifespan="on",
        access_log=False,
        log_level=settings.log_level.lower(),
        timeout_graceful_shutdown=3,
    )
    server = uvicorn.Server(config)
    server.run()
    return EXIT_OK if server.started else EXIT_FAILURE


def main(argv: list[str] | None = None) -> int:
    """``python -m streamproc.edge``: the same command without the ``streamproc`` front end."""
    parser = argparse.ArgumentParser(
        prog="streamproc edge", description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_arguments(parser)
    return main_edge(parser.parse_args(argv))
