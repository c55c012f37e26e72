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
ARG PYTHON_IMAGE=python:3.11-slim-bookworm@sha256:a36c24f9cbdf4fd0f52d67f0823eeac19c2028c637cecc392d97f980d4fec56b

FROM ${PYTHON_IMAGE} AS build
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
WORKDIR /src
# Optional extras baked in; `otel` lets OTEL_EXPORTER_OTLP_ENDPOINT turn tracing on.
# `--build-arg EXTRAS=` builds without any (the expansion drops the empty brackets).
ARG EXTRAS=otel
# Dependencies first, in their own layer, at the versions in constraints.txt: a change to
# the source does not reinstall grpcio. The requirement list is read from pyproject.toml
# (the dependencies plus those of $EXTRAS), so there is no second list to keep in step.
COPY pyproject.toml constraints.txt ./
RUN python -c 'import os, tomllib; p = tomllib.load(open("pyproject.toml", "rb"))["project"]; \
extras = [e for e in os.environ.get("EXTRAS", "").split(",") if e]; \
print("\n".join(p["dependencies"] + [d for e in extras for d in p["optional-dependencies"][e]]))' \
        > /tmp/requirements.txt \
    && pip install --no-compile -c constraints.txt -r /tmp/requirements.txt
COPY README.md ./
COPY async_processor ./async_processor
RUN pip install --no-compile --no-deps ".${EXTRAS:+[$EXTRAS]}" \
    && python -m compileall -q -j 0 /opt/venv

FROM ${PYTHON_IMAGE} AS runtime
LABEL org.opencontainers.image.title="async-processor" \
      org.opencontainers.image.description="Dispatches queued LLM inference requests to an llm-d gateway under admission control" \
      org.opencontainers.image.licenses="Apache-2.0"
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    HOME=/tmp
RUN groupadd --system --gid 10001 app \
    && useradd --system --uid 10001 --gid 10001 --no-create-home --home-dir /tmp \
       --shell /usr/sbin/nologin app
COPY --from=build /opt/venv /opt/venv
USER 10001:10001
# 8081: /healthz and /readyz; 9090: /metrics.
EXPOSE 8081 9090
ENTRYPOINT ["async-processor"]
CMD ["run"]
