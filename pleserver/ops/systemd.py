"""systemd's notify protocol, without libsystemd: datagrams to $NOTIFY_SOCKET.

``READY=1`` once the tables are open and the socket listens, ``STATUS=…`` lines
(prewarm progress), ``WATCHDOG=1`` from the serving loop, ``RELOADING=1`` and
then ``READY=1`` again around a configuration reload (SIGHUP), ``STOPPING=1``
on shutdown. Outside systemd (no ``NOTIFY_SOCKET``) every call is a no-op.
"""

from __future__ import annotations

import logging
import os
import socket
import time

log = logging.getLogger("pleserver.systemd")


class Notifier:
    def __init__(self, address: str | None = None) -> None:
        address = address if address is not None else os.environ.get("NOTIFY_SOCKET")
        self.address: str | None = None
        self._sock: socket.socket | None = None
        if address:
            # "@name" is an abstract socket: a leading NUL byte on the wire.
            self.address = "\0" + address[1:] if address.startswith("@") else address
            self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)

    @property
    def enabled(self) -> bool:
        return self._sock is not None

    def notify(self, *fields: str) -> None:
        if self._sock is None or self.address is None:
            return
        try:
            self._sock.sendto("\n".join(fields).encode(), self.address)
        except OSError as exc:
            log.warning("systemd notify to %s failed: %s", self.address, exc)

    def ready(self, status: str = "") -> None:
        self.notify("READY=1", f"MAINPID={os.getpid()}", *([f"STATUS={status}"] if status else []))

    def status(self, text: str) -> None:
        self.notify(f"STATUS={text}")

    def watchdog(self) -> None:
        self.notify("WATCHDOG=1")

    def reloading(self) -> None:
        """The configuration is being reloaded; ``ready`` again once done.
        ``MONOTONIC_USEC`` is what ``Type=notify-reload`` (systemd 253 and
        later) requires with it; older managers ignore it."""
        usec = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
        self.notify("RELOADING=1", f"MONOTONIC_USEC={usec}", "STATUS=reloading the configuration")

    def stopping(self) -> None:
        self.notify("STOPPING=1", "STATUS=stopping")


def watchdog_interval() -> float | None:
    """Seconds between pings systemd expects (half of WATCHDOG_USEC), or None."""
    usec = os.environ.get("WATCHDOG_USEC")
    pid = os.environ.get("WATCHDOG_PID")
    if not usec or (pid and pid != str(os.getpid())):
        return None
    try:
        return int(usec) / 2e6
    except ValueError:
        return None
