"""Processor settings: one typed record, filled from defaults < environment < command-line flags.

Every setting has one name used three ways: the field ``prefill_timeout`` is the environment
variable ``STREAMPROC_PREFILL_TIMEOUT`` and the flag ``--prefill-timeout``. Ranges are declared
on the field (msgspec ``Meta``), so an out-of-range value fails at start-up, naming where it came
from, instead of misbehaving hours later.
"""

from __future__ import annotations

import argparse
import difflib
import os
import re
import stat
import typing
from typing import Annotated, Any, Iterable, Literal, Mapping

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
LogFormat = Literal["logfmt", "json"]


def documented(text: str, *, secret: bool = False, **constraints: Any) -> msgspec.Meta:
    """A setting's help text and range, declared once on the field (used by the edge's settings too).

    ``secret`` settings are read from the environment only (a command line is visible to every
    user of the machine in ``ps``), and are never printed: ``--print-config``, logs and error
    messages show ``<redacted>``."""
    return msgspec.Meta(description=text, extra={"secret": True} if secret else None, **constraints)


REDACTED = "<redacted>"
# Credentials inside free text (an error message): a scheme'd URL's userinfo, or a scheme-less
# ``user:password@host`` (the form check_nats_url accepts, and nats-py's _parse_server_uri prefixes
# with ``nats://``). Text is scrubbed of the configured secrets first; these patterns are the backstop.
_USERINFO = re.compile(r"(?P<scheme>[a-zA-Z][a-zA-Z0-9+.-]*://)(?P<userinfo>[^@/,\s]*)@")
_BARE_USERINFO = re.compile(r"(?<![^\s'\"(\[=,])(?P<user>[^\s'\"@:/,]+):(?P<password>[^\s'\"@,/][^\s'\"@,]*)@"
                            r"(?=[A-Za-z0-9\[])")


def _shown(userinfo: str) -> str:
    user, colon, _ = userinfo.partition(":")
    return f"{user}:{REDACTED}" if colon else REDACTED


def split_userinfo(server: str) -> tuple[str, str, str]:
    """One server of a NATS URL as (``scheme://`` or "", userinfo or "", host part), read as
    check_nats_url and nats-py do: with or without a scheme, the userinfo running to the last ``@``
    (urllib's ``netloc.rpartition('@')``, so a password may hold ``@`` or ``/``)."""
    scheme, sep, rest = server.partition("://")
    prefix = scheme + sep if sep else ""
    rest = rest if sep else server
    userinfo, at, host = rest.rpartition("@")
    return (prefix, userinfo, host) if at else (prefix, "", rest)


def _servers_as_written(url: str) -> list[str]:
    """The value's comma-separated servers, read so that no part of a secret holding a comma (which
    the server list cannot carry) is taken for a server of its own: a part that is no whole server
    (no credentials, no ``host:port``) is joined with the parts after it up to the first one holding
    credentials, if that comes before any scheme'd part. So ``nats://app:Hunter2,Mid,Tail@host`` is
    one server, password ``Hunter2,Mid,Tail``, while ``h1:4222,user:pw@h2:4222`` stays two. Where
    both readings fit (``h1,user:pw@h2``) the joined one is shown: over-redacted, never leaked."""
    parts = url.split(",")
    groups: list[str] = []
    i = 0
    while i < len(parts):
        end = i
        if "@" not in parts[i] and not _has_port(parts[i]):
            k = i + 1
            while k < len(parts) and "://" not in parts[k] and "@" not in parts[k]:
                k += 1
            if k < len(parts) and "@" in parts[k] and "://" not in parts[k]:
                end = k
        groups.append(",".join(parts[i:end + 1]))
        i = end + 1
    return groups


def _has_port(server: str) -> bool:
    """Whether a part without credentials reads as ``[scheme://]host:port``."""
    rest = server.partition("://")[2] if "://" in server else server
    match = _HOST_PORT.match(rest.strip().split("/", 1)[0])
    return bool(match and match.group(2))


def redact_url(url: str) -> str:
    """``nats://user:pass@host`` -> ``nats://user:<redacted>@host``; ``nats://token@host`` ->
    ``nats://<redacted>@host``; the same for scheme-less ``user:pass@host:port`` and for every
    server of a comma-separated list. A value without credentials is unchanged. For a URL value;
    free text goes through :func:`redact_text`."""
    out = []
    for server in _servers_as_written(url):
        prefix, userinfo, host = split_userinfo(server)
        out.append(f"{prefix}{_shown(userinfo)}@{host}" if "@" in server else server)
    return ",".join(out)


def redact_text(text: str) -> str:
    """Free text (an error message, a log line) with URL credentials redacted, scheme'd or not."""
    text = _USERINFO.sub(lambda m: f"{m['scheme']}{_shown(m['userinfo'])}@", text)
    return _BARE_USERINFO.sub(lambda m: f"{m['user']}:{REDACTED}@", text)


def redact_query(url: str) -> str:
    """An HTTP URL with the value of every query parameter (a field without ``=`` whole) and its
    fragment as ``<redacted>``, the names kept: a scrape endpoint may take its credential in the
    query (``?token=``), which the edge must send but never show (``/v1/stats``, ``--print-config``)."""
    head, hashed, _ = url.partition("#")
    base, asked, query = head.partition("?")
    if asked:
        fields = [f"{name}={REDACTED}" if eq else REDACTED if name else name
                  for name, eq, _ in (field.partition("=") for field in query.split("&"))]
        base = f"{base}?{'&'.join(fields)}"
    return f"{base}#{REDACTED}" if hashed else base


def url_secrets(url: str) -> list[str]:
    """The passwords and tokens embedded in a (comma-separated) NATS URL, scheme'd or not, for
    scrubbing text."""
    out = []
    for server in _servers_as_written(url):
        if "@" in server:
            user, colon, password = split_userinfo(server.strip())[1].partition(":")
            secret = password if colon else user
            out.append(secret)
            if "," in secret:
                out += secret.split(",")  # the pieces a split on the commas shows alone (check_nats_url's error)
    return [s for s in out if s]


