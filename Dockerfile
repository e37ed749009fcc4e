# One image for every streamproc service of docker-compose.yml (`streamproc run`, `streamproc edge`,
# `streamproc simulate`). The sglang-zstd codec is installed from its own folder, the way a user
# installs any external codec; `streamproc codecs` at build time fails the build if it is not found.
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /src
COPY pyproject.toml README.md ./
COPY streamproc ./streamproc
COPY codecs ./codecs
RUN pip install . ./codecs/sglang-zstd \
 && streamproc codecs | grep -q '^sglang-zstd ' \
 && useradd --system --uid 10001 --no-create-home streamproc

USER streamproc
WORKDIR /tmp
EXPOSE 8080
CMD ["streamproc", "--help"]
