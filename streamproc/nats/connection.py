"""The one way streamproc connects to NATS: authentication, TLS, a bounded first connect.

Every command that connects out (``run``, ``edge``, ``simulate``) calls :func:`connect` with its
settings, so each supports the same mechanisms (user and password, token, nkey seed, ``.creds``
file, TLS with a CA file, client certificate) under the same ``STREAMPROC_NATS_*`` names, with
the same hardened client (:func:`~streamproc.nats.fast_client.new_client`).

A refused credential or a certificate that does not verify will not get better by retrying, so the
first connect stops at the first such error with one line naming the cause, instead of retrying
until ``--connect-timeout``. Later disconnects are retried as before. No text this module produces
contains a secret: URLs are redacted and every known secret is scrubbed from error messages.
"""

from __future__ import annotations

import base64
import math
import os
import ssl
import stat
from collections import UserString
from typing import Any, Awaitable, Callable

import anyio
import nats.errors
from nats.aio.client import Client as NatsClient

from ..config import (ENV_PREFIX, REDACTED, CommonSettings, no_key_passphrase, read_setting_file, redact_text,
                      redact_url, split_userinfo)
from ..core.errors import ConfigError, StartupError
from ..logs import error_text
from .fast_client import new_client

ErrorCallback = Callable[[Exception], Awaitable[None]]


def _named(setting: str, path: str) -> str:
    """A file setting as an error names it: flag, variable and value (``--nats-creds-file
    (STREAMPROC_NATS_CREDS_FILE) '/etc/x.creds'``), wherever the value came from."""
    return f"--{setting.replace('_', '-')} ({ENV_PREFIX}{setting.upper()}) {path!r}"


def _read_secret(path: str, setting: str) -> str:
    data = read_setting_file(path, _named(setting, path))
    try:
        value = data.decode().strip()
    except UnicodeDecodeError:  # the message names no byte of the secret, only that it is not text
        raise ConfigError(f"{_named(setting, path)} is not valid UTF-8") from None
    if not value:
        raise ConfigError(f"{_named(setting, path)} is empty")
    return value


def _user_seed(seed: bytes) -> bool:
    """Whether nkeys takes ``seed`` for a user's (nats-py signs the server's nonce with it at connect)."""
    import nkeys  # as nats-py does: only a command that uses nkeys loads them

    if not seed.startswith(b"SU"):
        return False
    try:
        nkeys.from_seed(bytearray(seed)).wipe()
    except Exception:  # noqa: BLE001 - nkeys raises ValueError, TypeError or its own errors; its text is not shown
        return False
    return True


_CREDS_JWT = b"BEGIN NATS USER JWT"
_CREDS_SEED = b"BEGIN USER NKEY SEED"


def read_creds(path: str, named: str) -> tuple[bytes, bytes]:
    """The user JWT and nkey seed of a ``.creds`` file, each the line after its ``BEGIN`` marker
    line, as nats-py 2.16 reads them (``Client._read_creds_user_jwt``, ``_read_creds_user_nkey``);
    :class:`ConfigError` naming the file, and no byte of it, when either is missing or the seed is
    no user seed. nats-py's own readers fail on such a file at the connect, after the server's
    nonce: without a seed, a ``TypeError`` (which ends its reconnect task for good), without a JWT
    line, ``readline()`` at the end of the file for ever, on the event loop (tests/test_nats_auth.py)."""
    return parse_creds(read_setting_file(path, named), named)


def parse_creds(data: bytes, named: str) -> tuple[bytes, bytes]:
    """:func:`read_creds` of a ``.creds`` file's content."""
    lines = data.splitlines()
    found = {}
    for marker in (_CREDS_JWT, _CREDS_SEED):
        at = next((i for i, line in enumerate(lines) if marker in line), None)
        value = lines[at + 1].strip() if at is not None and at + 1 < len(lines) else b""
        if not value or value.startswith(b"-"):  # an END line right after BEGIN: nothing in between
            what = "user JWT" if marker is _CREDS_JWT else "user nkey seed"
            raise ConfigError(f"{named} holds no {what} (a line after '-----{marker.decode()}-----'): not a "
                              ".creds file (nsc generate creds writes one)")
        found[marker] = value
    seed = found[_CREDS_SEED]
    if not _user_seed(seed):
        raise ConfigError(f"{named} holds no valid user nkey seed (SU..., 58 characters) after "
                          f"'-----{_CREDS_SEED.decode()}-----'")
    return found[_CREDS_JWT], seed


