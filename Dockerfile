# syntax=docker/dockerfile:1
#
# One image for every role: `docker run IMAGE server|scheduler|worker|migrate`.
# Build: docker build -t scheduler-grpc .      (docker-compose.yml builds it for you)
#
# Stage 1 builds wheels (compilers live here only); stage 2 installs them offline into a slim
# Python with no build tools, and runs as an unprivileged user under tini.

ARG PYTHON_IMAGE=python:3.11-slim-bookworm

# --------------------------------------------------------------------------------------------------
FROM ${PYTHON_IMAGE} AS builder

ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1

# Only used if a dependency has no wheel for this platform and must be compiled.
RUN apt-get update \
    && apt-get install -y --no-install-recommends build-essential \
    && rm -rf /var/lib/apt/lists/*

WORKDIR /src

# The generated client stubs are their own distribution (`scheduler-grpc-client`) that the
# package depends on: build it first, then the package against that very wheel (naming the wheel
# file pins it, so pip never takes a same-named project from an index instead).
COPY clients/python/ clients/python/
RUN pip wheel --no-deps --wheel-dir /wheels ./clients/python

COPY pyproject.toml README.md requirements.lock ./
COPY scheduler_grpc/ scheduler_grpc/
# No extras: `embedded` (dev-only Valkey/PostgreSQL wheels) and `dev` (tests, linters) stay out.
# The lock constrains every dependency to the version the tests passed with (`make lock`).
RUN pip wheel --wheel-dir /wheels --constraint requirements.lock /wheels/scheduler_grpc_client-*.whl .

# --------------------------------------------------------------------------------------------------
FROM ${PYTHON_IMAGE} AS runtime

LABEL org.opencontainers.image.title="scheduler-grpc" \
      org.opencontainers.image.description="Distributed cron-capable job scheduler with a gRPC control plane" \
      org.opencontainers.image.licenses="Apache-2.0"

# tini is PID 1: it forwards SIGTERM/SIGINT to scheduler-grpc and reaps the zombies that
# shell.command children (and their orphans) would otherwise leave behind.
RUN apt-get update \
    && apt-get install -y --no-install-recommends tini \
    && rm -rf /var/lib/apt/lists/*

# Numeric ids so orchestrators can check runAsNonRoot.
RUN groupadd --system --gid 10001 scheduler \
    && useradd --system --uid 10001 --gid scheduler --home-dir /home/scheduler --create-home \
       --shell /usr/sbin/nologin scheduler

# Install the wheels from the builder without copying them into a layer, and without an index:
# exactly what the builder resolved, the client distribution first.
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_ROOT_USER_ACTION=ignore
RUN --mount=type=bind,from=builder,source=/wheels,target=/wheels \
    pip install --no-index --find-links /wheels scheduler-grpc-client \
    && pip install --no-index --find-links /wheels scheduler-grpc \
    && scheduler-grpc --help > /dev/null

ENV SCHEDULER_ENV=production \
    SCHEDULER_LOG_FORMAT=json \
    SCHEDULER_GRPC_HOST=0.0.0.0 \
    SCHEDULER_METRICS_HOST=0.0.0.0 \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1

WORKDIR /home/scheduler
USER 10001:10001

# gRPC and the web console (server); /metrics of server, scheduler, worker.
EXPOSE 50051 8080 9090 9091 9100

ENTRYPOINT ["/usr/bin/tini", "--", "scheduler-grpc"]
CMD ["server"]
