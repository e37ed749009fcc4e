"""Edge settings: one typed record, filled from defaults < environment < command-line flags.

The settings the edge shares with the processor are one base record,
:class:`~streamproc.config.CommonSettings`, with the processor's names (``STREAMPROC_NATS_URL``,
``STREAMPROC_RESULTS_MAX_AGE``...), so one compose ``environment`` block serves both and the two
can never define the results stream differently; settings only the edge has are
``STREAMPROC_EDGE_<NAME>``.
The flag is always ``--kebab-name``.
"""

from __future__ import annotations

from typing import Annotated


from ..config import ENV_PREFIX, CommonSettings, ConfigError, SettingsSchema, documented

SHARED = frozenset(CommonSettings.__struct_fields__)


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
            "the processors' /metrics URLs (comma-separated) whose join-latency histograms the live "
            "page charts (GET /v1/stats); empty: the page charts results/s only"
        ),
    ] = ""

    def processor_metrics_urls(self) -> list[str]:
        return [url.strip() for url in self.processor_metrics_url.split(",") if url.strip()]

    def __post_init__(self) -> None:
        super().__post_init__()
        for url in self.processor_metrics_urls():
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"processor_metrics_url: {url!r} is not an http:// or https:// URL")


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
