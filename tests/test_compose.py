"""docker-compose.yml and the Dockerfile, proven without a Docker engine.

1. The compose file validates against the Compose Specification's JSON schema (the copy vendored
   by the ``check-jsonschema`` package, ``vendor.compose-spec``), and its wiring is what the
   README promises (health-gated ``depends_on``, port 8080, STREAMPROC_* settings that exist).
2. Every service's command runs natively, with the service's own environment, against a
   nats-server started from the compose ``nats`` command: health checks are executed (``wget``
   emulated, ``python`` run as is), services start in ``depends_on`` order, and the results of
   the looping simulated workers must reach the edge over HTTP, joined and passed through.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import tomllib
import urllib.error
import urllib.request
from importlib import resources
from pathlib import Path

import jsonschema
import pytest
from compose_checks import (
    COMPOSE,
    FORGERY_SCRIPT,
    ROOT,
    VARIABLE,
    check_forgery_refused,
    check_one_of_each,
    compose_variables,
    load_compose,
    wait_for_results,
)
from helpers import clean_env, free_port, wait_ready

from streamproc import config
from streamproc.edge import settings as edge_settings
from streamproc.sim.embedded import find_binary

DOCKERFILE = ROOT / "Dockerfile"
STREAMPROC_SERVICES = ("processor", "edge", "workers")


def compose_schema() -> dict:
    vendored = resources.files("check_jsonschema.builtin_schemas.vendor").joinpath("compose-spec.json")
    return json.loads(vendored.read_text())


def schema_errors(document: dict) -> list[str]:
    schema = compose_schema()
    validator = jsonschema.validators.validator_for(schema)(schema, format_checker=jsonschema.FormatChecker())
    return [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(document)]


# ------------------------------------------------------------------------ the file itself


def test_compose_file_validates_against_the_compose_specification():
    assert schema_errors(load_compose()) == []


def test_the_schema_check_rejects_a_broken_compose_file():
    broken = load_compose()
    broken["services"]["workers"]["depends_on"]["edge"]["condition"] = "service_helthy"
    broken["services"]["edge"]["heathcheck"] = broken["services"]["edge"].pop("healthcheck")
    broken["services"]["edge"]["ports"] = {"8080": 8080}
    assert len(schema_errors(broken)) >= 3


def test_check_jsonschema_accepts_the_compose_file():
    cli = Path(sys.executable).parent / "check-jsonschema"
    done = subprocess.run(
        [str(cli), "--builtin-schema", "vendor.compose-spec", str(COMPOSE)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_services_are_wired_as_the_readme_says():
    services = load_compose()["services"]
    assert set(services) == {"nats", *STREAMPROC_SERVICES}

    nats = services["nats"]
    assert nats["image"].startswith("nats:2.") and nats["image"].endswith(
        "-alpine"
    )  # wget for the healthcheck
    assert nats["entrypoint"] == ["/bin/sh", "-c"]
    assert nats["command"][0].endswith("exec nats-server --config /etc/nats/nats-server.conf")
    assert "./deploy/nats-server.conf:/etc/nats/nats-server.conf:ro" in nats["volumes"]
    assert "http://127.0.0.1:8222/healthz?js-enabled-only=true" in nats["healthcheck"]["test"]

    for name in STREAMPROC_SERVICES:
        service = services[name]
        build = service["build"]
        assert build["context"] == "." and (ROOT / build["context"] / "Dockerfile").is_file()
        assert build["args"] == {"BASE_IMAGE": "python:3.11-slim"} and build["secrets"] == ["ca_bundle"]
        assert service["image"] == "streamproc:local"
        assert service["environment"]["STREAMPROC_NATS_URL"] == "nats://nats:4222"
        assert service["environment"]["STREAMPROC_FORMAT"] == "sglang-zstd"
        for dependency, rule in service["depends_on"].items():
            assert rule["condition"] == "service_healthy", (name, dependency)
            assert "healthcheck" in services[dependency], (
                f"{name} waits for {dependency}, which has no healthcheck"
            )

    edge = services["edge"]
    assert edge["command"] == ["streamproc", "edge"]
    assert edge["ports"] == ["127.0.0.1:8080:8080"] and edge["environment"]["STREAMPROC_EDGE_PORT"] == "8080"
    assert edge["environment"]["STREAMPROC_EDGE_HOST"] == "0.0.0.0"
    assert edge["environment"]["STREAMPROC_EDGE_INSECURE_DEMO"] == "true"
    assert "http://127.0.0.1:8080/healthz" in edge["healthcheck"]["test"][-1]
    processor = services["processor"]
    assert processor["command"] == ["streamproc", "run"]
    assert processor["environment"]["STREAMPROC_HTTP_PORT"] == "9090"
    assert "http://127.0.0.1:9090/readyz" in processor["healthcheck"]["test"][-1]
    assert "streamproc simulate" in services["workers"]["command"][-1]
    assert "--mode mixed" in services["workers"]["command"][-1]


def test_nats_is_authenticated_and_only_the_edge_is_published():
    """Issue 11: no unauthenticated NATS port and no monitoring port on the host; one NATS user per
    service, its password a compose secret (never in the file), the users those of the trust model."""
    compose = load_compose()
    services = compose["services"]
    published = {name: service.get("ports") for name, service in services.items() if service.get("ports")}
    assert list(published) == ["edge"] and published["edge"] == ["127.0.0.1:8080:8080"]
    assert "expose" not in services["nats"]
    config = (ROOT / "deploy" / "nats-server.conf").read_text()
    assert "\nhttp: 127.0.0.1:8222\n" in config  # monitoring on the container's loopback
    script = services["nats"]["command"][0]
    assert "read -r password < /run/secrets/nats_$user;" in script
    assert 'export "STREAMPROC_${pair#*:}_PASSWORD=\\"$password\\""' in script
    users = {"worker": "workers", "processor": "processor", "edge": "edge"}
    for user in (*users, "frontend"):
        secret = f"nats_{user}"
        assert f"password: $STREAMPROC_{user.upper()}_PASSWORD" in config
        assert f" {user}:{user.upper()}" in script  # read from /run/secrets/nats_<user> into STREAMPROC_<USER>_PASSWORD
        assert secret in services["nats"]["secrets"]
        assert compose["secrets"][secret] == {"file": f"./deploy/dev-secrets/{user}"}
        assert (ROOT / "deploy" / "dev-secrets" / user).read_text().strip()
    for user, name in users.items():
        env = services[name]["environment"]
        assert env["STREAMPROC_NATS_USER"] == user
        assert env["STREAMPROC_NATS_PASSWORD_FILE"] == f"/run/secrets/nats_{user}"
        assert services[name]["secrets"] == [f"nats_{user}"], "each service gets only its own password"
        assert "STREAMPROC_NATS_PASSWORD" not in env and "@" not in env["STREAMPROC_NATS_URL"]
    # the edge may not create the results stream (its NATS user may only read it): the processor does
    assert "STREAMPROC_EDGE_ENSURE_RESULTS_STREAM" not in services["edge"]["environment"]
    assert services["edge"]["depends_on"] == {"processor": {"condition": "service_healthy"}}


def test_the_insecure_demo_edge_is_published_on_the_hosts_loopback_only_by_default():
    """Found by an attack (2026-12-06): the stack's edge runs with --insecure-demo (every result and
    /v1/recent to anyone), and `ports: ["8080:8080"]` published it on every address of the host, past
    a host firewall's INPUT rules (Docker's own chain forwards published ports): anyone on the network
    read every request. Compose's short syntax is [HOST_IP:]HOST_PORT:CONTAINER_PORT; no HOST_IP is
    every address."""
    edge = load_compose()["services"]["edge"]
    assert edge["environment"]["STREAMPROC_EDGE_INSECURE_DEMO"] == "true"
    for port in edge["ports"]:
        host_ip, _, published = str(port).rpartition(":")[0].rpartition(":")
        assert host_ip == "127.0.0.1", f"{port!r} publishes the insecure edge on {host_ip or 'every address'}"
        assert published == "8080"
    # publishing it further is the operator's explicit choice
    assert load_compose({"EDGE_HOST_PORT": "0.0.0.0:8080"})["services"]["edge"]["ports"] == ["0.0.0.0:8080:8080"]


def test_every_compose_variable_has_todays_default_and_the_ports_can_move():
    """A plain `docker compose up` needs no variable; the real test moves images, ports and the tag."""
    assert compose_variables() == {
        "NATS_IMAGE": "nats:2.11-alpine",
        "PYTHON_IMAGE": "python:3.11-slim",
        "LOCAL_IMAGE": "streamproc:local",
        "NATS_CONFIG": "./deploy/nats-server.conf",
        "EDGE_HOST_PORT": "127.0.0.1:8080",
        "BUILD_CA_BUNDLE": "/dev/null",
        "NATS_SECRETS_DIR": "./deploy/dev-secrets",
    }
    bare = VARIABLE.sub("", COMPOSE.read_text()).replace("$$", "")
    assert "$" not in bare, "only ${NAME:-default} interpolation (and $$ for a literal $) is used"
    moved = load_compose({"EDGE_HOST_PORT": "127.0.0.1:18080", "NATS_IMAGE": "streamproc-standin/nats:2.11"})
    assert moved["services"]["edge"]["ports"] == ["127.0.0.1:18080:8080"]
    assert moved["services"]["nats"]["image"] == "streamproc-standin/nats:2.11"
    assert moved["secrets"]["ca_bundle"] == {"file": "/dev/null"}
    moved = load_compose({"NATS_SECRETS_DIR": "/srv/secrets", "NATS_CONFIG": "/srv/nats.conf"})
    assert moved["secrets"]["nats_edge"] == {"file": "/srv/secrets/edge"}
    assert moved["services"]["nats"]["volumes"][0] == "/srv/nats.conf:/etc/nats/nats-server.conf:ro"
    assert schema_errors(moved) == []


def test_every_streamproc_variable_is_a_setting_its_command_reads():
    """An unknown STREAMPROC_* variable only warns at run time; catch typos here."""
    known = {
        "edge": edge_settings.env_names(),
        "run": {f.env for f in config.fields()},
        "simulate": {f.env for f in config.fields()},
    }
    for name in STREAMPROC_SERVICES:
        service = load_compose()["services"][name]
        command = " ".join(service["command"])
        sub = next(c for c in known if f"streamproc {c}" in command)
        unknown = {k for k in service["environment"] if k.startswith("STREAMPROC_")} - known[sub]
        assert not unknown, f"{name}: `streamproc {sub}` reads no {sorted(unknown)}"


def test_dockerfile_builds_every_service_from_python_slim_with_the_external_codec():
    lines = [line.strip() for line in DOCKERFILE.read_text().splitlines()]
    instructions = [line for line in lines if line and not line.startswith("#")]
    assert instructions[:2] == ["ARG BASE_IMAGE=python:3.11-slim", "FROM ${BASE_IMAGE}"]
    copied = [part for line in instructions if line.startswith("COPY ") for part in line.split()[1:-1]]
    for source in copied:
        assert (ROOT / source).exists(), f"Dockerfile copies {source}, which is not in the repository"
    run = " ".join(instructions[instructions.index(next(i for i in instructions if i.startswith("RUN "))) :])
    assert "pip install . ./codecs/sglang-zstd" in run
    # The optional CA bundle is a BuildKit secret (never stored in a layer), used only when non-empty.
    assert run.startswith("RUN --mount=type=secret,id=ca_bundle ")
    assert "if [ -s /run/secrets/ca_bundle ]; then export PIP_CERT=/run/secrets/ca_bundle; fi" in run
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert {".git", ".venv", "artifacts"} <= set(ignored)


def test_the_image_gets_the_edge_package_and_its_page():
    """``pip install .`` (the Dockerfile) ships only what pyproject lists; editable installs get it all."""
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert "streamproc.edge" in setuptools["packages"]
    data = setuptools.get("package-data", {})
    edge = ROOT / "streamproc" / "edge"
    # declared either as data of streamproc.edge ("page/*.html") or as the package streamproc.edge.page
    shipped = [*data.get("streamproc.edge", []),
               *(f"page/{p}" for p in data.get("streamproc.edge.page", [])
                 if "streamproc.edge.page" in setuptools["packages"])]
    for asset in (edge / "page").iterdir():
        assert any(asset.relative_to(edge).match(pattern) for pattern in shipped), (
            f"{asset.name} is not shipped"
        )


# --------------------------------------------------------------------- running it natively


class NativeCompose:
    """Runs compose services as local processes, mapping container addresses, ports, secrets and the
    mounted nats-server configuration to local ones."""

    def __init__(self, compose: dict, workdir: Path) -> None:
        self.services = compose["services"]
        self.workdir = workdir
        self.nats_port, self.monitor_port, self.edge_port, self.http_port = (free_port() for _ in range(4))
        self.local = {
            "nats://nats:4222": f"nats://127.0.0.1:{self.nats_port}",
            "http://127.0.0.1:8222": f"http://127.0.0.1:{self.monitor_port}",  # inside the nats container
            "http://127.0.0.1:8080": f"http://127.0.0.1:{self.edge_port}",  # inside the edge container
            "http://127.0.0.1:9090": f"http://127.0.0.1:{self.http_port}",  # inside the processor container
            "/etc/nats/nats-server.conf": str(self.nats_config()),
            "exec nats-server ": f"exec {find_binary()} ",
        }
        # compose file secrets appear in a container as /run/secrets/<name>: here, links to the files
        mounted = workdir / "run-secrets"
        mounted.mkdir()
        for secret, spec in compose["secrets"].items():
            (mounted / secret).symlink_to((ROOT / spec["file"]).resolve())
        self.local["/run/secrets/"] = f"{mounted}/"
        self.processes: dict[str, subprocess.Popen] = {}

    def nats_config(self) -> Path:
        """The mounted deploy/nats-server.conf with this machine's ports and storage."""
        mount = next(v for v in self.services["nats"]["volumes"] if v.endswith(":/etc/nats/nats-server.conf:ro"))
        text = (ROOT / mount.split(":")[0]).read_text()
        for line, local in (("port: 4222", f"port: {self.nats_port}\nhost: 127.0.0.1"),
                            ("http: 127.0.0.1:8222", f"http: 127.0.0.1:{self.monitor_port}"),
                            ("jetstream { store_dir: /data/jetstream }",
                             f"jetstream {{ store_dir: {json.dumps(str(self.workdir / 'jetstream'))} }}")):
            assert f"\n{line}\n" in text, f"deploy/nats-server.conf no longer has `{line}`"
            text = text.replace(f"\n{line}\n", f"\n{local}\n")
        path = self.workdir / "nats-server.conf"
        path.write_text(text)
        return path

    def native(self, text: str, service: str) -> str:
        for container, here in self.local.items():
            text = text.replace(container, here)
        return text

    def environment(self, name: str) -> dict[str, str]:
        env = {
            k: self.native(str(v), name) for k, v in (self.services[name].get("environment") or {}).items()
        }
        if "STREAMPROC_EDGE_PORT" in env:
            env["STREAMPROC_EDGE_PORT"] = str(self.edge_port)
        if env.get("STREAMPROC_HTTP_PORT") == "9090":
            env["STREAMPROC_HTTP_PORT"] = str(self.http_port)
        if env.get("STREAMPROC_EDGE_HOST") == "0.0.0.0":
            env["STREAMPROC_EDGE_HOST"] = "127.0.0.1"  # same code path; no listening beyond loopback here
        path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
        return clean_env({**env, "PATH": path})

    def command(self, name: str) -> list[str]:
        service = self.services[name]
        entrypoint = service.get("entrypoint") or []
        return [self.native(part, name) for part in [*entrypoint, *service["command"]]]

    def order(self) -> list[str]:
        done: list[str] = []
        while len(done) < len(self.services):
            for name, service in self.services.items():
                if name not in done and all(d in done for d in service.get("depends_on", {})):
                    done.append(name)
        return done

    def log(self, name: str) -> str:
        path = self.workdir / f"{name}.log"
        return path.read_text(errors="replace")[-3000:] if path.exists() else ""

    def logs(self) -> str:
        return "\n".join(f"----- {name}\n{self.log(name)}" for name in self.processes)

    def start(self, name: str) -> None:
        with open(self.workdir / f"{name}.log", "wb") as log:
            self.processes[name] = subprocess.Popen(
                self.command(name),
                env=self.environment(name),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
                cwd=self.workdir,
                start_new_session=True,
            )

    def healthy(self, name: str) -> bool:
        test = self.services[name]["healthcheck"]["test"]
        assert test[0] == "CMD", test
        program, *args = [self.native(part, name) for part in test[1:]]
        if program == "wget":  # busybox wget in the alpine image: success means an HTTP 2xx
            url = next(a for a in args if a.startswith("http"))
            try:
                with urllib.request.urlopen(url, timeout=2) as response:
                    return 200 <= response.status < 300
            except (urllib.error.URLError, OSError):
                return False
        assert program == "python", test
        done = subprocess.run(
            [sys.executable, *args], env=self.environment(name), capture_output=True, timeout=10
        )
        return done.returncode == 0

    def wait_healthy(self, name: str, timeout: float = 20.0) -> None:
        wait_ready(lambda: self.healthy(name), self.processes[name], name, timeout, self.logs, every=0.2)

    def stop(self) -> None:
        for name in reversed(list(self.processes)):
            proc = self.processes[name]
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)  # the service's own session: shell loop and children
                try:
                    proc.wait(10)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()


