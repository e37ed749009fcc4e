"""``streamproc`` command line: run, codecs, simulate, demo, token (and edge, in streamproc.edge.command).

User errors (bad settings, unknown format, unreachable NATS, missing nats-server) print one
clear line on stderr and exit non-zero, without a traceback.
Exit codes: 0 success, 1 failure (verification failed, start-up failed), 2 bad usage or settings.
"""

from __future__ import annotations

import argparse
import gc
import os
import signal
import sys
import time
import typing
from typing import Sequence

import anyio
import msgspec

from . import __version__, catalog, compiled, config, logs
from .core.codec import CodecOptions
from .core.errors import ConfigError, StreamprocError
from .core.wire import check_request_id

EXIT_OK, EXIT_FAILURE, EXIT_USAGE = 0, 1, 2


def _setup_logging(level: str, fmt: str = "logfmt") -> None:
    logs.configure(level, fmt)  # type: ignore[arg-type]


def warn_unknown_environment(command: str) -> None:
    for line in config.unknown_environment_warnings(os.environ, command):
        print(f"streamproc {command}: warning: {line}", file=sys.stderr)


def _settings(args: argparse.Namespace) -> tuple[config.Settings, dict[str, str]]:
    """The processor settings of ``run`` or ``simulate``, validated as start-up would validate them
    (credential and certificate files read), with the source of each value."""
    from .nats.connection import connect_options

    settings, origin = config.PROCESSOR.explain_arguments(args, os.environ)
    warn_unknown_environment(args.command)
    check_format(settings.format, origin["format"])
    check_format_options(settings.format, settings.codec_options(), origin["format_option"])
    connect_options(settings)  # unreadable credential or certificate files: exit 2 before connecting
    return settings, origin


def _options(schema: config.SettingsSchema, args: argparse.Namespace):
    """A command's own settings (``simulate``, ``demo``, ``token``, ``codecs``: flags over defaults).
    A misspelt ``STREAMPROC_*`` variable is reported by every command, as by ``run``."""
    if args.command not in ("run", "simulate"):  # those warn while reading the processor's settings
        warn_unknown_environment(args.command)
    return schema.explain_arguments(args, {})


def printed_config(args: argparse.Namespace, text: str) -> bool:
    """``--print-config``: once every check start-up makes has passed, print and stop (exit 0)."""
    if getattr(args, "print_config", False):
        print(text)
        return True
    return False


def check_format(name: str, origin: str) -> None:
    """An unknown --format is bad configuration (exit 2) for every command, found before connecting."""
    from .core.errors import UnknownFormat

    try:
        catalog.Catalog(CodecOptions())(name)
    except UnknownFormat as exc:  # CodecUnavailable too: its import or constructor failed, saying why
        raise ConfigError(f"invalid {origin}={name!r}: {exc}") from None


def check_format_options(name: str, options: CodecOptions, origin: str) -> None:
    """``--format-option`` mistakes are bad configuration (exit 2): a value the ``--format`` codec
    refuses, and a key no installed codec reads, a typo that would silently leave the codec's default
    in place (docs/configuration.md has the one a user made). While an installed codec declares
    no keys (``Codec.option_keys`` None) the key may be that one's: a warning only."""
    from .core.errors import CodecUnavailable

    if not options.format_options:
        return
    try:
        catalog.Catalog(options)(name)
    except CodecUnavailable as exc:
        raise ConfigError(f"invalid {origin}: {exc}") from None
    keys = catalog.unread_option_keys(options)
    if not keys.unread:
        return
    text = (f"{origin}: {', '.join(map(repr, keys.unread))} is read by no installed codec "
            f"(keys read: {', '.join(keys.read) or 'none'})")
    if not keys.undeclared:
        raise ConfigError(f"invalid {text}")
    print(f"streamproc: warning: {text}; codecs {', '.join(keys.undeclared)} do not declare theirs",
          file=sys.stderr)


# ------------------------------------------------------------------------- commands

GC_THRESHOLDS = (50_000, 20, 100)


def collect_rarely() -> None:
    """Called by ``run`` and ``edge`` once start-up is done. Per message both allocate a handful of
    short-lived container objects; with CPython's default gen-0 threshold (700) that is a collection
    every ~150 messages, each walking every long-lived object. Freezing start-up objects and raising
    the threshold keeps collections rare and cheap (processor: benchmarks/passthrough.py; edge: 29
    collections in 6 s at 2,000 events/s, pauses up to 11 ms, each one in the SSE tail,
    docs/benchmarks.md "Where the SSE tail comes from"); memory stays bounded because nothing on
    the hot path forms reference cycles."""
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLDS)


