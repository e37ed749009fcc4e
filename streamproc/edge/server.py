"""The Uvicorn server the edge runs on, built once for every caller (``streamproc edge``,
``streamproc demo --serve``, the tests' in-process edge): the edge's own HTTP protocol with its
bounds (``--max-connections``, ``--head-timeout``, ``--max-head-bytes``: connections.py), its accept
pacing, its TLS layer and its client-address rule. Importing this module does not import the web stack."""

from __future__ import annotations

import contextlib
import signal
import ssl
from typing import Any, Callable


def server_class(on_stop: Callable[[], None] | None = None, *, signals: bool = True):
    """The edge's ``uvicorn.Server``: its accept pacing and TLS layer (connections.py), and
    ``on_stop`` (``Edge.stop_streams``) when a stop begins. ``signals=False``: the caller owns
    SIGTERM/SIGINT and stops the server itself (``streamproc demo --serve``: two handlers of one signal
    would cancel Uvicorn in the middle of its shutdown)."""
    import uvicorn

    from .connections import ACCEPTS_PER_PASS, relisten, stop_accepting

    class Server(uvicorn.Server):
        """Uvicorn re-raises SIGTERM/SIGINT after its graceful shutdown (exit 143 or 130); for the edge,
        as for ``streamproc run``, a signal is the normal way to stop: exit 0. ``on_stop`` runs when
        the stop begins, before Uvicorn waits for the open responses (``Edge.stop_streams``: they
        end themselves instead of being cancelled after ``timeout_graceful_shutdown``)."""

        tls = None  # the SSLContext of --tls-cert-file (startup)
        http = None  # the edge's protocol class under its TLS layer (startup)

        async def startup(self, sockets=None) -> None:
            self.config.backlog = ACCEPTS_PER_PASS  # accept()s per loop pass; the listen queue: relisten
            context = self.config.ssl
            if context is not None:  # Uvicorn took it (tls_factory); the TLS layer is the edge's own, bounded
                self.config.ssl = None  # (connections.py, "TLS"): the server listens on plain TCP
                self.tls = context
                self.http = self.config.http_protocol_class
                self.config.http_protocol_class = self.http.over_tls(context)
            await super().startup(sockets)
            relisten(self.servers)  # (connections.py)

        def _log_started_message(self, listeners) -> None:
            # Uvicorn's "running on http(s)://" line reads config.ssl, which startup took over
            context, self.config.ssl = self.config.ssl, self.tls
            try:
                super()._log_started_message(listeners)
            finally:
                self.config.ssl = context

        async def shutdown(self, sockets=None) -> None:
            if on_stop is not None:
                on_stop()
            await stop_accepting(self.servers)
            if self.http is not None:
                self.http.end_handshakes()  # connections in their TLS handshake, which Uvicorn does not know of
            await super().shutdown(sockets)

        @contextlib.contextmanager
        def capture_signals(self):
            if not signals:
                yield
                return
            original = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
            try:
                yield
            finally:
                for sig, handler in original.items():
                    signal.signal(sig, handler)

    return Server


def tls_context(settings: Any) -> ssl.SSLContext:
    """The HTTPS context of --tls-cert-file and --tls-key-file, as Uvicorn's ``create_ssl_context``
    builds it (TLS server, no client certificate asked) but with a password callback that refuses:
    an encrypted key raises ``ValueError`` (``no_key_passphrase``) instead of OpenSSL prompting on the
    terminal. ``OSError``/``ssl.SSLError`` for a missing or mismatched pair."""
    from ..config import no_key_passphrase

    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(settings.tls_cert_file, settings.tls_key_file, no_key_passphrase)
    return context


def server_config(app: Any, settings: Any, *, access_log: bool = True, log_level: str | None = None,
                  tls: ssl.SSLContext | None = None) -> Any:
    """The ``uvicorn.Config`` of an edge app built by ``create_app(settings)``. ``access_log``: one
    ``event=http_request`` line per request (streamproc.logs); ``log_level``: Uvicorn's own, else
    ``--log-level``'s. ``tls``: the context start-up checked (``streamproc edge``), served as it is;
    without it one is built by :func:`tls_context` when Uvicorn loads. Uvicorn's own load read the key
    file again after the NATS connect, without a password callback: a key replaced meanwhile by an
    encrypted one made OpenSSL prompt on the terminal, and the edge hung there."""
    import uvicorn

    from .connections import protocol_class

    def tls_factory(config: Any, default: Any) -> ssl.SSLContext:
        return tls if tls is not None else tls_context(settings)

    return uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        lifespan="on",
        # llhttp in C (Uvicorn's "httptools"), with --max-connections, --head-timeout, --max-head-bytes
        http=protocol_class(settings, app.state.edge.metrics, app.state.edge.source.limited),
        # No WebSocket: the edge serves none, but Uvicorn's "auto" upgraded a handshake to whichever
        # library was installed beside it (wsproto comes with selenium), outside these bounds, and its
        # '"WebSocket <path>" 403' line logged the path whole, ?access_token=<jwt> included. A
        # handshake is now the plain GET it also is, answered and logged (redacted) like any other.
        ws="none",
        access_log=access_log,  # through the one log format: event=http_request (streamproc.logs)
        # The client's address is its connection's, unless it is a proxy --forwarded-allow-ips names:
        # Uvicorn's default (True, trusting FORWARDED_ALLOW_IPS, "127.0.0.1,::1" unset) took it from
        # X-Forwarded-For, so a client on the edge's host chose its address (--max-streams-per-client
        # under --insecure-demo, the access log's client=).
        proxy_headers=bool(proxies := settings.forwarded_proxies()),
        forwarded_allow_ips=proxies,  # never FORWARDED_ALLOW_IPS (read only for None)
        log_config=None,  # Uvicorn's records propagate to the root handler configure_logging installed
        log_level=(log_level or settings.log_level).lower(),
        timeout_graceful_shutdown=1,  # open SSE streams must not hold a SIGTERM past 2 s
        # HTTPS: uvicorn.Config.load takes the SSLContext from tls_factory, never builds its own
        ssl_context_factory=tls_factory if settings.tls_cert_file else None,
    )
