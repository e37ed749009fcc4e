"""Edge settings: one typed record, filled from defaults < environment < command-line flags.

The settings the edge shares with the processor are one base record,
:class:`~streamproc.config.CommonSettings`, with the processor's names (``STREAMPROC_NATS_URL``,
``STREAMPROC_RESULTS_MAX_AGE``...), so one compose ``environment`` block serves both and the two
can never define the results stream differently; settings only the edge has are
``STREAMPROC_EDGE_<NAME>``.
The flag is always ``--kebab-name``.
"""

from __future__ import annotations

import ipaddress
import re
from typing import Annotated
from urllib.parse import urlsplit

from typing import Any

from ..config import (REDACTED, ENV_PREFIX, AuthAlgorithm, CommonSettings, ConfigError, SettingsSchema, documented,
                      redact_query, redact_text)
from ..core import defaults

SHARED = frozenset(CommonSettings.__struct_fields__)
# An origin as browsers send it (RFC 6454 section 6.1): scheme, host, optional port, nothing else.
# The edge's own inboxes and the names below them (each edge its own, docs/security.md): NATS tokens
# without wildcards, so the shipped permissions can give each edge user exactly its subtree.
_INBOX_PREFIX = re.compile(re.escape(defaults.EDGE_INBOX_PREFIX) + r"(\.[A-Za-z0-9_-]{1,64}){0,4}")
CORS_ORIGIN = re.compile(r"https?://[A-Za-z0-9.\-]+(:[0-9]{1,5})?|https?://\[[0-9A-Fa-f:.]+\](:[0-9]{1,5})?")


