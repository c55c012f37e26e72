# async-processor container image.
# Stage 1 installs the package into a virtualenv (and precompiles it); stage 2 copies
# only that virtualenv onto a clean slim Python, so no pip caches, build tools or
# sources reach the final image. The runtime user is non-root (UID 10001, matching the
# Helm chart) and nothing is written under /opt/venv at run time, so the container
# runs with a read-only root filesystem (/tmp comes from an emptyDir in the chart).
ARG PYTHON_IMAGE=python:3.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
WORKDIR /src
COPY pyproject.toml README.md ./
COPY async_processor ./async_processor
# Optional extras baked in; `otel` lets OTEL_EXPORTER_OTLP_ENDPOINT turn tracing on.
# `--build-arg EXTRAS=` builds without any (the expansion drops the empty brackets).
ARG EXTRAS=otel
RUN pip install --no-compile ".${EXTRAS:+[$EXTRAS]}" \
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
