# ple-server itself in an image, for deploy/kubernetes/ (one server per node).
# Build from the root of the pleserver source tree:
#   docker build -f deploy/container/ple-server.Dockerfile -t ple-server:0.1.0 .
# The source install builds pleserver's C extension: the build stage has a C
# compiler and Python's headers, the final image only the result.
FROM python:3.11-slim AS build
RUN apt-get update \
 && apt-get install -y --no-install-recommends gcc libc6-dev \
 && rm -rf /var/lib/apt/lists/*
COPY pyproject.toml setup.py MANIFEST.in README.md /src/pleserver/
COPY pleclient /src/pleserver/pleclient
COPY pleserver /src/pleserver/pleserver
RUN python -m venv /opt/ple-server \
 && /opt/ple-server/bin/pip install --no-cache-dir /src/pleserver \
 && /opt/ple-server/bin/pleserver --help >/dev/null

FROM python:3.11-slim
COPY --from=build /opt/ple-server /opt/ple-server
# The DaemonSet runs it as 65532 (no name needed: access is by number).
USER 65532:65532
ENTRYPOINT ["/opt/ple-server/bin/pleserver"]
CMD ["serve", "--config", "/etc/ple-server/config.toml"]