def cmd_run(args: argparse.Namespace) -> int:
    from .nats.processor import Processor

    settings, origin = _settings(args)
    # Logging first: building the Processor logs (tracing_enabled), and a line logged before the
    # handler exists is lost.
    _setup_logging(settings.log_level, settings.log_format)
    processor = Processor(settings)  # OTEL_* variables naming no installed exporter: exit 2 here too
    if printed_config(args, config.print_config(settings, origin)):
        if processor.tracing is not None:
            processor.tracing.shutdown()
        return EXIT_OK
    collect_rarely()
    anyio.run(processor.run)
    return EXIT_OK


def cmd_codecs(args: argparse.Namespace) -> int:
    settings, origin = _options(config.CODECS, args)
    if printed_config(args, config.print_config(settings, origin)):
        return EXIT_OK  # no settings: an empty object, so every command answers --print-config alike
    rows = catalog.describe()
    if not rows:
        print("no codecs installed (entry-point group streamproc.codecs is empty)")
        return EXIT_FAILURE
    headers = ("NAME", "DISTRIBUTION", "DESCRIPTION")
    widths = [max(len(headers[i]), *(len(r[i]) for r in rows)) for i in range(2)]
    print(f"{headers[0]:<{widths[0]}}  {headers[1]:<{widths[1]}}  {headers[2]}")
    for name, dist, description in rows:
        print(f"{name:<{widths[0]}}  {dist:<{widths[1]}}  {description}")
    return EXIT_OK


def cmd_simulate(args: argparse.Namespace) -> int:
    from .sim import traffic
    from .sim.demo import print_report

    settings, origin = _settings(args)
    opts, opts_origin = _options(config.SIMULATE, args)
    try:
        worker = catalog.worker_for(settings.format)
    except LookupError as exc:
        raise ConfigError(str(exc)) from None
    if printed_config(args, config.print_config(settings, origin, config.SIMULATE_CONNECTION,
                                                more=config.explained(opts, opts_origin))):
        return EXIT_OK
    _setup_logging(settings.log_level, settings.log_format)
    # planned and scheduled a window at a time, as published: memory does not grow with --requests
    windows = traffic.windows(traffic.planned(settings.format, requests=opts.requests, mode=opts.mode,
                                              stream=opts.stream, seed=opts.seed, worker=worker),
                              seed=opts.seed, shuffle=opts.shuffle, duplicates=opts.duplicates)

    async def main() -> int:
        from .sim.demo import DemoReport
        from .sim.verification import Verifier
        from .nats import connection

        nc = await connection.connect(settings, name="streamproc-simulate", reconnect=False)
        try:
            # Against a JetStream chunk stream, publish durably: a chunk the stream refuses is an error
            # here, not a silent loss (a core publish to a full stream vanishes without a word).
            from .nats.streams import find_stream
            durable = await find_stream(nc.jetstream(timeout=2), settings.subjects.chunk("probe", "agg")) is not None
            if not opts.verify:
                messages = 0
                for _, window in windows:
                    messages += await traffic.publish(nc, settings.subjects, window, format=settings.format,
                                                      durable=durable)
                print(f"published {messages} chunks for {opts.requests} requests "
                      f"({opts.mode}, format {settings.format}) on {settings.subjects.prefix}.chunks.>")
                return EXIT_OK
            started = time.perf_counter()
            async with Verifier(nc, settings.subjects, worker) as verifier:
                published = await verifier.publish(windows, format=settings.format, durable=durable,
                                                   timeout=opts.timeout)
                timed_out = published.timed_out
                if timed_out is None:
                    try:
                        await verifier.drain(opts.timeout)
                    except TimeoutError as exc:
                        timed_out = str(exc)
                verifier.close()
            report = DemoReport(settings.format, config.redact_url(settings.nats_url), published.messages,
                                time.perf_counter() - started, verifier.summary(), verifier.problems, None,
                                timed_out, title="streamproc simulate")
            if timed_out is not None and report.total.results == 0:  # nothing at all: not a slow processor
                prefix = settings.subjects.prefix
                report.timed_out = (f"{timed_out}; no result arrived at all: is a processor (`streamproc run "
                                    f"--prefix {prefix}`) reading {prefix}.chunks.> on this server, and may "
                                    f"this NATS user subscribe to {prefix}.results.>?")
            print_report(report)
            return EXIT_OK if report.ok else EXIT_FAILURE
        finally:
            await nc.close()

    return anyio.run(until_signal, main)


