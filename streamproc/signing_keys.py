"""Which keys may sign or verify edge capabilities: one check for the edge, ``streamproc token`` and
:func:`streamproc.client.capability.mint_capability`.

PyJWT is not the judge: pyproject allows 2.8, whose ``HMACAlgorithm.prepare_key`` takes a JWK
(refused from 2.13), a JWK Set (2.14) and a DER public key (2.15) as an HMAC secret, and which
checks no key length (``check_key_length`` exists from 2.11). A public key taken as a secret lets
anyone who has it sign capabilities; a token signed with a key the edge refuses never verifies.
"""

from __future__ import annotations

import functools
import json

import jwt

RSA_MIN_BITS = 2048  # RFC 7518 section 3.3: "A key of size 2048 bits or larger MUST be used"


@functools.lru_cache(maxsize=8)  # a frontend mints per request with one key: ~0.1 ms of checks, once
def signing_key_problem(algorithm: str, key: bytes) -> str | None:
    """Why ``key`` cannot sign capabilities the edge verifies with ``algorithm``, or None: an HMAC
    secret that is too short, a key document or a public key (:func:`hmac_secret_problem`), an RSA
    key under :data:`RSA_MIN_BITS` (:func:`key_weakness`). Whatever PyJWT says about a key it cannot
    use at all (no private key for the algorithm) it raises, as ``jwt.encode`` would."""
    if algorithm.startswith("HS"):
        return hmac_secret_problem(algorithm, key)
    return private_key_problem(algorithm, key)


def private_key_problem(algorithm: str, key: object) -> str | None:
    """Why ``key`` (PEM bytes, or a key object of cryptography's) cannot sign with the asymmetric
    ``algorithm``, or None: the public half of a pair (:func:`public_only`), a weak key
    (:func:`key_weakness`). What PyJWT's ``prepare_key`` refuses outright it raises."""
    signer = jwt.get_algorithm_by_name(algorithm)
    prepared = signer.prepare_key(key)
    return public_only(prepared) or key_weakness(signer, prepared)


def public_only(prepared: object) -> str | None:
    """Why a key ``Algorithm.prepare_key`` made cannot sign, being the public half of a pair, or None.
    PyJWT loads a PEM public key for RS*/PS*/ES*/EdDSA as readily as a private one, and ``jwt.encode``
    then fails as ``AttributeError: ... has no attribute 'sign'``; the edge gets the public half
    (docs/security.md), so it is the file a minter is most easily handed by mistake."""
    from cryptography.hazmat.primitives.asymmetric import ec, ed448, ed25519, rsa

    public = (rsa.RSAPublicKey, ec.EllipticCurvePublicKey, ed25519.Ed25519PublicKey, ed448.Ed448PublicKey)
    if isinstance(prepared, public):
        return ("a public key, which only verifies: sign with the private key (the edge's --auth-key-file "
                "gets the public one)")
    return None


def hmac_secret_problem(algorithm: str, raw: bytes) -> str | None:
    """Why a secret file's bytes ``raw`` (used stripped) are no secret for the HMAC ``algorithm``, or
    None: too short, a key document (JWK, JWK Set) or a public key or certificate (PEM, DER, SSH). The
    edge refuses to start with such a file (:func:`load_key`) and ``streamproc token`` to sign with it,
    whatever the PyJWT: pyproject allows 2.8, whose ``HMACAlgorithm.prepare_key`` takes JWKs (refused
    from 2.13), JWK Sets (2.14) and DER keys (2.15) as secrets."""
    data = raw.strip()
    short = short_secret(algorithm, data)
    if short:
        return short
    if key_document(data):
        return (f"holds a JWK or JWK Set (a key document), not an {algorithm} secret: give it the shared "
                "secret's bytes")
    try:
        jwt.get_algorithm_by_name(algorithm).prepare_key(data)
        # The file as given too: a DER key whose last byte happens to be whitespace (0x09-0x0d,
        # 0x20: ~2% of P-256 public keys) no longer parses once stripped, and was taken as a secret.
        public = asymmetric(raw) or asymmetric(data)
    except jwt.InvalidKeyError:
        public = True
    if public:
        return (f"holds an asymmetric key or certificate, not an {algorithm} secret: give it the shared "
                "secret, or set the algorithm to the key's")
    return None


def short_secret(algorithm: str, secret: bytes) -> str | None:
    """Why ``secret`` is too short for the HMAC ``algorithm`` (HS256/384/512), or None: RFC 7518
    section 3.2 asks for at least the hash's output, 32, 48 or 64 bytes. None for other algorithms."""
    if not algorithm.startswith("HS"):
        return None
    least = int(algorithm[2:]) // 8
    return f"an {algorithm} secret needs at least {least} bytes, it has {len(secret)}" if len(secret) < least else None


def key_weakness(verifier: jwt.algorithms.Algorithm, prepared: object) -> str | None:
    """Why a key ``verifier.prepare_key`` made is too weak to verify or sign with, or None: an RSA key
    under :data:`RSA_MIN_BITS` (RFC 7518 section 3.3; an HMAC secret's length is checked on its bytes
    before). Checked here, not left to PyJWT: ``Algorithm.check_key_length`` exists only from PyJWT
    2.11, and pyproject allows 2.8, where a 1024-bit RSA key was accepted without a word."""
    bits = getattr(prepared, "key_size", None)  # cryptography's RSA (public or private) and EC keys
    if isinstance(verifier, jwt.algorithms.RSAAlgorithm) and bits is not None and bits < RSA_MIN_BITS:
        return f"an RSA key needs at least {RSA_MIN_BITS} bits for {type(verifier).__name__}, it has {bits}"
    check_length = getattr(verifier, "check_key_length", None)  # PyJWT >= 2.11: whatever else it checks
    return check_length(prepared) if check_length is not None else None


def key_document(data: bytes) -> bool:
    """Whether ``data`` is JSON holding a ``kty`` member anywhere: a JWK or a JWK Set (RFC 7517), as
    PyJWT 2.14's ``HMACAlgorithm.prepare_key`` tells them from a secret. Its bytes are no secret (a
    public JWK as an HS* secret lets anyone who has it sign capabilities), yet PyJWT 2.8 to 2.12 take
    them as one. A document nested too deeply to parse counts when it starts as one (2.14 alike)."""
    try:
        doc = json.loads(data)
    except RecursionError:
        return data.lstrip(b"\xef\xbb\xbf \t\r\n").startswith((b"{", b"["))
    except ValueError:  # not JSON (UnicodeDecodeError included): a secret's random bytes
        return False
    pending = [doc]
    while pending:
        item = pending.pop()
        if isinstance(item, dict):
            if "kty" in item:
                return True
            pending.extend(item.values())
        elif isinstance(item, list):
            pending.extend(item)
    return False


def asymmetric(data: bytes) -> bool:
    """Whether ``data`` is a public key or certificate (PEM, DER or OpenSSH): public, so as an HMAC
    secret it would let anyone who has it sign capabilities."""
    from cryptography import x509
    from cryptography.hazmat.primitives import serialization

    loaders = (serialization.load_pem_public_key, serialization.load_der_public_key,
               serialization.load_ssh_public_key, x509.load_pem_x509_certificate,
               x509.load_der_x509_certificate)
    for load in loaders:
        try:
            load(data)
        except Exception:  # noqa: BLE001 - ValueError, UnsupportedAlgorithm...: not this kind of key
            continue
        return True
    return False
