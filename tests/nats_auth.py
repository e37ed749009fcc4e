"""Credentials and server configurations for the NATS authentication and TLS tests.

Not a test module. Everything is generated per test: nkeys with the ``nkeys`` package, JWTs signed
with them (the NATS JWT v2 layout: header ``{"typ":"JWT","alg":"ed25519-nkey"}``, claims with
``iss``/``sub``/``nats.type``, an ed25519 signature over ``header.claims``, as nats-io/jwt's
``Claims.Encode`` produces), certificates with the ``openssl`` command.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import json
import os
import subprocess
import time
import urllib.request
from pathlib import Path
from typing import Iterator

import nkeys

from helpers import free_port
from streamproc.sim.embedded import EmbeddedNats


def new_keypair(prefix: int) -> tuple[str, str]:
    """(seed, public key) of a fresh nkey of the given kind (``nkeys.PREFIX_BYTE_USER``...)."""
    seed = nkeys.encode_seed(os.urandom(32), prefix)
    kp = nkeys.from_seed(bytearray(seed))
    return seed.decode(), kp.public_key.decode()


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).decode().rstrip("=")


def jwt(issuer_seed: str, subject: str, name: str, nats: dict) -> str:
    """A NATS JWT v2 signed by ``issuer_seed`` for ``subject``."""
    issuer = nkeys.from_seed(bytearray(issuer_seed.encode()))
    claims = {"iat": int(time.time()), "iss": issuer.public_key.decode(), "name": name, "sub": subject,
              "nats": {"version": 2, **nats}}
    claims["jti"] = base64.b32encode(hashlib.sha256(json.dumps(claims).encode()).digest()).decode().rstrip("=")
    signing_input = f"{_b64(json.dumps({'typ': 'JWT', 'alg': 'ed25519-nkey'}).encode())}.{_b64(json.dumps(claims).encode())}"
    return f"{signing_input}.{_b64(issuer.sign(signing_input.encode()))}"


UNLIMITED = {"subs": -1, "data": -1, "payload": -1, "imports": -1, "exports": -1, "wildcards": True,
             "conn": -1, "leaf": -1}


class Operator:
    """Decentralized (JWT) authentication: an operator, one account, users with ``.creds`` files."""

    def __init__(self) -> None:
        self.seed, self.public = new_keypair(nkeys.PREFIX_BYTE_OPERATOR)
        self.account_seed, self.account = new_keypair(nkeys.PREFIX_BYTE_ACCOUNT)
        self.sys_seed, self.sys_account = new_keypair(nkeys.PREFIX_BYTE_ACCOUNT)

    def server_config(self) -> str:
        operator_jwt = jwt(self.seed, self.public, "test-operator", {"type": "operator"})
        account_jwt = jwt(self.seed, self.account, "APP", {"type": "account", "limits": UNLIMITED})
        sys_jwt = jwt(self.seed, self.sys_account, "SYS", {"type": "account", "limits": UNLIMITED})
        return (f"operator: {operator_jwt}\nsystem_account: {self.sys_account}\nresolver: MEMORY\n"
                f"resolver_preload: {{\n  {self.account}: {account_jwt}\n  {self.sys_account}: {sys_jwt}\n}}\n")

    def creds(self, path: Path, name: str = "user", *, account_seed: str | None = None) -> Path:
        """Write a ``.creds`` file for a new user of the account (signed by ``account_seed`` if given)."""
        seed, public = new_keypair(nkeys.PREFIX_BYTE_USER)
        user_jwt = jwt(account_seed or self.account_seed, public, name,
                       {"type": "user", "pub": {}, "sub": {}, "subs": -1, "data": -1, "payload": -1})
        path.write_text(f"-----BEGIN NATS USER JWT-----\n{user_jwt}\n------END NATS USER JWT------\n\n"
                        f"-----BEGIN USER NKEY SEED-----\n{seed}\n------END USER NKEY SEED------\n")
        return path


def openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


class Certificates:
    """A CA, a server certificate for 127.0.0.1/localhost and a client certificate, in ``directory``."""

    def __init__(self, directory: Path, name: str = "ca") -> None:
        self.dir = directory
        self.name = name
        d = directory
        self.ca, self.ca_key = d / f"{name}.pem", d / f"{name}-key.pem"
        openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
                "-keyout", str(self.ca_key), "-out", str(self.ca), "-days", "2", "-subj", f"/CN=test {name}",
                "-addext", "basicConstraints=critical,CA:TRUE", "-addext", "keyUsage=critical,keyCertSign",
                cwd=d)
        self.server, self.server_key = self.issue("server", "serverAuth", "subjectAltName=IP:127.0.0.1,DNS:localhost")
        self.client, self.client_key = self.issue("client", "clientAuth", None)

    def issue(self, name: str, usage: str, san: str | None) -> tuple[Path, Path]:
        d = self.dir
        name = f"{self.name}-{name}"
        key, csr, cert, ext = d / f"{name}-key.pem", d / f"{name}.csr", d / f"{name}.pem", d / f"{name}.ext"
        ext.write_text(f"extendedKeyUsage={usage}\n" + (f"{san}\n" if san else ""))
        openssl("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes", "-keyout", str(key),
                "-out", str(csr), "-subj", f"/CN=test {name}", cwd=d)
        openssl("x509", "-req", "-in", str(csr), "-CA", str(self.ca), "-CAkey", str(self.ca_key),
                "-CAcreateserial", "-out", str(cert), "-days", "2", "-extfile", str(ext), cwd=d)
        return cert, key

    def tls_block(self, *, verify: bool) -> str:
        return (f'tls {{\n  cert_file: "{self.server}"\n  key_file: "{self.server_key}"\n'
                f'  ca_file: "{self.ca}"\n  verify: {"true" if verify else "false"}\n  timeout: 2\n}}\n')


# What an edge user may be denied publishing (nats-server subjects): stored reads by subject, pulls, acks.
MSG_GET = "$JS.API.STREAM.MSG.GET.>"
PULLS = "$JS.API.CONSUMER.MSG.NEXT.>"
ACKS = "$JS.ACK.>"


def edge_user_denied(*subjects: str, publisher: bool = False) -> str:
    """A nats-server configuration with user ``edge`` (password ``edge``) that may not publish
    ``subjects`` (none: may publish anything), and with ``publisher`` a user ``pub`` who may."""
    permissions = ""
    if subjects:
        permissions = ", permissions: {publish: {deny: [%s]}}" % ", ".join(f'"{s}"' for s in subjects)
    users = "    {user: edge, password: edge%s}\n" % permissions
    if publisher:
        users += "    {user: pub, password: pub}\n"
    return "authorization {\n  users = [\n%s  ]\n}\n" % users


@contextlib.contextmanager
def authenticated_cluster(config: str, size: int = 3, timeout: float = 15.0) -> Iterator[list[EmbeddedNats]]:
    """``size`` nats-servers (no JetStream) routed into one cluster, each with the client
    ``config`` (an ``authorization`` block...); yielded once every node has its routes, so a client's
    first INFO lists the cluster's servers (``connect_urls``)."""
    ports = [free_port() for _ in range(size)]
    routes = [f"nats://127.0.0.1:{port}" for port in ports]
    nodes = [EmbeddedNats(jetstream=False, server_name=f"n{i}", cluster_name="auth-test", cluster_port=port,
                          routes=[r for r in routes if not r.endswith(f":{port}")], config=config)
             for i, port in enumerate(ports)]
    try:
        for node in nodes:
            node.start()
        deadline = time.monotonic() + timeout
        while not all(_routes(node) >= size - 1 for node in nodes):
            assert time.monotonic() < deadline, "the cluster's routes did not form"
            time.sleep(0.05)
        yield nodes
    finally:
        for node in nodes:
            node.stop()


def _routes(node: EmbeddedNats) -> int:
    with urllib.request.urlopen(f"{node.monitor_url}/routez", timeout=2) as answer:
        return json.load(answer)["num_routes"]
