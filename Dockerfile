# node-health agent image: Debian's python3 on debian:bookworm-slim, the package and its dependencies in a
# venv (py-spy included), and nsenter (util-linux) to run host binaries such as npu-smi in the host's mount
# namespace. Builds with podman, buildah or docker; docs/image.md says how, tests/deploy/test_image.py builds and runs it.

# The base of both stages: a build host that cannot pull it passes a local one (docs/image.md).
ARG BASE=docker.io/library/debian:bookworm-slim

# Build stage: pip and venv from Debian; every dependency is a binary wheel, so no compiler is needed.
FROM ${BASE} AS build
# Unpinned on purpose: the base image pins the release; the same packages as the final stage's python3.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /src
# The dependencies come from pyproject.toml alone, so this layer is rebuilt only when they change.
COPY pyproject.toml ./
RUN python3 -m venv /opt/node-health \
    && python3 -c "import tomllib; print(*tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies'], sep='\n')" \
        > requirements.txt \
    && /opt/node-health/bin/pip install --no-cache-dir --disable-pip-version-check --only-binary=:all: -r requirements.txt
COPY README.md ./
COPY agent ./agent
COPY probes ./probes
# Then the slimming (docs/image.md, Slimming; scripts/slim_venv.py says what goes and why): the kubernetes
# client's asyncio copy and the aiohttp stack only it uses, the source of its generated modules (bytecode stays),
# pip and setuptools. It ends with an import check of the agent, its Kubernetes client and every probe.
COPY scripts/slim_venv.py ./scripts/
RUN /opt/node-health/bin/pip install --no-cache-dir --disable-pip-version-check --no-deps . \
    && /opt/node-health/bin/python scripts/slim_venv.py

# Final stage: python3, util-linux (nsenter) and the CA bundle (egress TLS checks), no compilers, no pip.
FROM ${BASE}
# util-linux is Essential in Debian (so nsenter is already there); naming it states the dependency.
# The interpreter's regression-test support and pydoc's help texts are not for a daemon: nothing imports them.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 util-linux ca-certificates \
    && rm -rf /var/lib/apt/lists/* /usr/lib/python3.*/test /usr/lib/python3.*/pydoc_data \
    && nsenter --version
COPY --from=build /opt/node-health /opt/node-health
ENV PATH=/opt/node-health/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1
RUN node-health --version \
    && py-spy --version \
    && node-health probes > /dev/null
EXPOSE 9100
# Runs as root: device nodes, /proc/<pid>/fd of every process and nsenter need it (see deploy/daemonset.yaml).
ENTRYPOINT ["node-health"]
CMD ["run", "--config", "/etc/node-health/config.yaml"]
# OCI labels, last so that a new revision or date rebuilds no layer: scripts/release.py passes the release
# (agent/version.py), the commit, the repository and the commit's time; a build by hand gets "unknown".
ARG VERSION=unknown
ARG REVISION=unknown
ARG SOURCE=unknown
ARG CREATED=unknown
LABEL org.opencontainers.image.title="node-health" \
      org.opencontainers.image.description="Node-side health-check agent for Kubernetes clusters of Ascend NPU and NVIDIA GPU nodes" \
      org.opencontainers.image.licenses="Apache-2.0" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.revision="${REVISION}" \
      org.opencontainers.image.source="${SOURCE}" \
      org.opencontainers.image.created="${CREATED}"