# Passwords nats-server would not read as strings from its environment unquoted (a number, a
# boolean, a leading dash, a space: conf/parse.go parses a variable's value as a config value).
AWKWARD_PASSWORDS = {"worker": "-starts-with-a-dash", "processor": "1234567890", "edge": "true",
                     "frontend": "two words $HOME 'x'"}


def write_secrets(folder: Path, passwords: dict[str, str]) -> Path:
    folder.mkdir()
    for user, password in passwords.items():
        (folder / user).write_text(password + "\n")
    return folder


@pytest.mark.nats
def test_every_service_runs_natively_with_authenticated_nats_and_results_reach_the_edge():
    with tempfile.TemporaryDirectory(prefix="streamproc-compose-") as tmp:
        secrets = write_secrets(Path(tmp) / "secrets", AWKWARD_PASSWORDS)
        stack = NativeCompose(load_compose({"NATS_SECRETS_DIR": str(secrets)}), Path(tmp))
        try:
            for name in stack.order():
                stack.start(name)
                if "healthcheck" in stack.services[name]:
                    stack.wait_healthy(name)
            edge = f"http://127.0.0.1:{stack.edge_port}"
            finished = wait_for_results(edge, stack.logs)
            check_one_of_each(edge, finished, stack.logs)
            assert stack.processes["workers"].poll() is None, "the workers loop must keep running"
            forged = f"forged-{os.getpid()}"
            done = subprocess.run([sys.executable, "-c", FORGERY_SCRIPT], capture_output=True, text=True,
                                  timeout=30, env={**stack.environment("workers"), "FORGED_ID": forged})
            assert done.returncode == 0, done.stderr
            check_forgery_refused(done.stdout, edge, forged, stack.logs)
        finally:
            stack.stop()