class EdgeSettings(CommonSettings, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """Effective configuration of one edge."""

    host: Annotated[str, documented("address to listen on (0.0.0.0 in a container)", min_length=1)] = "127.0.0.1"
    port: Annotated[int, documented("HTTP port", ge=0, le=65535)] = 8080
    max_streams: Annotated[
        int, documented("concurrent result streams (SSE and unary) before new ones get 503", ge=1, le=1_000_000)
    ] = 1000
    keepalive: Annotated[
        float, documented("seconds of silence before a `: keep-alive` comment is sent", gt=0, le=3600)
    ] = 15.0
    result_timeout: Annotated[
        float,
        documented(
            "seconds without a new result before the edge ends a request "
            "with a timeout error (should exceed the processor's "
            "--request-timeout)",
            gt=0,
            le=7 * 86_400,
        ),
    ] = 330.0
    gap_timeout: Annotated[
        float,
        documented(
            "seconds a missing seq may stay missing while later ones wait "
            "before the stream is ended with an error (never spliced)",
            gt=0,
            le=3600,
        ),
    ] = 5.0
    recent: Annotated[
        int,
        documented(
            "recent request ids remembered for GET /v1/recent and the page; "
            "0 turns the wildcard subscription off",
            ge=0,
            le=100_000,
        ),
    ] = 50
    ensure_results_stream: Annotated[
        bool, documented("create (or validate) the JetStream results stream at start, so clients can attach late")
    ] = False
    processor_metrics_url: Annotated[
        str,
        documented(
            "the processors' /metrics URLs (comma-separated) whose join-wait and result-latency "
            "histograms GET /v1/stats reports and the live page charts (join wait); empty: the page "
            "charts results/s only"
        ),
    ] = ""


    # Edge authentication (docs/security.md "Edge capabilities"): a JWT per client, verified locally.
    auth_key_file: Annotated[str, documented(
        "file holding the key that verifies client capabilities (JWTs): the HMAC secret for HS*, or the "
        "PEM public key for RS*/PS*/ES*/EdDSA; required unless --insecure-demo")] = ""
    auth_algorithm: Annotated[AuthAlgorithm, documented("JWT signature algorithm capabilities must use")] = "HS256"
    auth_leeway: Annotated[float, documented("seconds of clock skew tolerated on a capability's exp/nbf/iat",
                                             ge=0, le=300)] = 30.0
    insecure_demo: Annotated[bool, documented(
        "serve without authentication (every result and /v1/recent to anyone; the page says so on screen); "
        "for `make demo` and local trials only")] = False
    max_streams_per_client: Annotated[int, documented(
        "concurrent result streams of one client (its capability's sub, or its address with "
        "--insecure-demo) before new ones get 429", ge=1, le=1_000_000)] = 32
    idle_stream_timeout: Annotated[float, documented(
        "seconds a result stream may wait for its first result before it is ended with a timeout error "
        "(frees the slots of clients waiting on ids nobody answers; later results have --result-timeout)",
        gt=0, le=7 * 86_400)] = 120.0
    max_replay_consumers: Annotated[int, documented(
        "temporary JetStream consumers the edge may hold at once for late attaches reading a stored "
        "history; past it a history is read by subject, one STREAM.MSG.GET per result (slower, no "
        "consumer), so no client load makes one edge use up the results stream's consumers", ge=0,
        le=100_000)] = 128
    write_timeout: Annotated[float, documented(
        "seconds one write to a client may block (a client that stopped reading) before its stream is "
        "closed; any other answer's connection is cut when the client takes nothing of it for as long",
        gt=0, le=3600)] = 30.0
    replay_read_budget: Annotated[int, documented(
        "bytes of stored results all replays (late attaches, resumes, catch-ups) together may have asked "
        "nats-server for and not yet received; past it a replay waits its turn. Keep it well under "
        "nats-server's max_pending (64 MiB), past which the server cuts the edge's connection as a slow "
        "consumer", ge=64 * 1024, le=2**34)] = 16 * 1024 * 1024
    stream_buffer_bytes: Annotated[int, documented(
        "bytes of results buffered for one stream while its client is behind; past it the stream is ended "
        "with an error event (at least the NATS max_payload)", ge=64 * 1024, le=2**34)] = 8 * 1024 * 1024
    max_unary_bytes: Annotated[int, documented(
        "bytes of results (each result's body, request id, traceparent and 96 bytes) a unary "
        "(application/json) answer may collect; past it the request is "
        "refused with a too_large error (read such results as a stream)", ge=1024, le=2**36)] = 16 * 1024 * 1024
    tls_cert_file: Annotated[str, documented("PEM certificate (chain) the edge serves HTTPS with (with "
                                             "--tls-key-file)")] = ""
    tls_key_file: Annotated[str, documented("PEM private key of --tls-cert-file")] = ""
    max_connections: Annotated[int, documented(
        "open HTTP connections (streams, waiting opens, idle keep-alive ones) before a new connection is "
        "answered 503 at once, unread; keep it above --max-streams", ge=1, le=1_000_000)] = 2048
    head_timeout: Annotated[float, documented(
        "seconds a connection may take to send a complete request head (after it opened, after its "
        "previous request and response ended, or from its first byte while a response is in progress) "
        "before it gets 408 and is closed; also the time a POST /v1/experts body may take after its head, "
        "and a body the edge answered without reading may take after the answer", gt=0, le=3600)] = 10.0
    max_head_bytes: Annotated[int, documented(
        "bytes of a request head (request line and headers) before it gets 431 and the connection is "
        "closed; a body does not count", ge=1024, le=16 * 1024 * 1024)] = 64 * 1024
    inbox_prefix: Annotated[str, documented(
        "the edge's NATS inbox prefix (its consumers deliver there): _INBOX.streamproc.edge or a name below "
        "it; give each edge of a deployment its own, and its NATS user only that subscription, so no edge "
        "reads another's deliveries (docs/security.md)")] = defaults.EDGE_INBOX_PREFIX
    forwarded_allow_ips: Annotated[str, documented(
        "addresses or networks (comma-separated: 10.0.0.5,10.1.0.0/16) of the reverse proxies in front of "
        "the edge, whose X-Forwarded-For names the client (the access log's client=, and the client of "
        "--max-streams-per-client under --insecure-demo); empty: none, a client is its connection's address")] = ""
    cors_origin: Annotated[str, documented(
        "origins (comma-separated, exact scheme://host[:port]) whose pages may read results through a "
        "visitor's browser (CORS); empty: no Access-Control-* header, closed")] = ""

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.auth_key_file and not self.insecure_demo:
            raise ValueError("no auth_key_file: the edge serves results only to their owners, so it needs "
                             "the key that verifies their capabilities (docs/security.md); --insecure-demo "
                             "serves everyone instead")
        if self.auth_key_file and self.insecure_demo:
            raise ValueError("auth_key_file and insecure_demo exclude each other")
        if bool(self.tls_cert_file) != bool(self.tls_key_file):
            raise ValueError("tls_cert_file and tls_key_file go together")
        for url in self.processor_metrics_urls():
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"processor_metrics_url: {redact_query(redact_text(url))!r} is not an http:// or "
                                 "https:// URL")
            # GET /v1/stats names every URL (and --print-config prints it), while the scrape (urllib)
            # never sends userinfo: it took ``user:pw@host`` for the host name and failed to resolve it.
            # A query is sent (a scrape endpoint may take its credential there): shown with its values
            # redacted (redact_query).
            # A password holding "/", "?" or "#" (not percent-encoded) ends urlsplit's netloc there: its
            # "@" lands in the path (shown whole), or the host part's "port" is the password's start.
            parts = urlsplit(url)
            before = url.partition("?")[0].partition("#")[0]
            if "@" in before:
                shown = redact_query(f"{parts.scheme}://{REDACTED}@{before.rpartition('@')[2]}{url[len(before):]}")
                raise ValueError(f"processor_metrics_url: {shown!r} holds credentials "
                                 "(user:password@), "
                                 "which the edge's scrape does not send and GET /v1/stats would show; give the "
                                 "edge a URL of the processor's status port without them")
            try:
                parts.port
            except ValueError:
                raise ValueError(f"processor_metrics_url: '{parts.scheme}://{REDACTED}' has a port that is not a "
                                 "number (a password holding '?' or '#' ends the host there); give the edge a URL "
                                 "of the processor's status port, host[:port], without credentials") from None

        if not _INBOX_PREFIX.fullmatch(self.inbox_prefix):
            raise ValueError(f"inbox_prefix: {self.inbox_prefix!r} is not {defaults.EDGE_INBOX_PREFIX} or a "
                             f"name below it ({defaults.EDGE_INBOX_PREFIX}.<token>[.<token>...], tokens of "
                             "letters, digits, '-' and '_')")
        for proxy in self.forwarded_proxies():
            try:  # Uvicorn keeps anything else as a literal no peer matches, and takes '*' for every peer
                named = ipaddress.ip_network(proxy) if "/" in proxy else ipaddress.ip_address(proxy)
            except ValueError:
                raise ValueError(f"forwarded_allow_ips: {proxy!r} is not an IP address or network (10.0.0.5, "
                                 "10.1.0.0/16); '*' is refused: name the proxies in front of the edge") from None
            if isinstance(named, (ipaddress.IPv4Network, ipaddress.IPv6Network)) and named.prefixlen == 0:
                # uvicorn.middleware.proxy_headers._TrustedHosts trusts it as given: '*' for its family
                raise ValueError(f"forwarded_allow_ips: {proxy!r} is every address, refused as '*' is (any "
                                 "client would name its own address): name the proxies in front of the edge")
        for origin in self.cors_origins():
            if not CORS_ORIGIN.fullmatch(origin):
                raise ValueError(f"cors_origin: {origin!r} is not an origin (scheme://host[:port], no path; "
                                 "'*' is refused: name the pages that may read results)")

    def forwarded_proxies(self) -> list[str]:
        return [item.strip() for item in self.forwarded_allow_ips.split(",") if item.strip()]

    def cors_origins(self) -> list[str]:
        return [origin.strip() for origin in self.cors_origin.split(",") if origin.strip()]

    def processor_metrics_urls(self) -> list[str]:
        return [url.strip() for url in self.processor_metrics_url.split(",") if url.strip()]

    def redacted(self) -> dict[str, Any]:
        """As the processor's (``--print-config``), and --processor-metrics-url's query values redacted,
        as GET /v1/stats names them (``stats.StatsSource``)."""
        out = super().redacted()
        out["processor_metrics_url"] = ",".join(map(redact_query, self.processor_metrics_urls()))
        return out


EdgeConfigError = ConfigError  # the edge's settings fail exactly like the processor's


def _env_name(name: str) -> str:
    return ENV_PREFIX + ("" if name in SHARED else "EDGE_") + name.upper()


SCHEMA = SettingsSchema(EdgeSettings, _env_name, error=EdgeConfigError,
                        title="settings (flag > STREAMPROC_* environment > default)")
fields = SCHEMA.fields
load = SCHEMA.load
add_arguments = SCHEMA.add_arguments
from_arguments = SCHEMA.from_arguments


def env_names() -> set[str]:
    return {f.env for f in fields()}