NATS_SCHEMES = ("nats", "tls", "ws", "wss")
_URL_DELIMITERS = "/?#"  # end a URL's host part (RFC 3986 section 3.2), so no userinfo may hold them
_HOST_PORT = re.compile(r"^(\[[0-9a-fA-F:.]+\]|[A-Za-z0-9_.-]+)(:\d{1,5})?$")


def check_nats_url(value: str) -> None:
    """Each comma-separated server must be ``nats|tls|ws|wss://[user[:pass]@]host[:port]`` or
    ``host[:port]``: an ``http://`` URL or free text would otherwise be retried forever as a DNS name."""
    for server in (part.strip() for part in value.split(",")):
        if not server:
            raise ValueError("nats_url: empty server in the list")
        scheme, sep, rest = server.partition("://")
        if not sep:
            scheme, rest = "nats", server
        if scheme not in NATS_SCHEMES:  # in lower case: nats-py's tests are ("nats://" in url ...), so an
            # upper-case scheme became nats://NATS://host, a host name it retried for ever
            raise ValueError(f"nats_url: unsupported scheme {scheme + '://'!r} in {server!r} "
                             f"(use {', '.join(s + '://' for s in NATS_SCHEMES)}, in lower case)")
        userinfo = rest.rpartition("@")[0]
        if any(c in userinfo for c in _URL_DELIMITERS):
            # nats-py's urlparse ends the host at the first of them and sends the userinfo undecoded:
            # the secret's start would be looked up in DNS as a host name, at every retry
            setting = ("STREAMPROC_NATS_PASSWORD or --nats-password-file, with STREAMPROC_NATS_USER"
                       if ":" in userinfo else "STREAMPROC_NATS_TOKEN or --nats-token-file")
            # a websocket URL's path and query are sent (nats-py's ws_connect(uri.geturl())), and may
            # hold '@' legally; read as userinfo (to the last '@') they are refused, so say how to write it
            websocket = (" (an '@' in a ws:// or wss:// path or query is written %40)"
                         if scheme in ("ws", "wss") else "")
            raise ValueError(f"nats_url: the credentials in {redact_url(server)!r} hold '/', '?' or '#', which a "
                             "NATS URL cannot carry (the client would take the part before for the host name); "
                             f"give the URL without them and the secret in {setting}{websocket}")
        hostport = rest.rsplit("@", 1)[-1].split("/", 1)[0]
        if not _HOST_PORT.match(hostport) or (":" in hostport and not hostport.endswith("]")
                                              and not 0 < int(hostport.rsplit(":", 1)[1]) < 65536):
            raise ValueError(f"nats_url: {server!r} is not a server address (expected host:port or "
                             "nats://host:port)")


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
    log_format: Annotated[LogFormat, documented("log line format: logfmt (event=<name> key=value) or json, "
                                                "one object per line")] = "logfmt"
    stream_storage: Annotated[Storage, documented("storage of the chunk and results streams and the lease "
                                            "bucket")] = "file"
    stream_replicas: Annotated[int, documented("replicas of the chunk and results streams and the lease "
                                         "bucket (3 on a cluster)", ge=1, le=5)] = 1
    results_max_age: Annotated[float, documented("seconds the results stream keeps a result (late attach, "
                                           "recovery)", gt=0, le=365 * 86_400)] = defaults.RESULTS_MAX_AGE
    duplicate_window: Annotated[float, documented("seconds in which a repeated Nats-Msg-Id is dropped by "
                                            "the chunk and results streams", ge=0.1, le=86_400)] = defaults.DUPLICATE_WINDOW
    # NATS authentication and TLS (docs/security.md). At most one of password, token, nkey seed and
    # creds file; secret values come from a file or an environment variable, never from a flag.
    nats_user: Annotated[str, documented("NATS user name (with STREAMPROC_NATS_PASSWORD or "
                                         "--nats-password-file)")] = ""
    nats_password: Annotated[str, documented("NATS password (environment only; or --nats-password-file)",
                                             secret=True)] = ""
    nats_password_file: Annotated[str, documented("file holding the NATS password")] = ""
    nats_token: Annotated[str, documented("NATS authentication token (environment only; or --nats-token-file)",
                                          secret=True)] = ""
    nats_token_file: Annotated[str, documented("file holding the NATS authentication token")] = ""
    nats_nkey_seed_file: Annotated[str, documented("file holding an nkey user seed (SU...) to sign the "
                                                   "server's nonce with")] = ""
    nats_creds_file: Annotated[str, documented("NATS .creds file (user JWT and nkey seed, decentralized "
                                               "auth)")] = ""
    nats_tls_ca_file: Annotated[str, documented("PEM file of the CA(s) that signed the NATS server's "
                                                "certificate (turns TLS on)")] = ""
    nats_tls_cert_file: Annotated[str, documented("PEM client certificate for mutual TLS (with "
                                                  "--nats-tls-key-file)")] = ""
    nats_tls_key_file: Annotated[str, documented("PEM private key of the client certificate")] = ""

    def __post_init__(self) -> None:
        try:
            Subjects(self.prefix)
        except ValueError as exc:
            raise ValueError(f"prefix: {exc}") from None
        check_nats_url(self.nats_url)
        if self.duplicate_window > self.results_max_age:
            raise ValueError("duplicate_window must not exceed results_max_age")
        if self.nats_password and self.nats_password_file:
            raise ValueError("set STREAMPROC_NATS_PASSWORD or nats_password_file, not both")
        if self.nats_token and self.nats_token_file:
            raise ValueError("set STREAMPROC_NATS_TOKEN or nats_token_file, not both")
        mechanisms = [name for name, on in (
            ("password", bool(self.nats_password or self.nats_password_file)),
            ("token", bool(self.nats_token or self.nats_token_file)),
            ("nkey seed", bool(self.nats_nkey_seed_file)),
            ("creds file", bool(self.nats_creds_file))) if on]
        if len(mechanisms) > 1:
            raise ValueError(f"choose one NATS authentication mechanism, not {' and '.join(mechanisms)}")
        if mechanisms == ["password"] and not self.nats_user:
            raise ValueError("a NATS password needs nats_user")
        if self.nats_user and mechanisms != ["password"]:
            raise ValueError("nats_user needs a password (STREAMPROC_NATS_PASSWORD or nats_password_file)")
        if bool(self.nats_tls_cert_file) != bool(self.nats_tls_key_file):
            raise ValueError("nats_tls_cert_file and nats_tls_key_file go together")

    def secret_values(self) -> list[str]:
        """Every secret this configuration holds in memory (for scrubbing text before it is shown)."""
        fields = _secret_fields(type(self))
        return [v for v in (getattr(self, n) for n in fields) if v] + url_secrets(self.nats_url)

    def redacted(self) -> dict[str, Any]:
        """The settings as a dict, with secret values and URL credentials replaced by ``<redacted>``."""
        out = redacted(self)
        out["nats_url"] = redact_url(self.nats_url)
        return out

    @property
    def subjects(self) -> Subjects:
        return Subjects(self.prefix)

    def to_json(self) -> bytes:
        """JSON for ``--print-config``: secrets redacted."""
        return msgspec.json.format(msgspec.json.encode(self.redacted()), indent=2)