def creds_callbacks(path: str | os.PathLike[str] | UserString, named: str, *,
                    keep: bool = True) -> tuple[Callable[[], bytes], Callable[[str], bytes]]:
    """nats-py's ``user_jwt_cb`` and ``signature_cb`` for a ``.creds`` file, in place of its own
    ``user_credentials`` reader: the file is read (checked once now: a broken one is a ConfigError
    at start-up) and read again at every connect, as nats-py does, so a rotated file is taken; broken
    meanwhile, the reconnect fails with a ``nats.errors.Error`` saying why, which nats-py reports
    to the error callback and retries (a repaired file is taken at the next attempt). ``path`` may
    also be the content itself, as nats-py's ``RawCredentials`` (a ``UserString``). A file that is no
    regular file (a pipe) is read once, now, and what it held used at every connect; ``keep`` false:
    not kept for the process beside (``read_setting_file``), only by these callbacks."""
    if isinstance(path, UserString) or not _regular(os.fspath(path)):
        content = path.data.encode() if isinstance(path, UserString) else read_setting_file(os.fspath(path), named,
                                                                                           keep=keep)

        def load() -> tuple[bytes, bytes]:
            return parse_creds(content, named)
    else:
        file = os.fspath(path)

        def load() -> tuple[bytes, bytes]:
            return read_creds(file, named)

    load()

    def read() -> tuple[bytes, bytes]:
        try:
            return load()
        except ConfigError as exc:  # caught by nats-py's connect and reconnect loops (Error), reported, retried
            raise nats.errors.Error(str(exc)) from None

    def user_jwt() -> bytes:
        return read()[0]

    def sign(nonce: str) -> bytes:
        import nkeys

        keys = nkeys.from_seed(bytearray(read()[1]))
        try:
            return base64.b64encode(keys.sign(nonce.encode()))  # nats-py's sig_cb (_setup_nkeys_jwt_connect)
        finally:
            keys.wipe()

    return user_jwt, sign


def _regular(path: str) -> bool:
    """Whether ``path`` is a regular file; True when it cannot be read (the read then says why)."""
    try:
        return stat.S_ISREG(os.stat(path).st_mode)
    except OSError:
        return True


def servers(settings: CommonSettings) -> list[str]:
    return [s.strip() for s in settings.nats_url.split(",") if s.strip()]


# nats-py sends a URL's credentials never beside these (its CONNECT takes them first), so they are dropped...
_SETTING_CREDENTIALS = ("user", "token")
# ...but beside a signature only where the server's INFO carries no nonce (no nkey or JWT users): left as written
_SIGNATURE_CREDENTIALS = ("nkeys_seed_str", "user_jwt_cb")


def url_credentials(urls: list[str], options: dict[str, Any]) -> tuple[list[str], dict[str, str]]:
    """The servers to give nats-py, and the URLs' credentials as its ``user``/``password`` or ``token``
    options, which it sends to every server: to those a cluster's INFO names (``connect_urls``) too.
    A URL's userinfo went only to the server written with it, so with ``nats://user:pw@n0`` losing n0
    made every reconnect to n1 or n2 an ``Authorization Violation`` while n0 was down.

    Taken out only when nats-py would have sent it the same way to every server: one userinfo in
    every ``nats://``/``tls://`` server that has one (several differing ones, or a websocket URL,
    whose userinfo aiohttp sends itself, are left as written). With a user or token setting nats-py
    never sent the URL's, so they are dropped; with an nkey seed or .creds file it sent them to a
    server asking for no signature (no nonce), so they are left as written. The values are as
    nats-py's ``urlparse`` reads them: undecoded, the user up to the first ``:``, no ``:`` a token."""
    written = [split_userinfo(url) for url in urls]
    found = {userinfo for url, (_, userinfo, _) in zip(urls, written) if "@" in url}
    if (not found or any(prefix.startswith(("ws://", "wss://")) for prefix, _, _ in written)
            or any(key in options for key in _SIGNATURE_CREDENTIALS)):
        return urls, {}
    if any(key in options for key in _SETTING_CREDENTIALS):
        return [prefix + host for prefix, _, host in written], {}
    if len(found) > 1 or "" in found:
        return urls, {}
    user, colon, password = found.pop().partition(":")
    return [prefix + host for prefix, _, host in written], ({"user": user, "password": password} if colon
                                                            else {"token": user})


