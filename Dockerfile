# node-health agent image: slim Python, the package with its dependencies (py-spy included), and
# nsenter (util-linux) to run host binaries such as npu-smi in the host's mount namespace.
FROM python:3.11-slim-bookworm AS build
WORKDIR /src
COPY pyproject.toml README.md ./
COPY agent ./agent
COPY probes ./probes
RUN pip wheel --no-cache-dir --wheel-dir /wheels .

FROM python:3.11-slim-bookworm
# util-linux is Essential in Debian (so nsenter is already there); installing it names the dependency
# and picks up the release's security updates. Unpinned on purpose: the base image pins the release.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends util-linux \
    && rm -rf /var/lib/apt/lists/* \
    && nsenter --version
COPY --from=build /wheels /wheels
RUN pip install --no-cache-dir --no-index --find-links=/wheels /wheels/node_health-*.whl \
    && rm -rf /wheels \
    && py-spy --version \
    && node-health --help > /dev/null
ENV PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1
EXPOSE 9100
# Runs as root: device nodes, /proc/<pid>/fd of every process and nsenter need it (see deploy/daemonset.yaml).
ENTRYPOINT ["node-health"]
CMD ["run", "--config", "/etc/node-health/config.yaml"]