def redacted(settings: msgspec.Struct) -> dict[str, Any]:
    """Any settings Struct as a dict, with the values of its ``secret`` fields as ``<redacted>``."""
    out = msgspec.to_builtins(settings)
    for name in _secret_fields(type(settings)):
        if out.get(name):
            out[name] = REDACTED
    return out


def _is_text(value: Any) -> bool:
    """Whether a flag's or variable's value (or each of a repeatable flag's) is UTF-8 text. Python
    keeps bytes that are not as lone surrogates ('\\udcff'); msgspec and every encoder after it
    refuse those with a traceback, so they are refused here, as bad configuration."""
    if isinstance(value, (list, tuple)):
        return all(_is_text(v) for v in value)
    if not isinstance(value, str):
        return True
    try:
        value.encode()
    except UnicodeEncodeError:
        return False
    return True


# A secret, key, certificate or .creds file is a few KB; a path that names something far larger (a log,
# a device such as /dev/zero) is a mistake, found without reading it whole into memory.
MAX_SETTING_FILE_BYTES = 1 << 20


# What each setting file that is no regular file (a shell's <(...) pipe, a FIFO) held, by (path, device,
# inode): start-up reads a secret file twice (the check, then the connect), a .creds file at every connect,
# and a pipe can be read once: the second read of /dev/fd/63 found it drained ("is empty"), the second open
# of a FIFO whose writer had gone blocked for ever, on the event loop, deaf to SIGTERM. The path is in the
# key because ext4 gives a FIFO made after another was removed the same inode: keyed by (device, inode)
# alone, a new FIFO elsewhere was answered with the old one's secret.
_PIPED: dict[tuple[str, int, int], bytes] = {}


def read_setting_file(path: str, named: str, *, keep: bool = True) -> bytes:
    """The bytes of a file a setting names (``named`` says which, for the error), at most
    :data:`MAX_SETTING_FILE_BYTES`; :class:`ConfigError` (exit 2) when unreadable or larger. A
    regular file is read at every call (a rotated one is taken); a pipe once per process (:data:`_PIPED`),
    unless ``keep`` is false (a library connect, whose caller holds what was read: nothing is kept)."""
    try:
        info = os.stat(path)
        piped = None if stat.S_ISREG(info.st_mode) else (path, info.st_dev, info.st_ino)
        if piped in _PIPED:
            return _PIPED[piped]
        with open(path, "rb") as f:
            data = f.read(MAX_SETTING_FILE_BYTES + 1)
    except OSError as exc:
        raise ConfigError(f"cannot read {named}: {exc.strerror or exc}") from None
    if len(data) > MAX_SETTING_FILE_BYTES:
        raise ConfigError(f"{named} is larger than {MAX_SETTING_FILE_BYTES >> 20} MiB: not a secret, key or "
                          "certificate file")
    if piped is not None and keep:
        _PIPED[piped] = data
    return data


ENCRYPTED_KEY = ("the key is encrypted (passphrase-protected), and streamproc never asks for a passphrase: give it "
                 "the key unencrypted (openssl pkey -in key.pem -out plain-key.pem), in a file only its user may "
                 "read")


def no_key_passphrase() -> str:
    """``load_cert_chain``'s password callback: without one OpenSSL asks for an encrypted key's
    passphrase on the controlling terminal (start-up hangs under ``docker run -t``) or on stdin
    (an ``Invalid argument`` naming no cause). ``load_cert_chain`` passes its ``ValueError`` on."""
    raise ValueError(ENCRYPTED_KEY)


def _redact_value(name: str, value: str) -> str:
    """A setting's value as shown in an error: a URL setting read as a URL (credentials, and the query
    values of each comma-separated part), anything else as text."""
    if name.endswith("url"):
        return ",".join(redact_query(part) for part in redact_url(value).split(","))
    return redact_text(value)


def _secret_fields(struct: type) -> tuple[str, ...]:
    hints = typing.get_type_hints(struct, include_extras=True)
    return tuple(name for name in struct.__struct_fields__
                 if any(isinstance(m, msgspec.Meta) and (m.extra or {}).get("secret")
                        for m in typing.get_args(hints[name])[1:]))


