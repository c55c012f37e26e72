# async-processor container image.
# Stage 1 installs the package into a virtualenv (and precompiles it); stage 2 copies
# only that virtualenv onto a clean slim Python, so no pip caches, build tools or
# sources reach the final image. The runtime user is non-root (UID 10001, matching the
# Helm chart) and nothing is written under /opt/venv at run time, so the container
# runs with a read-only root filesystem (/tmp comes from an emptyDir in the chart).
#
# The base image is pinned by digest (the multi-arch index of python:3.11-slim-bookworm,
# Python 3.11.16), so a rebuild gets the same bytes. To bump it:
#   docker buildx imagetools inspect python:3.11-slim-bookworm --format '{{json .Manifest.Digest}}'
# and replace the digest below (the tag in front of it is only for readers).
# `make image` builds here without a registry: scripts/image.sh makes a Debian bookworm base
# (mmdebstrap) and passes it as PYTHON_IMAGE, with a host-built wheelhouse as the only index.
ARG PYTHON_IMAGE=python:3.11-slim-bookworm@sha256:a36c24f9cbdf4fd0f52d67f0823eeac19c2028c637cecc392d97f980d4fec56b

FROM ${PYTHON_IMAGE} AS build
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
WORKDIR /src
# Optional extras baked in; `otel` lets OTEL_EXPORTER_OTLP_ENDPOINT turn tracing on.
# `--build-arg EXTRAS=` builds without any (the expansion drops the empty brackets); the
# locked dependency list below holds the otel packages either way.
ARG EXTRAS=otel
# Dependencies first, in their own layer: a change to the source does not reinstall grpcio.
# requirements-image.txt is pyproject.toml's runtime dependencies + [otel] at constraints.txt's
# versions with every file's hash (`make image-lock`): a rebuild gets the same bytes or
# fails; no dev, bench or demo package is in it.
COPY requirements-image.txt ./
RUN pip install --no-compile --require-hashes --only-binary=:all: -r requirements-image.txt
COPY pyproject.toml README.md ./
COPY async_processor ./async_processor
# pip and setuptools leave the venv once it is built: nothing installs at run time.
RUN pip install --no-compile --no-deps ".${EXTRAS:+[$EXTRAS]}" \
    && python -m pip uninstall -q -y pip setuptools \
    && python -m compileall -q -j 0 /opt/venv

FROM ${PYTHON_IMAGE} AS runtime
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    HOME=/tmp
RUN groupadd --system --gid 10001 app \
    && useradd --system --uid 10001 --gid 10001 --no-create-home --home-dir /tmp \
       --shell /usr/sbin/nologin app
COPY --from=build /opt/venv /opt/venv
# Last, so that a new commit or build time reuses every layer above. Filled in by
# `make image` (scripts/image.sh): the package version, the git commit and the
# build time (RFC 3339).
ARG VERSION=unknown
ARG REVISION=unknown
ARG CREATED=unknown
ARG SOURCE=https://github.com/llm-d/async-processor
LABEL org.opencontainers.image.title="async-processor" \
      org.opencontainers.image.description="Dispatches queued LLM inference requests to an llm-d gateway under admission control" \
      org.opencontainers.image.licenses="Apache-2.0" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.revision="${REVISION}" \
      org.opencontainers.image.created="${CREATED}" \
      org.opencontainers.image.source="${SOURCE}"
USER 10001:10001
# 8081: /healthz and /readyz; 9090: /metrics.
EXPOSE 8081 9090
ENTRYPOINT ["async-processor"]
CMD ["run"]