@pytest.mark.parametrize("password", ['has"quote', "back\\slash", ""])
def test_nats_refuses_to_start_on_a_password_it_could_not_read_back(password):
    """A double quote or a backslash would break the quoting that makes every other password a string;
    an empty or missing file is a mistake. One clear line, exit code 2, no server started."""
    with tempfile.TemporaryDirectory(prefix="streamproc-compose-") as tmp:
        secrets = write_secrets(Path(tmp) / "secrets", {**AWKWARD_PASSWORDS, "edge": password})
        stack = NativeCompose(load_compose({"NATS_SECRETS_DIR": str(secrets)}), Path(tmp))
        done = subprocess.run(stack.command("nats"), capture_output=True, text=True, timeout=30,
                              env=stack.environment("nats"))
    assert done.returncode == 2, done
    assert f"{tmp}/run-secrets/nats_edge is missing or empty, or its password has a double quote or a backslash" \
        in done.stderr.splitlines()[-1], done.stderr


def test_the_docker_test_is_left_out_of_make_test_and_run_by_make_test_compose_and_ci():
    """`make test` must not need an engine; `make test-compose` and CI must still run the real test."""

    def collected(*args: str) -> str:
        done = subprocess.run(
            [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *args],
            capture_output=True,
            text=True,
            cwd=ROOT,
            timeout=120,
        )
        return done.stdout

    real = "tests/test_compose_real.py"
    assert "4 deselected" in collected(real)  # pyproject's addopts: -m 'not docker'
    assert "4 tests collected" in collected("-m", "docker", real)
    makefile = (ROOT / "Makefile").read_text()
    assert f"$(BIN)/python -m pytest -m docker {real}" in makefile
    ci = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    assert ci.index("make test") < ci.index("make test-compose")
