# One image for every streamproc service of docker-compose.yml (`streamproc run`, `streamproc edge`,
# `streamproc simulate`). The sglang-zstd codec is installed from its own folder, the way a user
# installs any external codec; `streamproc codecs` at build time fails the build if it is not found.
#
# BASE_IMAGE: any image with Python >= 3.11 as `python`/`pip` on PATH and `useradd` (the compose file
# passes ${PYTHON_IMAGE}; offline stand-ins in docs/compose.md). Secret `ca_bundle` (optional, BuildKit):
# a PEM bundle pip trusts instead of its own, for networks that intercept TLS; an empty one is ignored.
ARG BASE_IMAGE=python:3.11-slim
FROM ${BASE_IMAGE}
LABEL org.opencontainers.image.title=streamproc

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /src
COPY pyproject.toml README.md ./
COPY streamproc ./streamproc
COPY codecs ./codecs
RUN --mount=type=secret,id=ca_bundle \
    if [ -s /run/secrets/ca_bundle ]; then export PIP_CERT=/run/secrets/ca_bundle; fi \
 && pip install . ./codecs/sglang-zstd \
 && streamproc codecs | grep -q '^sglang-zstd ' \
 && useradd --system --uid 10001 --no-create-home streamproc

USER streamproc
WORKDIR /tmp
EXPOSE 8080
CMD ["streamproc", "--help"]