async def until_signal(main: typing.Callable[[], typing.Awaitable[int]], *,
                       scope: anyio.CancelScope | None = None) -> int:
    """``main()``, stopped at once by SIGTERM/SIGINT in any state (connecting, publishing, verifying):
    a stop the operator asked for exits 0, as for ``run`` and ``edge`` (docs/configuration.md, exit
    codes). A signal cancels ``scope`` when given (``main``'s work; its own clean-up, such as a
    Processor's graceful stop, then runs uncancelled), else all of ``main``."""
    with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        outcome: list[int] = []
        signalled: list[int] = []
        failure: list[BaseException] = []
        async with anyio.create_task_group() as tasks:

            async def stop_on_signal() -> None:
                async for signum in signals:
                    signalled.append(signum)
                    (scope or tasks.cancel_scope).cancel()
                    return

            tasks.start_soon(stop_on_signal)
            try:
                outcome.append(await main())
            except Exception as exc:  # re-raised outside the task group (no ExceptionGroup)
                failure.append(exc)
            tasks.cancel_scope.cancel()
    if failure and not signalled:
        raise failure[0]
    return EXIT_OK if signalled else outcome[0]


def cmd_demo(args: argparse.Namespace) -> int:
    from .sim.demo import default_format, print_report, run_demo

    settings, origin = _options(config.DEMO, args)
    if not settings.format:
        settings = msgspec.structs.replace(settings, format=default_format())
    try:
        catalog.worker_for(settings.format)
    except LookupError as exc:
        raise ConfigError(f"invalid {origin['format']}={settings.format!r}: {exc}") from None
    if printed_config(args, config.print_config(settings, origin)):
        return EXIT_OK
    _setup_logging("ERROR")  # the demo's planned faults log warnings by design; its summary reports them
    reports: list = []
    stopped: list[bool] = []

    async def demo() -> int:
        # the traffic and the live page; a signal cancels just this, then the processor and NATS stop as
        # they do at the end of a run (no nats-server left orphaned)
        work = anyio.CancelScope()

        async def main() -> int:
            reports.append(await run_demo(requests=settings.requests, format=settings.format, seed=settings.seed,
                                          timeout=settings.timeout, progress=sys.stderr,
                                          serve_port=settings.serve, work=work))
            return EXIT_OK if reports[0] is not None and reports[0].ok else EXIT_FAILURE

        code = await until_signal(main, scope=work)
        stopped.append(work.cancel_called)
        return code

    code = anyio.run(demo)
    if reports and reports[0] is not None and settings.serve is None and not stopped[0]:
        print_report(reports[0])  # not a half-run's partial table
    return code


def cmd_token(args: argparse.Namespace) -> int:
    """Print an edge capability (a JWT) on stdout; the key comes from a file, never the command line
    (and is never printed: --print-config shows the file's path)."""
    from jwt.exceptions import PyJWTError

    from .client.capability import mint_capability

    settings, origin = _options(config.TOKEN, args)
    if not (settings.rid or settings.rid_prefix or settings.operator):
        raise ConfigError("name what the token grants: --rid ID (repeatable), --rid-prefix P or --operator")
    for flag, value in [*(("--rid", rid) for rid in settings.rid), *((("--rid-prefix", settings.rid_prefix),)
                                                                    if settings.rid_prefix else ())]:
        try:  # a token for an id no request can have would grant nothing, silently
            check_request_id(value)
        except ValueError as exc:
            raise ConfigError(f"{flag} {value!r}: {exc}") from None
    key = config.read_setting_file(settings.key_file, f"--key-file {settings.key_file!r}")
    try:  # signed with --print-config too: a key that cannot sign is found as start-up would find it
        # mint_capability refuses the keys the edge refuses to start with (streamproc.signing_keys)
        token = mint_capability(key, rids=list(settings.rid), rid_prefix=settings.rid_prefix,
                                operator=settings.operator, ttl=settings.ttl, algorithm=settings.algorithm,
                                subject=settings.subject)
    except (ValueError, TypeError, PyJWTError) as exc:  # no private key for the algorithm (InvalidKeyError)
        raise ConfigError(f"cannot sign with --key-file {settings.key_file!r} as {settings.algorithm}: "
                          f"{exc}") from None
    if printed_config(args, config.print_config(settings, origin)):
        return EXIT_OK
    print(token)
    return EXIT_OK


# --------------------------------------------------------------------------- parser

