"""Edge settings: one typed record, filled from defaults < environment < command-line flags.

Settings the edge shares with the processor keep the processor's names (``STREAMPROC_NATS_URL``,
``STREAMPROC_PREFIX``, ``STREAMPROC_FORMAT``, ``STREAMPROC_LOG_LEVEL``), so one compose
``environment`` block can serve both; settings only the edge has are ``STREAMPROC_EDGE_<NAME>``.
The flag is always ``--kebab-name``.
"""

from __future__ import annotations

import argparse
import typing
from typing import Annotated, Any, Literal, Mapping

import msgspec

from ..wire import DEFAULT_PREFIX, Subjects

ENV_PREFIX = "STREAMPROC_"
SHARED = frozenset({"nats_url", "prefix", "format", "log_level"})

LogLevel = Literal["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"]


def _doc(text: str, **constraints: Any) -> msgspec.Meta:
    return msgspec.Meta(description=text, **constraints)


class EdgeSettings(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """Effective configuration of one edge."""

    nats_url: Annotated[str, _doc("NATS server URL(s), comma-separated for a cluster", min_length=1)] = (
        "nats://127.0.0.1:4222"
    )
    prefix: Annotated[str, _doc("subject prefix P: results are read from P.results.<request_id>")] = (
        DEFAULT_PREFIX
    )
    format: Annotated[
        str,
        _doc(
            "codec that folds a stream for unary clients and builds the edge's own "
            "error bodies (see `streamproc codecs`)",
            min_length=1,
        ),
    ] = "sglang"
    host: Annotated[str, _doc("address to listen on (0.0.0.0 in a container)", min_length=1)] = "127.0.0.1"
    port: Annotated[int, _doc("HTTP port", ge=0, le=65535)] = 8080
    max_streams: Annotated[
        int, _doc("concurrent result streams (SSE and unary) before new ones get 503", ge=1, le=1_000_000)
    ] = 1000
    keepalive: Annotated[
        float, _doc("seconds of silence before a `: keep-alive` comment is sent", gt=0, le=3600)
    ] = 15.0
    result_timeout: Annotated[
        float,
        _doc(
            "seconds without a new result before the edge ends a request "
            "with a timeout error (should exceed the processor's "
            "--request-timeout)",
            gt=0,
            le=7 * 86_400,
        ),
    ] = 330.0
    gap_timeout: Annotated[
        float,
        _doc(
            "seconds a missing seq may stay missing while later ones wait "
            "before the stream is ended with an error (never spliced)",
            gt=0,
            le=3600,
        ),
    ] = 5.0
    recent: Annotated[
        int,
        _doc(
            "recent request ids remembered for GET /v1/recent and the page; "
            "0 turns the wildcard subscription off",
            ge=0,
            le=100_000,
        ),
    ] = 50
    ensure_results_stream: Annotated[
        bool, _doc("create (or validate) the JetStream results stream at start, so clients can attach late")
    ] = False
    results_max_age: Annotated[
        float,
        _doc(
            "seconds the results stream keeps a result (used with --ensure-results-stream)",
            gt=0,
            le=365 * 86_400,
        ),
    ] = 3600.0
    log_level: Annotated[LogLevel, _doc("logging threshold")] = "INFO"

    def __post_init__(self) -> None:
        try:
            Subjects(self.prefix)
        except ValueError as exc:
            raise ValueError(f"prefix: {exc}") from None

    @property
    def subjects(self) -> Subjects:
        return Subjects(self.prefix)


class EdgeConfigError(ValueError):
    """A setting that cannot be used; the message names the flag or variable it came from."""


class Field(msgspec.Struct, frozen=True):
    name: str
    default: Any
    help: str
    kind: type

    @property
    def env(self) -> str:
        return ENV_PREFIX + ("" if self.name in SHARED else "EDGE_") + self.name.upper()

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")


def fields() -> list[Field]:
    hints = typing.get_type_hints(EdgeSettings, include_extras=True)
    out = []
    for name, default in zip(EdgeSettings.__struct_fields__, EdgeSettings.__struct_defaults__):
        base, *extras = typing.get_args(hints[name])
        text = next((m.description for m in extras if isinstance(m, msgspec.Meta) and m.description), "")
        out.append(Field(name, default, text, base))
    return out


def env_names() -> set[str]:
    return {f.env for f in fields()}


_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


def load(
    environ: Mapping[str, str] | None = None, overrides: Mapping[str, Any] | None = None
) -> EdgeSettings:
    """Merge defaults < ``STREAMPROC_*`` environment < ``overrides`` (parsed flags) and validate."""
    environ = environ if environ is not None else {}
    merged: dict[str, Any] = {}
    sources: dict[str, str] = {}
    for f in fields():
        if f.env in environ:
            merged[f.name], sources[f.name] = (
                environ[f.env],
                f"environment variable {f.env}={environ[f.env]!r}",
            )
        if overrides and overrides.get(f.name) is not None:
            merged[f.name], sources[f.name] = overrides[f.name], f"flag {f.flag}={overrides[f.name]!r}"
        value = merged.get(f.name)
        if f.kind is bool and isinstance(value, str):
            if value.lower() not in _TRUE | _FALSE:
                raise EdgeConfigError(f"invalid {sources[f.name]}: expected true or false")
            merged[f.name] = value.lower() in _TRUE
    if isinstance(merged.get("log_level"), str):
        merged["log_level"] = merged["log_level"].upper()
    try:
        return msgspec.convert(merged, EdgeSettings, strict=False)
    except msgspec.ValidationError as exc:
        message = str(exc)
        for name, source in sources.items():
            if f"`$.{name}`" in message:
                raise EdgeConfigError(f"invalid {source}: {message.split(' - at ')[0]}") from None
        raise EdgeConfigError(f"invalid configuration: {message}") from None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``--kebab-name`` flags for every edge setting; unset flags stay None so the environment wins."""
    group = parser.add_argument_group("settings (flag > STREAMPROC_* environment > default)")
    for f in fields():
        help_text = f"{f.help} [env {f.env}, default {f.default!r}]"
        if f.kind is bool:
            group.add_argument(
                f.flag, dest=f.name, default=None, action=argparse.BooleanOptionalAction, help=help_text
            )
        else:
            group.add_argument(f.flag, dest=f.name, default=None, metavar=f.name.upper(), help=help_text)


def from_arguments(args: argparse.Namespace, environ: Mapping[str, str] | None = None) -> EdgeSettings:
    return load(environ, {f.name: getattr(args, f.name, None) for f in fields()})
