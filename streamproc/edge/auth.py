"""Edge capabilities: who may read which request's results, decided from a JWT without calling anyone.

The frontend that accepted a request mints its client a short-lived JWT
(:func:`streamproc.client.capability.mint_capability`); the edge only verifies it with PyJWT
(``jwt.decode``: signature, ``exp`` required, ``aud`` = :data:`AUDIENCE`, a small leeway) and
reads three claims: ``rids`` (request ids), ``rid_prefix`` (a tenant's ids), ``scope: "operator"``
(every request, ``/v1/recent`` and the page's data). With an asymmetric algorithm the edge holds
only the public key, so a compromised edge can read results but never mint a capability.

The token comes as ``Authorization: Bearer <jwt>`` or the ``access_token`` query parameter
(RFC 6750 sections 2.1 and 2.3: a browser's EventSource cannot set headers). It is never logged;
the access log's path shows ``access_token=<redacted>`` (:mod:`streamproc.logs`).
"""

from __future__ import annotations

import collections
import time
from pathlib import Path

import jwt
import msgspec

from ..core.defaults import EDGE_AUDIENCE as AUDIENCE
from ..core.defaults import OPERATOR_SCOPE as OPERATOR
from ..core.errors import ConfigError, InvalidCapability
MAX_TOKEN_CHARS = 8192  # a JWT naming a few hundred ids; anything longer is not parsed at all
MIN_HMAC_KEY_BYTES = 32  # RFC 7518 section 3.2: a key at least as long as the hash output
# Verified tokens remembered (Verifier): at most this many, each at most this long (~2 MiB at worst).
CACHED_TOKENS = 1024
MAX_CACHED_TOKEN_CHARS = 2048


class Capability(msgspec.Struct, frozen=True, forbid_unknown_fields=False):
    """The claims the edge acts on (others, such as ``iat`` or ``iss``, are ignored)."""

    sub: str = ""
    rids: tuple[str, ...] = ()
    rid_prefix: str = ""
    scope: str = ""

    @property
    def operator(self) -> bool:
        return self.scope == OPERATOR

    def allows(self, request_id: str) -> bool:
        """Operators read every request; others the ids their claims name, or their prefix's."""
        if self.operator or request_id in self.rids:
            return True
        return bool(self.rid_prefix) and request_id.startswith(self.rid_prefix)


def load_key(path: str, algorithm: str) -> bytes:
    """The verification key from ``--auth-key-file``. Raises :class:`ConfigError` (exit 2) for an
    unreadable file, a short HMAC secret, a private key (the edge needs only the public half) or a
    PEM that does not fit the algorithm."""
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise ConfigError(f"cannot read --auth-key-file {path!r}: {exc.strerror or exc}") from None
    if algorithm.startswith("HS"):
        data = data.strip()
        if len(data) < MIN_HMAC_KEY_BYTES:
            raise ConfigError(f"--auth-key-file {path!r}: an {algorithm} secret needs at least "
                              f"{MIN_HMAC_KEY_BYTES} bytes, it has {len(data)}")
        return data
    if b"PRIVATE KEY" in data:
        raise ConfigError(f"--auth-key-file {path!r} holds a private key: give the edge the public key only "
                          "(a compromised edge must not be able to mint capabilities)")
    try:  # jwt.algorithms.<Alg>.prepare_key: what jwt.decode does with it on every request
        jwt.get_algorithm_by_name(algorithm).prepare_key(data)
    except (jwt.InvalidKeyError, ValueError, TypeError, NotImplementedError) as exc:
        raise ConfigError(f"--auth-key-file {path!r} is not a public key for {algorithm}: {exc}") from None
    return data


class Verifier:
    """Checks a presented token; the key and rules are fixed at start-up.

    A token verified once is remembered (least recently used first out, :data:`CACHED_TOKENS`)
    with its capability until its ``exp`` (+ leeway): a client that reconnects, resumes or opens
    several streams with one capability pays PyJWT's check once (40 µs with HS256, 120-140 µs with
    ES256/EdDSA per open, docs/benchmarks.md, against ~300 µs for the rest of an open). The key is
    the whole token, signature included, so only the very bytes that were verified hit; refusals
    are not remembered (a token not yet valid, ``nbf``, is checked again next time)."""

    def __init__(self, key: bytes, algorithm: str, leeway: float, clock=time.time) -> None:
        self.key = key
        self.algorithm = algorithm
        self.leeway = leeway
        self._clock = clock
        self._verified: collections.OrderedDict[str, tuple[Capability, float]] = collections.OrderedDict()
        self.hits = 0  # verifications answered from the cache (tests)

    def verify(self, token: str) -> Capability:
        """The token's capability. Raises :class:`InvalidCapability` with a reason for the client."""
        cached = self._verified.get(token)
        if cached is not None:
            capability, expires = cached
            if self._clock() < expires:  # PyJWT _validate_exp: expired once exp <= now - leeway
                self._verified.move_to_end(token)
                self.hits += 1
                return capability
            del self._verified[token]  # expired: jwt.decode below says so
        capability, exp = self._decode(token)
        if len(token) <= MAX_CACHED_TOKEN_CHARS:
            self._verified[token] = (capability, exp + self.leeway)
            if len(self._verified) > CACHED_TOKENS:
                self._verified.popitem(last=False)
        return capability

    def _decode(self, token: str) -> tuple[Capability, float]:
        """PyJWT's verification: the capability and the token's ``exp``."""
        if len(token) > MAX_TOKEN_CHARS:
            raise InvalidCapability(f"the token is longer than {MAX_TOKEN_CHARS} characters")
        try:
            claims = jwt.decode(
                token, self.key, algorithms=[self.algorithm], audience=AUDIENCE, leeway=self.leeway,
                options={"require": ["exp", "aud"]},
            )
        except jwt.ExpiredSignatureError:
            raise InvalidCapability("the token has expired") from None
        except jwt.InvalidAudienceError:
            raise InvalidCapability(f"the token is not for {AUDIENCE!r} (aud)") from None
        except jwt.MissingRequiredClaimError as exc:
            raise InvalidCapability(f"the token has no {exc.claim!r} claim") from None
        except jwt.InvalidTokenError as exc:  # bad signature, wrong algorithm, not a JWT, nbf/iat
            raise InvalidCapability(f"invalid token: {type(exc).__name__}") from None
        try:
            return msgspec.convert(claims, Capability), float(claims["exp"])
        except msgspec.ValidationError as exc:
            raise InvalidCapability(f"invalid capability claims: {exc}") from None


def presented_token(authorization: str | None, access_token: list[str]) -> str | None:
    """The bearer token of a request (header or query), or None if it has none.

    Raises :class:`InvalidCapability` for a non-Bearer header, or for a token sent twice
    (RFC 6750 section 2: a client MUST NOT use more than one method)."""
    if authorization is not None:
        scheme, _, value = authorization.strip().partition(" ")
        if scheme.lower() != "bearer" or not value.strip():
            raise InvalidCapability("the Authorization header must be 'Bearer <token>'")
        if access_token:
            raise InvalidCapability("send the token once: Authorization header or access_token, not both")
        return value.strip()
    if len(access_token) > 1:
        raise InvalidCapability("send the token once: one access_token parameter")
    return access_token[0] if access_token and access_token[0] else None
