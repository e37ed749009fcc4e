"""Processor settings: one typed record, filled from defaults < environment < command-line flags.

Every setting has one name used three ways: the field ``prefill_timeout`` is the environment
variable ``STREAMPROC_PREFILL_TIMEOUT`` and the flag ``--prefill-timeout``. Ranges are declared
on the field (msgspec ``Meta``), so an out-of-range value fails at start-up, naming where it came
from, instead of misbehaving hours later.
"""

from __future__ import annotations

import argparse
import re
import typing
from typing import Annotated, Any, Literal, Mapping

import msgspec

from .core import defaults
from .core.codec import CodecOptions, parse_format_options
from .core.correlator import CorrelatorConfig
from .core.errors import ConfigError
from .core.wire import Subjects

ENV_PREFIX = "STREAMPROC_"

Mode = Literal["auto", "core", "durable"]
Storage = Literal["file", "memory"]
LogLevel = Literal["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"]


def documented(text: str, **constraints: Any) -> msgspec.Meta:
    """A setting's help text and range, declared once on the field (used by the edge's settings too)."""
    return msgspec.Meta(description=text, **constraints)


class CommonSettings(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """Settings the processor and the edge share: the same names, variables and defaults, and the one
    definition of the results stream (both may create it, so they must never disagree on it)."""

    nats_url: Annotated[str, documented("NATS server URL(s), comma-separated for a cluster", min_length=1)] = (
        defaults.NATS_URL
    )
    prefix: Annotated[str, documented("subject prefix P: chunks on P.chunks.>, results on "
                                      "P.results.<request_id>")] = defaults.PREFIX
    format: Annotated[str, documented("default codec (see `streamproc codecs`): the processor's for requests "
                                      "without a Streamproc-Format header, the edge's for folding unary answers "
                                      "and its own error bodies", min_length=1)] = defaults.FORMAT
    connect_timeout: Annotated[float, documented("seconds to wait for the first NATS connection at start-up; 0 waits "
                                           "forever (later disconnects are always retried)", ge=0, le=86_400)] = 30.0
    log_level: Annotated[LogLevel, documented("logging threshold")] = "INFO"
    stream_storage: Annotated[Storage, documented("storage of the chunk and results streams and the lease "
                                            "bucket")] = "file"
    stream_replicas: Annotated[int, documented("replicas of the chunk and results streams and the lease "
                                         "bucket (3 on a cluster)", ge=1, le=5)] = 1
    results_max_age: Annotated[float, documented("seconds the results stream keeps a result (late attach, "
                                           "recovery)", gt=0, le=365 * 86_400)] = defaults.RESULTS_MAX_AGE
    duplicate_window: Annotated[float, documented("seconds in which a repeated Nats-Msg-Id is dropped by "
                                            "the chunk and results streams", ge=0.1, le=86_400)] = defaults.DUPLICATE_WINDOW

    def __post_init__(self) -> None:
        try:
            Subjects(self.prefix)
        except ValueError as exc:
            raise ValueError(f"prefix: {exc}") from None
        if self.duplicate_window > self.results_max_age:
            raise ValueError("duplicate_window must not exceed results_max_age")

    @property
    def subjects(self) -> Subjects:
        return Subjects(self.prefix)

    def to_json(self) -> bytes:
        return msgspec.json.format(msgspec.json.encode(self), indent=2)


class Settings(CommonSettings, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """Effective configuration of one processor."""

    mode: Annotated[Mode, documented("input mode; durable = JetStream consumers with acks (effectively-once "
                               "results, survives restarts), core = plain NATS subscription (at-most-once), "
                               "auto = durable when the server has JetStream, else core")] = "auto"
    partitions: Annotated[int, documented("durable: partitions of the chunk stream (one durable consumer each); "
                                    "fixed when the stream is created", ge=1, le=1024)] = 8
    ack_wait: Annotated[float, documented("durable: seconds before an unacknowledged chunk is redelivered; held "
                                    "chunks are kept alive with in-progress acks", ge=0.5, le=3600)] = defaults.ACK_WAIT
    max_ack_pending: Annotated[int, documented("durable: unacknowledged chunks per partition before the server "
                                         "stops delivering (bounds in-flight work)", ge=1, le=1_000_000)] = 2048
    fetch_batch: Annotated[int, documented("durable: messages asked for per pull request", ge=1, le=10_000)] = 256
    max_result_attempts: Annotated[int, documented("durable: refusals or unanswered publishes of one result before it "
                                             "is given up (logged, counted; its inputs are NAKed for redelivery)",
                                             ge=1, le=1_000_000)] = defaults.MAX_RESULT_ATTEMPTS
    lease_ttl: Annotated[float, documented("durable: seconds a partition lease lives without renewal (failover "
                                     "time of a dead instance's partitions)", ge=1, le=600)] = 6.0
    chunks_max_age: Annotated[float, documented("durable: seconds an unprocessed chunk is kept", gt=0,
                                          le=365 * 86_400)] = defaults.CHUNKS_MAX_AGE
    chunks_max_bytes: Annotated[int, documented("durable: bytes of unprocessed chunks kept (-1 unlimited); when "
                                          "full, new chunks are refused", ge=-1)] = -1
    prefill_timeout: Annotated[float, documented("seconds a decode chunk waits for the prefill leg before the "
                                           "omission policy applies", gt=0, le=86_400)] = defaults.PREFILL_TIMEOUT
    request_timeout: Annotated[float, documented("seconds without progress before a request is ended with a "
                                           "timeout error result", gt=0, le=7 * 86_400)] = defaults.REQUEST_TIMEOUT
    finished_grace: Annotated[float, documented("seconds a finished request id is remembered, so late chunks are "
                                          "dropped instead of starting a new request", gt=0, le=7 * 86_400)] = defaults.FINISHED_GRACE
    max_inflight: Annotated[int, documented("requests in flight before new ones get an overloaded error result",
                                      ge=1, le=10_000_000)] = defaults.MAX_INFLIGHT
    max_buffered_chunks: Annotated[int, documented("chunks buffered per request (reorder + prefill) before it is "
                                             "ended with an error", ge=1, le=10_000_000)] = defaults.MAX_BUFFERED_CHUNKS
    max_finished: Annotated[int, documented("finished request ids remembered at most (bounds the grace table)",
                                      ge=1, le=100_000_000)] = defaults.MAX_FINISHED
    max_decompressed_bytes: Annotated[int, documented("ceiling on a decoded sequence payload; within it a codec "
                                                "decodes at most what the body's token counts allow",
                                                ge=1024, le=2**40)] = defaults.MAX_DECOMPRESSED_BYTES
    format_option: Annotated[str, documented("codec options as KEY=VALUE, comma-separated (sglang: "
                                             "streaming=cumulative|incremental, see docs/codecs.md)")] = ""
    max_retained_bytes: Annotated[int, documented("bytes of published bodies kept by reference per request for a "
                                            "possible migration; past it the codec folds them into a compact "
                                            "progress state (0 folds every body at once)", ge=0, le=2**40)] = defaults.MAX_RETAINED_BYTES
    pending_msgs_limit: Annotated[int, documented("client-side queue of undelivered input messages before nats-py "
                                            "drops (slow consumer)", ge=1, le=2**31)] = 4 * 1024 * 1024
    pending_bytes_limit: Annotated[int, documented("client-side bytes of undelivered input messages before nats-py "
                                             "drops (slow consumer)", ge=1024, le=2**45)] = 1024 * 1024 * 1024
    drain_timeout: Annotated[float, documented("seconds a graceful stop may spend draining", gt=0, le=3600)] = 10.0
    stats_interval: Annotated[float, documented("seconds between statistics log lines; 0 turns them off",
                                          ge=0, le=86_400)] = 0.0

    def __post_init__(self) -> None:
        super().__post_init__()
        try:
            parse_format_options(self.format_option)
        except ValueError as exc:
            raise ValueError(f"format_option: {exc}") from None
        if self.duplicate_window > self.chunks_max_age:
            raise ValueError("duplicate_window must not exceed chunks_max_age or results_max_age")

    def codec_options(self) -> CodecOptions:
        return CodecOptions(max_decompressed_bytes=self.max_decompressed_bytes,
                            format_options=parse_format_options(self.format_option))

    def correlator_config(self) -> CorrelatorConfig:
        return CorrelatorConfig(
            prefill_timeout=self.prefill_timeout,
            request_timeout=self.request_timeout,
            finished_grace=self.finished_grace,
            max_inflight=self.max_inflight,
            max_buffered_chunks=self.max_buffered_chunks,
            max_finished=self.max_finished,
            max_retained_bytes=self.max_retained_bytes,
        )


class Field(msgspec.Struct, frozen=True):
    name: str
    default: Any
    help: str
    choices: tuple[str, ...] | None
    env: str
    kind: Any = None  # the field's base type (bool settings get --x/--no-x flags and yes/no parsing)

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")


_PATH = re.compile(r"at `\$\.(\w+)`")
_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off", ""})

S = typing.TypeVar("S", bound=msgspec.Struct)


class SettingsSchema(typing.Generic[S]):
    """Defaults < environment < command-line flags for one settings Struct.

    The processor and the edge each declare a Struct (ranges as msgspec ``Meta`` on the fields);
    this one mechanism turns it into environment variables, flags, validation and error messages
    that name where a bad value came from.
    """

    def __init__(self, struct: type[S], env_name: typing.Callable[[str], str], *,
                 error: type[ConfigError] = ConfigError, dest_prefix: str = "",
                 title: str = "settings (flag > STREAMPROC_<NAME> environment > default)") -> None:
        self.struct = struct
        self.error = error
        self._env_name = env_name
        self._dest = dest_prefix
        self._title = title
        self._fields: list[Field] | None = None

    def fields(self) -> list[Field]:
        """Every setting with its default, help text and allowed values (drives the CLI and the docs)."""
        if self._fields is None:
            hints = typing.get_type_hints(self.struct, include_extras=True)
            out = []
            for name, default in zip(self.struct.__struct_fields__, self.struct.__struct_defaults__):
                hint = hints[name]
                base, *extras = typing.get_args(hint) or (hint,)
                text = next((m.description for m in extras if isinstance(m, msgspec.Meta) and m.description), "")
                literal = typing.get_args(base) if typing.get_origin(base) is Literal else None
                out.append(Field(name, default, text, tuple(literal) if literal else None,
                                 self._env_name(name), base))
            self._fields = out
        return self._fields

    def load(self, environ: Mapping[str, str] | None = None, overrides: Mapping[str, Any] | None = None) -> S:
        """Merge defaults < environment < ``overrides`` (parsed flags) and validate."""
        environ = environ if environ is not None else {}
        sources: dict[str, str] = {}
        merged: dict[str, Any] = {}
        for f in self.fields():
            if f.env in environ:
                merged[f.name] = environ[f.env]
                sources[f.name] = f"environment variable {f.env}={environ[f.env]!r}"
            if overrides and overrides.get(f.name) is not None:
                merged[f.name] = overrides[f.name]
                sources[f.name] = f"flag {f.flag}={overrides[f.name]!r}"
            value = merged.get(f.name)
            if f.kind is bool and isinstance(value, str):
                if value.lower() not in _TRUE | _FALSE:
                    raise self.error(f"invalid {sources[f.name]}: expected true or false")
                merged[f.name] = value.lower() in _TRUE
        if isinstance(merged.get("log_level"), str):
            merged["log_level"] = merged["log_level"].upper()
        try:
            return msgspec.convert(merged, self.struct, strict=False)
        except msgspec.ValidationError as exc:
            message = str(exc)
            match = _PATH.search(message)
            if match and match.group(1) in sources:
                name = match.group(1)
                reason = message[:match.start()].rstrip(" -")
                choices = next((f.choices for f in self.fields() if f.name == name), None)
                if choices:
                    reason += f" (allowed: {', '.join(choices)})"
                raise self.error(f"invalid {sources[name]}: {reason}") from None
            raise self.error(f"invalid configuration: {message}") from None

    def add_arguments(self, parser: argparse.ArgumentParser, names: list[str] | None = None) -> None:
        """Add ``--kebab-name`` flags for the given settings (all by default). Unset flags stay None."""
        wanted = set(names) if names is not None else None
        group = parser.add_argument_group(self._title)
        for f in self.fields():
            if wanted is not None and f.name not in wanted:
                continue
            help_text = f"{f.help} [env {f.env}, default {f.default!r}]"
            if f.kind is bool:
                group.add_argument(f.flag, dest=self._dest + f.name, default=None,
                                   action=argparse.BooleanOptionalAction, help=help_text)
                continue
            # Levels are accepted in any case, so argparse must not check them; the Struct does.
            choices = f.choices if f.name != "log_level" else None
            group.add_argument(f.flag, dest=self._dest + f.name, default=None,
                               metavar=None if choices else f.name.upper(), choices=choices, help=help_text)

    def from_arguments(self, args: argparse.Namespace, environ: Mapping[str, str] | None = None) -> S:
        """Settings from flags added by :meth:`add_arguments` (other arguments are ignored)."""
        return self.load(environ, {f.name: getattr(args, self._dest + f.name, None) for f in self.fields()})


# The processor's settings. The flag destination prefix keeps them apart from a command's own
# arguments (simulate has its own --mode).
PROCESSOR = SettingsSchema(Settings, lambda name: ENV_PREFIX + name.upper(), dest_prefix="setting_")
fields = PROCESSOR.fields
load = PROCESSOR.load
add_arguments = PROCESSOR.add_arguments
from_arguments = PROCESSOR.from_arguments
