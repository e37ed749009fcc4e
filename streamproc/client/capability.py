"""Minting edge capabilities: what the serving layer hands a client so the edge serves it its results.

The frontend that accepted a request knows its id; it signs a short-lived JWT naming it and gives
it to its client with the edge's URL. The edge verifies it alone (:mod:`streamproc.edge.auth`),
so nothing in the request path calls back. Use an asymmetric key (ES256, EdDSA, RS256) in
production: the frontend keeps the private key, the edge gets only the public one.

    token = mint_capability(key, rids=[request_id], ttl=600)
    # client: GET https://edge/v1/results/<request_id>  with  Authorization: Bearer <token>
"""

from __future__ import annotations

import time
import uuid
from typing import Iterable

import jwt

from ..core.defaults import CAPABILITY_TTL, EDGE_AUDIENCE, MAX_CAPABILITY_TTL, OPERATOR_SCOPE
from ..core.wire import REQUEST_ID_RULE, check_request_id, valid_request_id
from ..signing_keys import private_key_problem, signing_key_problem


def mint_capability(
    key: bytes | str,
    *,
    rids: Iterable[str] = (),
    rid_prefix: str = "",
    operator: bool = False,
    ttl: float = CAPABILITY_TTL,
    algorithm: str = "HS256",
    subject: str = "",
    now: float | None = None,
) -> str:
    """A signed capability for the edge.

    ``rids`` names request ids (a list: a bare string is a ``TypeError``; an invalid id a
    ``ValueError``), ``rid_prefix`` a tenant's ids (every id starting with it),
    ``operator`` grants every request, ``/v1/recent`` and the live page. ``subject`` (``sub``) is
    the client the edge counts streams per (``--max-streams-per-client``); by default each token
    is its own client. ``key`` is the HMAC secret or the PEM private key for ``algorithm``.

    A key the edge would refuse to start with is a ``ValueError`` (:mod:`streamproc.signing_keys`):
    a public key, JWK or certificate as an HMAC secret (PyJWT 2.8-2.12 sign with one), a secret
    shorter than its hash, an RSA key under 2048 bits. An HMAC secret is used stripped of
    surrounding whitespace, as the edge reads its ``--auth-key-file``.
    """
    if isinstance(rids, (str, bytes)):  # list("req-42") would grant "r", "e", "q", ... and not req-42
        raise TypeError(f"rids is an iterable of request ids, not one id: use rids=[{rids!r}]")
    rids = [check_request_id(rid) for rid in rids]
    if rid_prefix and not valid_request_id(rid_prefix):  # no valid request id could start with it
        raise ValueError(f"invalid rid_prefix {rid_prefix!r}: a request id is {REQUEST_ID_RULE}")
    if not (rids or rid_prefix or operator):
        raise ValueError("a capability must name request ids, a rid_prefix, or be an operator's")
    if not 0 < ttl <= MAX_CAPABILITY_TTL:  # NaN too (it raised from round(), inf from int(); 1e300 never expired)
        raise ValueError(f"ttl must be more than 0 and at most {MAX_CAPABILITY_TTL:g} seconds (366 days), got {ttl!r}")
    key = usable_key(key, algorithm)
    issued = int(time.time() if now is None else now)
    claims: dict[str, object] = {
        "aud": EDGE_AUDIENCE,
        "iat": issued,
        "exp": issued + max(1, round(ttl)),
        "sub": subject or f"anonymous-{uuid.uuid4().hex[:12]}",
    }
    if rids:
        claims["rids"] = rids
    if rid_prefix:
        claims["rid_prefix"] = rid_prefix
    if operator:
        claims["scope"] = OPERATOR_SCOPE
    return jwt.encode(claims, key, algorithm=algorithm)


def usable_key(key: object, algorithm: str) -> object:
    """``key`` as :func:`mint_capability` signs with it, once it passed the edge's key checks."""
    if isinstance(key, (str, bytes, bytearray, memoryview)):
        data = key.encode() if isinstance(key, str) else bytes(key)
        # Checked as given: a DER public key ending in a whitespace byte no longer parses once stripped.
        problem = signing_key_problem(algorithm, data)
        if algorithm.startswith("HS"):
            key = data.strip()  # the edge strips its secret file (streamproc.edge.auth.load_key)
    else:  # a key object of cryptography's: PyJWT takes it for the asymmetric algorithms
        problem = private_key_problem(algorithm, key)
    if problem:
        raise ValueError(f"unusable {algorithm} key: {problem}")
    return key