def tls_context(settings: CommonSettings) -> ssl.SSLContext | None:
    """A verifying client context with the configured CA and client certificate, or None (nats-py
    then uses the system's CAs when a ``tls://`` URL or the server asks for TLS)."""
    if not (settings.nats_tls_ca_file or settings.nats_tls_cert_file):
        return None
    context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH)
    try:
        if settings.nats_tls_ca_file:
            context.load_verify_locations(cafile=settings.nats_tls_ca_file)
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError(f"cannot load {_named('nats_tls_ca_file', settings.nats_tls_ca_file)}: {exc}") from None
    if settings.nats_tls_cert_file:
        try:
            context.load_cert_chain(settings.nats_tls_cert_file, settings.nats_tls_key_file, no_key_passphrase)
        except (OSError, ssl.SSLError, ValueError) as exc:  # ValueError: no_key_passphrase
            cert = _named("nats_tls_cert_file", settings.nats_tls_cert_file)
            key = _named("nats_tls_key_file", settings.nats_tls_key_file)
            raise ConfigError(f"cannot load the client certificate {cert} with key {key}: {exc}") from None
    return context


def connect_options(settings: CommonSettings) -> dict[str, Any]:
    """The authentication and TLS keyword arguments of ``nats.connect`` for these settings.

    Reads secret files now, so a missing or unreadable file is a configuration error at start-up
    (exit 2), not a connect failure later.
    """
    options: dict[str, Any] = {}
    if settings.nats_user:
        options["user"] = settings.nats_user
        options["password"] = settings.nats_password or _read_secret(settings.nats_password_file,
                                                                     "nats_password_file")
    if settings.nats_token or settings.nats_token_file:
        options["token"] = settings.nats_token or _read_secret(settings.nats_token_file, "nats_token_file")
    if settings.nats_nkey_seed_file:
        seed = _read_secret(settings.nats_nkey_seed_file, "nats_nkey_seed_file")
        if not _user_seed(seed.encode()):  # else nats-py's connect fails (exit 1), blaming the connection
            raise ConfigError(f"{_named('nats_nkey_seed_file', settings.nats_nkey_seed_file)} holds no valid user "
                              "nkey seed (one line, SU..., 58 characters)")
        options["nkeys_seed_str"] = seed
    if settings.nats_creds_file:
        jwt_cb, signature_cb = creds_callbacks(settings.nats_creds_file,
                                               _named("nats_creds_file", settings.nats_creds_file))
        options["user_jwt_cb"] = jwt_cb
        options["signature_cb"] = signature_cb
    context = tls_context(settings)
    if context is not None:
        options["tls"] = context
    return options


def secrets_of(settings: CommonSettings, options: dict[str, Any] | None = None) -> list[str]:
    """Every secret string to keep out of output: settings, URL credentials, secrets read from files."""
    found = list(settings.secret_values())
    for key in ("password", "token", "nkeys_seed_str"):
        if options and options.get(key):
            found.append(str(options[key]))
    return sorted({s for s in found if s}, key=len, reverse=True)


def scrub(text: str, secrets: list[str]) -> str:
    """``text`` with every secret replaced by ``<redacted>`` (and URL credentials redacted)."""
    for secret in secrets:
        text = text.replace(secret, REDACTED)
    return redact_text(text)


def is_fatal(exc: BaseException) -> bool:
    """Errors a retry cannot fix: refused credentials, a certificate that does not verify."""
    if isinstance(exc, (nats.errors.AuthorizationError, ssl.SSLError)):
        return True
    text = str(exc).lower()
    return isinstance(exc, nats.errors.Error) and ("authorization" in text or "authentication" in text
                                                   or "permissions violation" in text and "connect" in text)


# With TLS 1.3 the server checks a client certificate after the client's handshake has finished,
# so a rejected certificate often surfaces as a connection closed right after set-up, not as an
# SSL alert. A few in a row, over TLS, while connecting for the first time, are treated as refusal.
TLS_RESETS_ARE_REFUSAL = 3
TLS_RESET_HINT = ("the server closed the connection during TLS set-up: does it require a client "
                  "certificate, or reject this one (nats_tls_cert_file, nats_tls_key_file)?")


def _is_reset(exc: BaseException) -> bool:
    return isinstance(exc, (ConnectionResetError, BrokenPipeError)) or (
        isinstance(exc, nats.errors.UnexpectedEOF))