# The settings every command that connects to NATS accepts (simulate takes only these and a few more).
NATS_CONNECTION = ("nats_url", "connect_timeout", "nats_user", "nats_password", "nats_password_file",
                   "nats_token", "nats_token_file", "nats_nkey_seed_file", "nats_creds_file",
                   "nats_tls_ca_file", "nats_tls_cert_file", "nats_tls_key_file")


class Settings(CommonSettings, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """Effective configuration of one processor."""

    # Only the processor answers migrates: the edge took this setting and did nothing with it.
    control_reply_prefix: Annotated[str, documented(
        "the prefix every migrate's reply subject must have (the requesters' inbox prefix, nats-py's "
        "inbox_prefix); a migrate naming another reply subject is refused unanswered and untouched, since "
        "the processor answers with its own NATS rights", min_length=2)] = defaults.CONTROL_REPLY_PREFIX
    mode: Annotated[Mode, documented("input mode; durable = JetStream consumers with acks (effectively-once "
                               "results, survives restarts), core = plain NATS subscription (at-most-once), "
                               "auto = durable when the server has JetStream, else core")] = "auto"
    partitions: Annotated[int, documented("durable: partitions of the chunk stream (one durable consumer each); "
                                    "fixed when the stream is created", ge=1, le=1024)] = 8
    ack_wait: Annotated[float, documented("durable: seconds before an unacknowledged chunk is redelivered; held "
                                    "chunks are kept alive with in-progress acks; after an owner is killed, migrates of its "
                                    "unstored requests are answered `unavailable` for up to this long (keep the "
                                    "Migrator's timeout above it)", ge=0.5, le=3600)] = defaults.ACK_WAIT
    max_ack_pending: Annotated[int, documented("durable: unacknowledged chunks per partition before the server "
                                         "stops delivering (bounds in-flight work); at least 2, so a held "
                                         "prefill leg leaves room for its decode leg", ge=2, le=1_000_000)] = 2048
    fetch_batch: Annotated[int, documented("durable: messages asked for per pull request", ge=1, le=10_000)] = 256
    flush_interval: Annotated[float, documented("durable: least seconds between two writes to NATS, and after "
                                          "a write before the connection is read again; publishes within it leave "
                                          "together in one write, arrivals are read together (less CPU per chunk "
                                          "at light load, up to this much more latency per hop when busy); "
                                          "shortened, down to an eighth, when a dozen commands arrive sooner; 0 "
                                          "writes and reads at once", ge=0, le=0.05)] = defaults.FLUSH_INTERVAL
    ack_linger: Annotated[float, documented("durable: seconds acks, in-progress acks, NAKs and pull requests may "
                                      "wait to leave with the next result's write (0: each is written at "
                                      "once)", ge=0, le=0.5)] = defaults.ACK_LINGER
    max_deliver: Annotated[int, documented("durable: deliveries of one chunk before it is poison: its request ends "
                                     "with an internal error result, the chunk is terminated (+TERM) and "
                                     "counted; the consumer's max_deliver, so nothing is redelivered for ever",
                                     ge=2, le=1_000_000)] = defaults.MAX_DELIVER
    max_lookups: Annotated[int, documented("durable: recovery lookups in flight across every owned partition "
                                     "(each reads a request's last stored result, up to max_payload); the "
                                     "others wait, the partitions taking turns, their chunks held with "
                                     "in-progress acks", ge=1, le=10_000)] = defaults.MAX_LOOKUPS
    max_result_attempts: Annotated[int, documented("durable: refusals or unanswered publishes of one result before it "
                                             "is given up (logged, counted; its inputs are NAKed for redelivery)",
                                             ge=1, le=1_000_000)] = defaults.MAX_RESULT_ATTEMPTS
    result_batch: Annotated[int, documented("durable: results of one request that may leave together as one "
                                      "nats-server fast batch instead of one PubAck round trip each (a "
                                      "request's results queued behind a stored one; stored in order, as a "
                                      "prefix); used with a results stream that allows batches "
                                      "(allow_batched, nats-server 2.14+, one replica), 1: one at a time",
                                      ge=1, le=1000)] = defaults.RESULT_BATCH
    lease_ttl: Annotated[float, documented("durable: seconds a partition lease lives without renewal (failover "
                                     "time of a dead instance's partitions)", ge=1, le=600)] = 6.0
    chunks_max_age: Annotated[float, documented("durable: seconds an unprocessed chunk is kept", gt=0,
                                          le=365 * 86_400)] = defaults.CHUNKS_MAX_AGE
    chunks_max_bytes: Annotated[int, documented("durable: bytes of unprocessed chunks kept (-1 unlimited); when "
                                          "full, new chunks are refused; at least one maximal chunk as stored "
                                          "(the server's max_payload plus a few hundred bytes, checked at start-up)",
                                          ge=-1, le=2**63 - 1)] = -1  # nats-server's int64
    prefill_timeout: Annotated[float, documented("seconds a decode chunk waits for the prefill leg before the "
                                           "omission policy applies", gt=0, le=86_400)] = defaults.PREFILL_TIMEOUT
    request_timeout: Annotated[float, documented("seconds without progress before a request is ended with a "
                                           "timeout error result", gt=0, le=7 * 86_400)] = defaults.REQUEST_TIMEOUT
    finished_grace: Annotated[float, documented("seconds a finished request id is remembered, so late chunks are "
                                          "dropped instead of starting a new request", gt=0, le=7 * 86_400)] = defaults.FINISHED_GRACE
    max_inflight: Annotated[int, documented("requests in flight at most; past it the request without progress for "
                                      "longest is ended (overloaded) if idle at least --shed-min-idle, else the "
                                      "new one gets an overloaded error result",
                                      ge=1, le=10_000_000)] = defaults.MAX_INFLIGHT
    shed_min_idle: Annotated[float, documented("seconds without progress before a request in flight may be ended "
                                         "(overloaded) to admit a new one at --max-inflight",
                                         ge=0, le=7 * 86_400)] = defaults.SHED_MIN_IDLE
    max_buffered_chunks: Annotated[int, documented("chunks buffered per request (reorder + prefill) before it is "
                                             "ended with an error", ge=1, le=10_000_000)] = defaults.MAX_BUFFERED_CHUNKS
    max_buffered_bytes: Annotated[int, documented("bytes of chunk bodies buffered per request (reorder + prefill) "
                                            "before it is ended with an invalid_chunk error; a request whose "
                                            "codec progress state (token ids) passes it ends overloaded",
                                            ge=1024, le=2**40)] = defaults.MAX_BUFFERED_BYTES
    max_total_bytes: Annotated[int, documented("bytes of buffered chunk bodies plus decoded payloads kept for joins "
                                         "(and those the running join decodes) and codec progress state, across all requests; a request that would pass it is ended with an "
                                         "overloaded error (raise it for very large expert captures)",
                                         ge=1024, le=2**44)] = defaults.MAX_TOTAL_BYTES
    max_decode_cpu: Annotated[float, documented("CPU seconds the joins of one request that decode sequence data may "
                                          "take (the join thread and the codec's helper threads); past it the "
                                          "request is ended with an overloaded error; 0 turns the budget off",
                                          ge=0, le=86_400)] = defaults.MAX_DECODE_CPU
    max_migrations: Annotated[int, documented("migrations one request may have; the migrate past it is refused "
                                              "and the request ended with a migration_refused error (each seals "
                                              "the attempt and sends back every token the client was sent)",
                                              ge=1, le=1_000_000)] = defaults.MAX_MIGRATIONS
    max_migrate_rate: Annotated[float, documented(
        "migrates of requests not active here (made-up, finished or not yet adopted ids) this processor answers per second, and "
        f"{defaults.MIGRATE_BURST_SECONDS:g} s of them at once; past it a migrate is answered unavailable "
        "with a retry_after, nothing moved (the Migrator asks again); 0: no limit",
        ge=0, le=1_000_000)] = defaults.MIGRATE_RATE
    max_finished: Annotated[int, documented("finished request ids remembered at most (bounds the grace table)",
                                      ge=1, le=100_000_000)] = defaults.MAX_FINISHED
    max_finished_bytes: Annotated[int, documented("bytes the finished request ids may take (164 + the id's length "
                                            "each); past it or --max-finished the oldest are forgotten first",
                                            ge=1024, le=2**40)] = defaults.MAX_FINISHED_BYTES
    max_decompressed_bytes: Annotated[int, documented("ceiling on a decoded sequence payload; within it a codec "
                                                "decodes at most what the body's token counts allow",
                                                ge=1024, le=2**40)] = defaults.MAX_DECOMPRESSED_BYTES
    format_option: Annotated[str, documented("codec options as KEY=VALUE, comma-separated (sglang: "
                                             "streaming=cumulative|incremental, see docs/codecs.md; vllm: "
                                             "stream_routed_experts=unknown|yes|no, see "
                                             "docs/formats-vllm.md)")] = ""
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
    http_port: Annotated[int, documented("port of the status server (/metrics, /healthz, /readyz); 0 turns "
                                         "it off", ge=0, le=65535)] = 0
    http_host: Annotated[str, documented("address the status server listens on", min_length=1)] = "0.0.0.0"

    def __post_init__(self) -> None:
        super().__post_init__()
        try:
            parse_format_options(self.format_option)
        except ValueError as exc:
            raise ValueError(f"format_option: {exc}") from None
        if self.duplicate_window > self.chunks_max_age:
            raise ValueError("duplicate_window must not exceed chunks_max_age or results_max_age")
        if 0 < self.max_migrate_rate < 0.1:  # a refusal's retry_after would be hours (core/migrate_rate.py)
            raise ValueError("max_migrate_rate must be 0 (no limit) or at least 0.1 a second")
        if self.chunks_max_bytes == 0:  # nats-server stores max_bytes 0 as -1 (stream.go checkStreamCfg)
            raise ValueError("chunks_max_bytes must be -1 (unlimited) or a byte count: nats-server takes 0 for "
                             "unlimited (it stores -1) and the next start-up would find a mismatch")

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
            max_finished_bytes=self.max_finished_bytes,
            shed_min_idle=self.shed_min_idle,
            max_retained_bytes=self.max_retained_bytes,
            max_buffered_bytes=self.max_buffered_bytes,
            max_total_bytes=self.max_total_bytes,
            max_decode_cpu=self.max_decode_cpu,
            max_migrations=self.max_migrations,
        )


