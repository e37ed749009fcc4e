"""Edge capabilities: who may read which request's results, decided from a JWT without calling anyone.

The frontend that accepted a request mints its client a short-lived JWT
(:func:`streamproc.client.capability.mint_capability`); the edge only verifies it with PyJWT
(``jwt.decode``: signature, ``exp`` required, ``aud`` = :data:`AUDIENCE`), checks its time claims
itself (:data:`TIME_CLAIMS`, a small leeway) and reads three claims: ``rids`` (request ids), ``rid_prefix`` (a tenant's ids), ``scope: "operator"``
(every request, ``/v1/recent`` and the page's data). With an asymmetric algorithm the edge holds
only the public key, so a compromised edge can read results but never mint a capability.

The token comes as ``Authorization: Bearer <jwt>`` or the ``access_token`` query parameter
(RFC 6750 sections 2.1 and 2.3: a browser's EventSource cannot set headers). It is never logged;
the access log's path shows ``access_token=<redacted>`` (:mod:`streamproc.logs`).
"""

from __future__ import annotations

import collections
import math
import time

import jwt
import msgspec

from ..config import read_setting_file
from ..core.defaults import EDGE_AUDIENCE as AUDIENCE
from ..core.defaults import OPERATOR_SCOPE as OPERATOR
from ..core.errors import ConfigError, InvalidCapability
from ..signing_keys import hmac_secret_problem, key_weakness

MAX_TOKEN_CHARS = 8192  # a JWT naming a few hundred ids; anything longer is not parsed at all
# Verified tokens remembered (Verifier): at most this many, each at most this long (~2 MiB at worst).
CACHED_TOKENS = 1024
MAX_CACHED_TOKEN_CHARS = 2048
# RFC 7519 NumericDate claims, read here, not by PyJWT: the versions pyproject allows (2.8 to 2.10's
# ``_validate_exp`` / ``_validate_nbf`` / ``_validate_iat``) take ``int()`` of each and catch only
# ValueError, so a signed ``Infinity`` or ``1e400`` (Python's json reads both as inf), a list or a
# null let OverflowError or TypeError out of ``jwt.decode``: a 500 and a traceback per request.
TIME_CLAIMS = ("exp", "nbf", "iat")


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
    unreadable file, an HMAC secret shorter than its hash (RFC 7518 section 3.2) or that is a public
    key or certificate, a private key (the edge needs only the public half), a PEM that does not fit
    the algorithm, or an RSA key under 2048 bits (RFC 7518 section 3.3).

    Each is what PyJWT would otherwise find on every request: an HS* "secret" that is an asymmetric
    key (PEM, DER, SSH) made every valid capability a 500 with a traceback (``InvalidKeyError`` from
    ``prepare_key``), and a short key an ``InsecureKeyLengthWarning`` on stderr."""
    data = read_setting_file(path, f"--auth-key-file {path!r}")
    verifier = jwt.get_algorithm_by_name(algorithm)
    if algorithm.startswith("HS"):
        wrong = hmac_secret_problem(algorithm, data)
        if wrong is not None:
            raise ConfigError(f"--auth-key-file {path!r}: {wrong}")
        return data.strip()  # a secret file's trailing newline is not part of the secret
    if b"PRIVATE KEY" in data:
        raise ConfigError(f"--auth-key-file {path!r} holds a private key: give the edge the public key only "
                          "(a compromised edge must not be able to mint capabilities)")
    try:  # jwt.algorithms.<Alg>.prepare_key: what jwt.decode does with it on every request
        prepared = verifier.prepare_key(data)
    except (jwt.InvalidKeyError, ValueError, TypeError, NotImplementedError) as exc:
        raise ConfigError(f"--auth-key-file {path!r} is not a public key for {algorithm}: {exc}") from None
    weak = key_weakness(verifier, prepared)
    if weak:
        raise ConfigError(f"--auth-key-file {path!r}: {weak}")
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
                token, self.key, algorithms=[self.algorithm], audience=AUDIENCE,
                options={"require": ["exp", "aud"], "verify_exp": False, "verify_nbf": False, "verify_iat": False},
            )
        except jwt.InvalidAudienceError:
            raise InvalidCapability(f"the token is not for {AUDIENCE!r} (aud)") from None
        except jwt.MissingRequiredClaimError as exc:
            raise InvalidCapability(f"the token has no {exc.claim!r} claim") from None
        except jwt.InvalidTokenError as exc:  # bad signature, wrong algorithm, not a JWT, nbf/iat
            raise InvalidCapability(f"invalid token: {type(exc).__name__}") from None
        except RecursionError:  # a header nested ~1,000 deep, parsed before the signature check: PyJWT 2.8 let it out (2.15 catches it)
            raise InvalidCapability("invalid token: DecodeError") from None
        exp = self._check_times(claims)
        try:
            capability = msgspec.convert(claims, Capability)
        except msgspec.ValidationError as exc:
            raise InvalidCapability(f"invalid capability claims: {exc}") from None
        try:  # an int past a float's range (a signed 10**400) was a 500: a token that never expires
            return capability, float(exp)
        except OverflowError:
            return capability, math.inf

    def _check_times(self, claims: dict) -> int:
        """``exp``, and ``nbf`` / ``iat`` when present, checked as PyJWT 2.15 checks them (``int()`` of
        each, so ``"exp": "1796157694"`` is that time; expired once ``exp <= now - leeway``, not yet
        valid while ``nbf`` or ``iat > now + leeway``), with every unreadable value a refusal. Returns
        ``exp``."""
        times = {}
        for name in TIME_CLAIMS:
            if name in claims:
                try:
                    times[name] = int(claims[name])
                except (ValueError, TypeError, OverflowError):  # NaN, ±Infinity, "soon", [1], null, 10**5000 digits
                    raise InvalidCapability(f"the token's {name!r} claim is not a finite number of seconds "
                                            "(NumericDate)") from None
        now = self._clock()
        if times["exp"] <= now - self.leeway:
            raise InvalidCapability("the token has expired")
        for name in ("nbf", "iat"):
            if name in times and times[name] > now + self.leeway:
                raise InvalidCapability(f"the token is not valid yet ({name!r} is in the future)")
        return times["exp"]


def presented_token(authorization: list[str], access_token: list[str]) -> str | None:
    """The bearer token of a request (header or query), or None if it has none.

    Raises :class:`InvalidCapability` for a non-Bearer header, or for a token sent twice
    (RFC 6750 section 2: a client MUST NOT use more than one method): in the header and the query,
    in two ``access_token`` parameters, or in two ``Authorization`` headers (RFC 9110 section 5.3:
    not a list; the edge read the first one, a proxy in front may read the last)."""
    if len(authorization) > 1:
        raise InvalidCapability("send the token once: one Authorization header")
    if authorization:
        scheme, _, value = authorization[0].strip().partition(" ")
        if scheme.lower() != "bearer" or not value.strip():
            raise InvalidCapability("the Authorization header must be 'Bearer <token>'")
        if access_token:
            raise InvalidCapability("send the token once: Authorization header or access_token, not both")
        return value.strip()
    if len(access_token) > 1:
        raise InvalidCapability("send the token once: one access_token parameter")
    return access_token[0] if access_token and access_token[0] else None