def describe(exc: BaseException, *, tls: bool = False) -> str:
    """One line naming the cause, with a hint for the common ones."""
    text = error_text(exc)
    if tls and _is_reset(exc):
        return f"{text} ({TLS_RESET_HINT})"
    if isinstance(exc, ssl.SSLCertVerificationError):
        return f"{text} (is nats_tls_ca_file the CA that signed the server's certificate?)"
    if isinstance(exc, ssl.SSLError) and "certificate required" in str(exc).lower():
        return f"{text} (the server requires a client certificate: nats_tls_cert_file and nats_tls_key_file)"
    if is_fatal(exc) and not isinstance(exc, ssl.SSLError):
        return f"{text} (the server refused the credentials)"
    return text


async def connect(settings: CommonSettings, *, name: str, reconnect: bool = True,
                  error_cb: ErrorCallback | None = None, **callbacks: Any) -> NatsClient:
    """Connect with the settings' credentials and TLS; raise :class:`StartupError` (one line, no
    secret) when the server refuses them, or nothing answers within ``connect_timeout``.

    ``reconnect``: retry the first connect and every later disconnect forever (the processor, the
    edge), or fail at the first error (``simulate``). ``callbacks`` go to ``nats.connect``.
    """
    options = connect_options(settings)
    hidden = secrets_of(settings, options)
    pool, from_url = url_credentials(servers(settings), options)
    options.update(from_url)
    where = redact_url(settings.nats_url)
    errors: list[Exception] = []
    fatal: list[Exception] = []
    nc = new_client()  # survives what nats-py cannot parse (robust.py), header work fast (fast_client.py)
    connecting = True
    connected = False  # once the first connect succeeded
    disconnected_cb = callbacks.get("disconnected_cb")
    if disconnected_cb is not None:
        async def on_disconnected() -> None:
            # nats-py calls it from close() of a client that never connected too (the first connect
            # given up below): no connection was lost then, so no event=disconnected, no disconnect counted
            if connected:
                await disconnected_cb()

        callbacks["disconnected_cb"] = on_disconnected

    tls = "tls" in options or any(u.startswith("tls://") for u in pool)

    async def on_error(exc: Exception) -> None:
        if connecting:
            errors.append(exc)
        resets = 0
        for earlier in reversed(errors):
            if not _is_reset(earlier):
                break
            resets += 1
        if connecting and not fatal and (is_fatal(exc) or (tls and resets >= TLS_RESETS_ARE_REFUSAL)):
            fatal.append(exc)
            scope.cancel()  # first connect: stop retrying a credential the server refused
        if error_cb is not None:
            await error_cb(exc)

    limit = settings.connect_timeout if settings.connect_timeout > 0 else math.inf
    failure: BaseException | None = None
    with anyio.move_on_after(limit) as scope:
        try:
            await nc.connect(
                servers=pool,
                name=name,
                allow_reconnect=reconnect,
                max_reconnect_attempts=-1 if reconnect else 0,
                reconnect_time_wait=1 if reconnect else 0.2,
                connect_timeout=max(1, min(5, int(limit))) if limit != math.inf else 5,
                error_cb=on_error,
                **options,
                **callbacks,
            )
        except Exception as exc:  # noqa: BLE001 - reported below as one line
            failure = exc
        except BaseException:  # cancelled from outside (a signal): release the half-open client
            with anyio.move_on_after(1, shield=True):
                await _close_quietly(nc)
            raise
    connecting = False
    if nc.is_connected:
        connected = True
        return nc
    with anyio.move_on_after(1):
        await _close_quietly(nc)
    cause = fatal[0] if fatal else (errors[-1] if errors else failure)
    if fatal or (failure is not None and not scope.cancelled_caught):
        raise StartupError(scrub(f"cannot connect to NATS at {where}: {describe(cause, tls=tls)}", hidden))
    detail = f": {describe(cause, tls=tls)}" if cause is not None else ""
    raise StartupError(scrub(f"cannot connect to NATS at {where} within {settings.connect_timeout}s{detail}",
                             hidden))


async def _close_quietly(nc: NatsClient) -> None:
    """Close a client that never connected. Callers bound the wait: a client whose TLS handshake
    failed can wait forever in close() (nats-py 2.16)."""
    try:
        await nc.close()
    except Exception:  # noqa: BLE001 - a half-open client; nothing left to release
        pass