# ``--help`` groups, in order, and the settings in each. A setting added elsewhere (another
# component's connection options, say) lands in "connection" by its name, else in "other".
HELP_GROUPS: dict[str, str] = {
    "connection": "where NATS is and how to reach it",
    "correlation": "how chunks become results",
    "limits": "bounds on memory and queues",
    "durable": "JetStream streams, consumers and leases (--mode durable; the edge's results stream)",
    "edge": "the HTTP edge",
    "logging": "log lines and periodic statistics",
    "observability": "the status server: /metrics, /healthz, /readyz",
}
OTHER_GROUP = "other"
_GROUP_OF = {
    **dict.fromkeys(["nats_url", "prefix", "connect_timeout", "control_reply_prefix", "inbox_prefix"], "connection"),
    **dict.fromkeys(["format", "format_option", "mode", "prefill_timeout", "request_timeout", "finished_grace"],
                    "correlation"),
    **dict.fromkeys(["max_inflight", "max_buffered_chunks", "max_buffered_bytes", "max_total_bytes", "max_decode_cpu",
                     "max_migrations", "max_migrate_rate", "max_finished", "max_finished_bytes", "shed_min_idle", "max_decompressed_bytes",
                     "max_retained_bytes", "pending_msgs_limit", "pending_bytes_limit", "drain_timeout"], "limits"),
    **dict.fromkeys(["partitions", "ack_wait", "max_ack_pending", "fetch_batch", "flush_interval", "ack_linger",
                     "max_deliver", "max_lookups", "max_result_attempts", "result_batch", "lease_ttl",
                     "chunks_max_age",
                     "chunks_max_bytes", "stream_storage", "stream_replicas", "results_max_age",
                     "duplicate_window", "ensure_results_stream"], "durable"),
    **dict.fromkeys(["host", "port", "max_streams", "keepalive", "result_timeout", "gap_timeout", "recent",
                     "auth_key_file", "auth_algorithm", "auth_leeway", "insecure_demo", "max_streams_per_client",
                     "idle_stream_timeout", "write_timeout", "stream_buffer_bytes", "max_unary_bytes", "max_replay_consumers",
                     "replay_read_budget",
                     "tls_cert_file", "tls_key_file", "processor_metrics_url", "cors_origin", "forwarded_allow_ips",
                     "max_connections",
                     "head_timeout", "max_head_bytes"], "edge"),
    **dict.fromkeys(["log_level", "log_format", "stats_interval"], "logging"),
    **dict.fromkeys(["http_port", "http_host"], "observability"),
}
_CONNECTION_WORDS = ("nats", "tls", "creds", "token", "user", "password", "nkey", "jwt", "cert", "ca_")


