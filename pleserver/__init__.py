"""ple-server: the daemon that serves PLE rows over shared memory."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("pleserver")
except PackageNotFoundError:  # running from a source tree
    __version__ = "0.0.0+source"
