# syntax=docker/dockerfile:1
# The kvgate gateway image. `make image` builds kvgate:<version>, the image the Helm chart runs by
# default. Runs as uid/gid 10001 and writes nothing outside /tmp, so it works with a read-only root
# filesystem when /tmp is a mounted volume (the chart mounts an emptyDir there).
ARG PYTHON_IMAGE=python:3.11-slim-bookworm
# Extras baked in: `tokenizer` lets pools run the normalizer's tokenizer mode, `otel` exports traces
# (the chart's `tracing.enabled`), `redis` lets replica sync use an existing Redis or Valkey (the
# chart's `sync.url: redis://...`; docs/install.md); `make image KVGATE_EXTRAS=` builds the leaner
# image for approximate and render modes, without traces, syncing through NATS only.
ARG KVGATE_EXTRAS=tokenizer,otel,redis

FROM ${PYTHON_IMAGE} AS build
ARG KVGATE_EXTRAS
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
COPY pyproject.toml README.md LICENSE NOTICE ./
COPY gateway/ gateway/
COPY policies/ policies/
COPY prompt_normalizer/ prompt_normalizer/
COPY loadtest/ loadtest/
# kvgate's wheel plus a wheel of every dependency: the runtime stage installs offline from these
# and carries no source tree, build backend or pip cache.
RUN pip wheel --wheel-dir /wheels ".[${KVGATE_EXTRAS}]"

FROM ${PYTHON_IMAGE} AS runtime
ARG KVGATE_EXTRAS
# No .pyc writes at run time (pip compiled them at install); HOME points at the writable /tmp.
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    HOME=/tmp
# The only index is /wheels, built above from this tree, so the version is pinned by construction.
# hadolint ignore=DL3013
RUN --mount=type=bind,from=build,source=/wheels,target=/wheels \
    pip install --no-index --find-links /wheels "kvgate[${KVGATE_EXTRAS}]" \
    && groupadd --system --gid 10001 kvgate \
    && useradd --system --uid 10001 --gid 10001 --no-create-home --home-dir /tmp \
        --shell /usr/sbin/nologin kvgate
# Numeric ids, so Kubernetes can verify runAsNonRoot without resolving a user name.
USER 10001:10001
WORKDIR /tmp
EXPOSE 8080
# Docker only; Kubernetes uses the chart's probes (GET /healthz, /readyz) instead.
HEALTHCHECK --interval=10s --timeout=3s --start-period=20s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen(os.environ.get('KVGATE_HEALTHCHECK_URL', 'http://127.0.0.1:8080/healthz'), timeout=2)"]
ENTRYPOINT ["kvgate", "serve"]
CMD ["--config", "/etc/kvgate/config/gateway.yaml"]