def help_group(name: str) -> str:
    if name in _GROUP_OF:
        return _GROUP_OF[name]
    return "connection" if any(word in name for word in _CONNECTION_WORDS) else OTHER_GROUP


class Field(msgspec.Struct, frozen=True):
    name: str
    default: Any
    help: str
    choices: tuple[str, ...] | None
    env: str
    kind: Any = None  # the field's base type (bool settings get --x/--no-x flags and yes/no parsing)
    secret: bool = False  # environment only, never printed

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")


_PATH = re.compile(r"at `\$\.(\w+)`")
_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off", ""})

S = typing.TypeVar("S", bound=msgspec.Struct)


class _RefuseSecret(argparse.Action):
    """A secret on the command line is visible to every user in ``ps``: refuse it, naming the way in."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        env = ENV_PREFIX + self.dest.removeprefix("setting_").upper()
        parser.error(f"{option_string} is not accepted on the command line (visible in ps): "
                     f"set {env} or {option_string}-file")


class SettingsSchema(typing.Generic[S]):
    """Defaults < environment < command-line flags for one settings Struct.

    The processor and the edge each declare a Struct (ranges as msgspec ``Meta`` on the fields);
    this one mechanism turns it into environment variables, flags, validation and error messages
    that name where a bad value came from.
    """

    def __init__(self, struct: type[S], env_name: typing.Callable[[str], str], *,
                 error: type[ConfigError] = ConfigError, dest_prefix: str = "",
                 title: str = "settings (flag > STREAMPROC_<NAME> environment > default)",
                 group: str = "") -> None:
        self.struct = struct
        self._group = group  # one --help group for every setting (a command's own), else by topic
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
                secret = any(isinstance(m, msgspec.Meta) and (m.extra or {}).get("secret") for m in extras)
                literal = typing.get_args(base) if typing.get_origin(base) is Literal else None
                out.append(Field(name, default, text, tuple(literal) if literal else None,
                                 self._env_name(name), base, secret))
            self._fields = out
        return self._fields

    def load(self, environ: Mapping[str, str] | None = None, overrides: Mapping[str, Any] | None = None) -> S:
        """Merge defaults < environment < ``overrides`` (parsed flags) and validate."""
        return self.explain(environ, overrides)[0]

    def explain(self, environ: Mapping[str, str] | None = None,
                overrides: Mapping[str, Any] | None = None) -> tuple[S, dict[str, str]]:
        """:meth:`load`, plus where each value came from: ``default``, ``env STREAMPROC_X`` or ``flag --x``."""
        environ = environ if environ is not None else {}
        sources: dict[str, str] = {}
        origin: dict[str, str] = {}
        merged: dict[str, Any] = {}
        for f in self.fields():
            origin[f.name] = "default"
            if f.env in environ:
                merged[f.name] = environ[f.env]
                shown = REDACTED if f.secret else _redact_value(f.name, environ[f.env])
                sources[f.name] = f"environment variable {f.env}={shown!r}"
                origin[f.name] = f"env {f.env}"
            if overrides and overrides.get(f.name) is not None:
                merged[f.name] = overrides[f.name]
                shown = REDACTED if f.secret else _redact_value(f.name, str(overrides[f.name]))
                sources[f.name] = f"flag {f.flag}={shown!r}"
                origin[f.name] = f"flag {f.flag}"
            value = merged.get(f.name)
            if f.name in sources and not _is_text(value):  # argv and environ bytes that are not UTF-8
                raise self.error(f"invalid {sources[f.name]}: not valid UTF-8")
            if f.kind is bool and isinstance(value, str):
                if value.lower() not in _TRUE | _FALSE:
                    raise self.error(f"invalid {sources[f.name]}: expected true or false")
                merged[f.name] = value.lower() in _TRUE
        if isinstance(merged.get("log_level"), str):
            merged["log_level"] = merged["log_level"].upper()
        try:
            return msgspec.convert(merged, self.struct, strict=False), origin
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
            secrets = [str(merged.get(f.name)) for f in self.fields() if f.secret and merged.get(f.name)]
            secrets += url_secrets(str(merged.get("nats_url", "")))
            message = self._name_sources(message, sources)
            for secret in sorted(secrets, key=len, reverse=True):
                message = message.replace(secret, REDACTED)
            raise self.error(f"invalid configuration: {redact_text(message)}") from None

    def _name_sources(self, message: str, sources: Mapping[str, str]) -> str:
        """A cross-field error names settings by field (``a_b must not exceed c_d``, ``prefix: ...``);
        say which flag and value each one is. Quoted values and plain words are left alone."""
        by_name = {f.name: f for f in self.fields()}

        def named(name: str) -> str:
            f = by_name[name]
            return f"{f.flag} ({sources.get(name, f'default {f.default!r}')})"

        head, sep, rest = message.partition(": ")
        if sep and head in by_name:  # "prefix: <reason>"
            return f"{named(head)}: {rest}"
        words = re.compile(r"'[^']*'|\b(" + "|".join(re.escape(n) for n in by_name if "_" in n) + r")\b")
        return words.sub(lambda m: named(m.group(1)) if m.group(1) else m.group(0), message)

    def unknown_environment(self, environ: Mapping[str, str], known: Iterable[str] = (),
                            own: Iterable[str] | None = None) -> list[str]:
        """``STREAMPROC_*`` variables no setting reads, each with a suggestion when one is close:
        first a setting of the same name under a longer prefix, of ``own`` (the command's; this
        schema's by default): ``STREAMPROC_PORT`` for the edge is ``STREAMPROC_EDGE_PORT``, where
        difflib offered ``STREAMPROC_FORMAT`` (found by a newcomer walk)."""
        schema = {f.env for f in self.fields()}
        mine = schema if own is None else set(own)
        names = schema | set(known) | mine
        out = []
        for var in sorted(v for v in environ if v.startswith(ENV_PREFIX) and v not in names):
            nested = sorted(n for n in mine if n.endswith("_" + var[len(ENV_PREFIX):]))
            close = nested or difflib.get_close_matches(var, names, n=1)
            out.append(var + (f" (did you mean {close[0]}?)" if close else ""))
        return out

    def add_arguments(self, parser: argparse.ArgumentParser, names: list[str] | None = None,
                      custom: Mapping[str, Mapping[str, Any]] | None = None) -> None:
        """Add ``--kebab-name`` flags for the given settings (all by default), grouped by topic
        (:data:`HELP_GROUPS`) in ``--help``. Unset flags stay None. ``custom`` gives a setting's
        flag its own ``add_argument`` keywords (``nargs``, ``const``...)."""
        custom = custom or {}
        wanted = set(names) if names is not None else None
        chosen = [f for f in self.fields() if wanted is None or f.name in wanted]
        groups: dict[str, argparse._ArgumentGroup] = {}
        group_of = (lambda name: self._group) if self._group else help_group
        order = [self._group] if self._group else [*HELP_GROUPS, OTHER_GROUP]
        sources = " (flag > STREAMPROC_* environment > default)" if any(f.env for f in chosen) else \
            " (flag > default; no environment variables)"
        for title in order:
            if any(group_of(f.name) == title for f in chosen):
                groups[title] = parser.add_argument_group(f"{title} settings", HELP_GROUPS.get(title, "") + sources)
        for f in chosen:
            group = groups[group_of(f.name)]
            allowed = f" (one of: {', '.join(f.choices)})" if f.choices else ""
            help_text = f"{f.help}{allowed} [{f'env {f.env}, ' if f.env else ''}default {f.default!r}]"
            if f.name in custom:  # a flag shape of its own (an optional value, say); still this setting
                group.add_argument(f.flag, dest=self._dest + f.name, default=None, help=help_text,
                                   **custom[f.name])
                continue
            if f.secret:  # environment only (or the *_file setting); the flag exists only to say so
                group.add_argument(f.flag, dest=self._dest + f.name, default=None, action=_RefuseSecret,
                                   metavar=f.name.upper(),  # not argparse's name from the prefixed dest
                                   help=f"not accepted: set {f.env} or {f.flag}-file instead")
                continue
            if f.kind is bool:
                group.add_argument(f.flag, dest=self._dest + f.name, default=None,
                                   action=argparse.BooleanOptionalAction, help=help_text)
                continue
            if typing.get_origin(f.kind) in (tuple, list):  # repeatable: --rid a --rid b
                group.add_argument(f.flag, dest=self._dest + f.name, default=None, action="append",
                                   metavar=f.name.upper(), help=help_text + " (repeatable)")
                continue
            # Levels are accepted in any case, so argparse must not check them; the Struct does.
            choices = f.choices if f.name != "log_level" else None
            group.add_argument(f.flag, dest=self._dest + f.name, default=None,
                               metavar=None if choices else f.name.upper(), choices=choices, help=help_text)

    def from_arguments(self, args: argparse.Namespace, environ: Mapping[str, str] | None = None) -> S:
        """Settings from flags added by :meth:`add_arguments` (other arguments are ignored)."""
        return self.explain_arguments(args, environ)[0]

    def explain_arguments(self, args: argparse.Namespace,
                          environ: Mapping[str, str] | None = None) -> tuple[S, dict[str, str]]:
        return self.explain(environ, {f.name: getattr(args, self._dest + f.name, None) for f in self.fields()})


# The processor's settings. The flag destination prefix keeps them apart from a command's own
# arguments (simulate has its own --mode).
PROCESSOR = SettingsSchema(Settings, lambda name: ENV_PREFIX + name.upper(), dest_prefix="setting_")
fields = PROCESSOR.fields
load = PROCESSOR.load
explain = PROCESSOR.explain
add_arguments = PROCESSOR.add_arguments
from_arguments = PROCESSOR.from_arguments


# ------------------------------------------------------------ the other commands' settings
# `simulate`, `demo`, `token` and `codecs` declare their own options the same way, so every command
# validates, reports errors (naming flag and value, exit 2) and answers --print-config alike. They
# read no environment variables: a value is a flag or the default.

class SimulateOptions(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """``streamproc simulate``'s own options (its NATS settings are the processor's)."""

    requests: Annotated[int, documented("number of requests (planned, published and verified a window at a time: "
                                        "memory does not grow with it)", ge=1, le=10_000_000)] = 10
    mode: Annotated[Literal["agg", "pd", "mixed"], documented(
        "aggregated, prefill/decode or both alternating")] = "mixed"
    stream: Annotated[bool | None, documented(
        "--stream: streaming responses only; --unary: unary only; neither: alternate")] = None
    seed: Annotated[int, documented("seed of the planned traffic")] = 0
    shuffle: Annotated[bool, documented("shuffle every chunk, not just interleave legs (64 requests at a time, as "
                                                 "the legs are interleaved)")] = False
    duplicates: Annotated[float, documented("fraction of chunks published twice", ge=0, le=1)] = 0.0
    verify: Annotated[bool, documented("wait for the results of a running processor and verify them")] = False
    timeout: Annotated[float, documented("seconds to wait with --verify for the results: of the last requests, and "
                                         "of earlier ones while 512 are open and publishing waits", gt=0,
                                         le=86_400)] = 60.0


class DemoSettings(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """``streamproc demo``: embedded NATS, processor and simulated workers need nothing else."""

    requests: Annotated[int, documented("number of requests", ge=1, le=10_000_000)] = 200
    format: Annotated[str, documented("codec/worker format; empty: sglang-zstd if installed, else "
                                      "sglang")] = ""
    seed: Annotated[int, documented("seed of the planned traffic and its faults")] = 1
    timeout: Annotated[float, documented("seconds to wait for results: of the last requests, and of earlier ones "
                                         "while 512 are open and publishing waits", gt=0, le=86_400)] = 60.0
    serve: Annotated[int | None, documented(
        "after the summary keep NATS, the processor and the edge up on PORT (--serve alone: 8080, 0: any "
        "free port) and print the live page's URL; Ctrl-C stops")] = None

    def __post_init__(self) -> None:
        if self.serve is not None and not 0 <= self.serve <= 65535:
            raise ValueError("serve: a port is 0..65535")


# What PyJWT signs and verifies (jwt.algorithms.get_default_algorithms); "none" is deliberately absent.
AuthAlgorithm = Literal["HS256", "HS384", "HS512", "RS256", "RS384", "RS512", "PS256", "PS384", "PS512",
                        "ES256", "ES384", "ES512", "EdDSA"]


class TokenSettings(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """``streamproc token``. The signing key itself is read from ``key_file`` and never printed."""

    key_file: Annotated[str, documented("file holding the signing key (the HMAC secret, or the PEM private "
                                        "key whose public half the edge has)")] = ""
    algorithm: Annotated[AuthAlgorithm, documented("JWT algorithm, as the edge's --auth-algorithm")] = "HS256"
    rid: Annotated[tuple[str, ...], documented("a request id the token grants (repeatable)")] = ()
    rid_prefix: Annotated[str, documented("grant every request id starting with this prefix")] = ""
    operator: Annotated[bool, documented("grant every request, /v1/recent and the live page")] = False
    ttl: Annotated[float, documented("seconds until the token expires", gt=0,
                                    le=defaults.MAX_CAPABILITY_TTL)] = defaults.CAPABILITY_TTL
    subject: Annotated[str, documented("the client the edge counts streams for (sub); empty: a fresh id per "
                                       "token")] = ""


class CodecsSettings(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """``streamproc codecs`` has no settings: it lists the entry points it finds."""


def _no_environment(name: str) -> str:
    return ""


SIMULATE = SettingsSchema(SimulateOptions, _no_environment, dest_prefix="simulate_", group="simulate")
DEMO = SettingsSchema(DemoSettings, _no_environment, dest_prefix="demo_", group="demo")
TOKEN = SettingsSchema(TokenSettings, _no_environment, dest_prefix="token_", group="token")
CODECS = SettingsSchema(CodecsSettings, _no_environment, group="codecs")

# The processor settings `simulate` takes (it only publishes and reads).
SIMULATE_CONNECTION = (*NATS_CONNECTION, "prefix", "format", "log_level", "log_format")


def explained(settings: msgspec.Struct, origin: Mapping[str, str],
              names: Iterable[str] | None = None) -> dict[str, dict[str, Any]]:
    """Each setting's effective value and where it came from (secrets and URL credentials as
    ``<redacted>``); only ``names`` when given."""
    values = settings.redacted() if isinstance(settings, CommonSettings) else redacted(settings)
    wanted = set(names) if names is not None else None
    return {name: {"value": values[name], "source": origin[name]} for name in settings.__struct_fields__
            if wanted is None or name in wanted}


def print_config(settings: msgspec.Struct, origin: Mapping[str, str], names: Iterable[str] | None = None,
                 *, more: Mapping[str, Any] | None = None) -> str:
    """``--print-config``: every setting's effective value and where it came from, as JSON;
    ``more``: another settings record's :func:`explained` entries (a command's own options)."""
    return msgspec.json.format(msgspec.json.encode({**explained(settings, origin, names), **(more or {})}),
                               indent=2).decode()


def known_environment() -> set[str]:
    """Every ``STREAMPROC_*`` variable some command reads (processor and edge settings)."""
    from .edge.settings import env_names as edge_env_names  # the edge's settings build on this module

    return {f.env for f in PROCESSOR.fields()} | edge_env_names()


def unknown_environment_warnings(environ: Mapping[str, str], command: str = "run") -> list[str]:
    """One line per misspelt or unused ``STREAMPROC_*`` variable (they would be ignored silently),
    suggesting ``command``'s own settings first."""
    own = None
    if command == "edge":
        from .edge.settings import env_names as edge_env_names  # the edge's settings build on this module

        own = edge_env_names()
    return [f"unknown environment variable {v}, ignored"
            for v in PROCESSOR.unknown_environment(environ, known_environment(), own)]