def add_print_config(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--print-config", action="store_true",
                        help="validate the settings as start-up would, print each value with its source "
                             "(default, env, flag) as JSON, and exit")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="streamproc",
        description="NATS stream processor: joins prefill/decode LLM responses, passes aggregated ones through.",
    )
    parser.add_argument("--version", action="version", version=f"streamproc {__version__} ({compiled.build_name()})")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    run = sub.add_parser("run", help="run the processor against a NATS server",
                         description="Run the processor until SIGTERM/SIGINT.")
    config.add_arguments(run)
    add_print_config(run)
    run.set_defaults(func=cmd_run)

    codecs = sub.add_parser("codecs", help="list installed codecs (entry-point group streamproc.codecs)")
    add_print_config(codecs)
    codecs.set_defaults(func=cmd_codecs)

    sim = sub.add_parser("simulate", help="publish simulated worker traffic (optionally verify the results)",
                         description="Publish simulated worker chunks (each with a Streamproc-Format header) "
                                     "and, with --verify, check the results of a running processor.")
    config.add_arguments(sim, list(config.SIMULATE_CONNECTION))
    config.SIMULATE.add_arguments(sim, [f.name for f in config.SIMULATE.fields() if f.name != "stream"])
    shape = sim.add_mutually_exclusive_group()
    shape.add_argument("--stream", dest="simulate_stream", action="store_const", const=True, default=None,
                       help="streaming responses only")
    shape.add_argument("--unary", dest="simulate_stream", action="store_const", const=False,
                       help="unary responses only (default: alternate)")
    add_print_config(sim)
    sim.set_defaults(func=cmd_simulate)

    demo = sub.add_parser("demo", help="embedded NATS + processor + simulated SGLang workers, verified",
                          description="Start an embedded nats-server, run the processor in-process, publish "
                                      "simulated aggregated and P/D traffic and verify every result.")
    config.DEMO.add_arguments(demo, custom={"serve": {"nargs": "?", "const": 8080, "metavar": "PORT"}})
    add_print_config(demo)
    demo.set_defaults(func=cmd_demo)

    token = sub.add_parser(
        "token", help="mint an edge capability (JWT) for request ids, a tenant prefix or an operator",
        description="Print a signed capability for `streamproc edge` on stdout. The key is read from "
                    "--key-file (the HMAC secret, or the PEM private key whose public half the edge has); "
                    "use it as 'Authorization: Bearer <token>' or ?access_token=<token>, or open the "
                    "live page at http://edge/#access_token=<operator token>.")
    config.TOKEN.add_arguments(token, custom={"key_file": {"required": True, "metavar": "PATH"},
                                              "rid": {"action": "append", "metavar": "ID"},
                                              "rid_prefix": {"metavar": "P"},
                                              "operator": {"action": "store_const", "const": True}})
    add_print_config(token)
    token.set_defaults(func=cmd_token)

    from .edge.command import add_cli as add_edge_cli  # imports no web stack until `edge` runs

    add_edge_cli(sub)
    return parser


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def main(argv: Sequence[str] | None = None) -> int:
    if argv is None:  # the program itself (not a caller's in-process use): own the process's signals
        # SIGTERM before a command installs its own handling (importing, parsing, loading a codec) stops
        # like SIGINT does, and exits 0 like a stop in any other state (not 143 from the default action).
        signal.signal(signal.SIGTERM, _interrupt)
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # argparse reports these as "streamproc: error:"; name the command, as every other error does
        [commands] = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        commands.choices[args.command].error(f"unrecognized arguments: {' '.join(unknown)}")
    try:
        code = args.func(args)
        if argv is None:  # a buffered write to a closed pipe fails here, not at interpreter exit
            sys.stdout.flush()
        return code
    except BrokenPipeError:
        if argv is not None:  # a caller's in-process use: its stdout is not ours to replace
            raise
        # The reader of stdout has gone (`streamproc codecs | head -1`): stop quietly, as the Python
        # docs advise (library/signal.html, "Note on SIGPIPE"): stdout onto /dev/null so the flush at
        # exit cannot fail again, and a non-zero exit since the output was not all delivered.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_FAILURE
    except ConfigError as exc:
        print(f"streamproc {args.command}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except StreamprocError as exc:  # start-up failures: NATS unreachable, a stream that does not match...
        print(f"streamproc {args.command}: error: {exc}", file=sys.stderr)
        return EXIT_FAILURE
    except KeyboardInterrupt:  # a signal before (or after) a command's own handling: still a requested stop
        return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
