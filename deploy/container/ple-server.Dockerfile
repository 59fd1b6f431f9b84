# ple-server itself in an image, for deploy/kubernetes/ (one server per node).
# Build from the root of the pleserver source tree, on a node of the
# architecture it is for (x86-64, or arm64: DGX OS), or for another one with
# `docker buildx build --platform linux/arm64` (qemu's binfmt handlers on the
# building host):
#   docker build -f deploy/container/ple-server.Dockerfile -t ple-server:0.1.0 .
# The context is the source tree as .dockerignore passes it (no build outputs).
# The source install builds pleserver's C extensions: the build stage has a C
# compiler and Python's headers, the final image only the result.
FROM python:3.11-slim AS build
RUN apt-get update \
 && apt-get install -y --no-install-recommends gcc libc6-dev \
 && rm -rf /var/lib/apt/lists/*
# The whole tree: the build reads setup.py and MANIFEST.in, and packs deploy/'s
# units and default config into the package (`pleserver files`).
COPY . /src/pleserver
RUN python -m venv /opt/ple-server \
 && /opt/ple-server/bin/pip install --no-cache-dir /src/pleserver \
 && /opt/ple-server/bin/python -c "import pleclient._sync, pleserver._native" \
 && /opt/ple-server/bin/pleserver --version

# The build stage's base again: the venv's python is a link to that image's
# interpreter, and the venv is copied to the same path (a venv cannot move).
FROM python:3.11-slim
COPY --from=build /opt/ple-server /opt/ple-server
# The DaemonSet runs it as 65532 (no name needed: access is by number).
USER 65532:65532
ENTRYPOINT ["/opt/ple-server/bin/pleserver"]
CMD ["serve", "--config", "/etc/ple-server/config.toml"]
