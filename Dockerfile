# node-health agent image: Debian's python3 on debian:bookworm-slim, the package and its dependencies in a
# venv (py-spy included), and nsenter (util-linux) to run host binaries such as npu-smi in the host's mount
# namespace. Builds with podman, buildah or docker; docs/image.md says how, tests/deploy/test_image.py builds and runs it.

# Build stage: pip and venv from Debian; every dependency is a binary wheel, so no compiler is needed.
FROM docker.io/library/debian:bookworm-slim AS build
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
# Then the slimming (docs/image.md): the kubernetes client's asyncio copy (kubernetes.aio, ~70 MB) and the
# aiohttp stack only it uses are never imported (the agent uses the synchronous client); the generated API and
# model modules (~55 MB) keep only their bytecode, in place of the source; pip and setuptools are not needed at
# run time. The import check proves the agent, its Kubernetes client and every probe still load.
RUN /opt/node-health/bin/pip install --no-cache-dir --disable-pip-version-check --no-deps . \
    && /opt/node-health/bin/pip uninstall --yes --disable-pip-version-check \
        aiohttp aiohttp-retry aiosignal aiohappyeyeballs frozenlist multidict propcache yarl \
    && kube="$(/opt/node-health/bin/python -c 'import kubernetes, os; print(os.path.dirname(kubernetes.__file__))')" \
    && rm -rf "$kube/aio" \
    && /opt/node-health/bin/python -m compileall -q -b "$kube/client/api" "$kube/client/models" \
    && find "$kube/client/api" "$kube/client/models" \( -name '*.py' -o -name __pycache__ \) -prune -exec rm -rf {} + \
    && /opt/node-health/bin/python -c "import agent.cli, agent.kube, kubernetes.client, kubernetes.watch, probes; probes.all_probes()" \
    && /opt/node-health/bin/python -m pip uninstall --yes --disable-pip-version-check pip setuptools

# Final stage: python3, util-linux (nsenter) and the CA bundle (egress TLS checks), no compilers, no pip.
FROM docker.io/library/debian:bookworm-slim
# util-linux is Essential in Debian (so nsenter is already there); naming it states the dependency.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 util-linux ca-certificates \
    && rm -rf /var/lib/apt/lists/* \
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
