"""The server's operations on a channel's semaphores, safe against the client.

A channel's semaphores live in its segment, which the client maps read-write:
a client can write anything into them. glibc's ``sem_post`` and ``sem_*wait``
take the futex flags from the ``sem_t`` itself (its ``private`` word) and abort
the whole process ("The futex facility returned an unexpected error code") when
the kernel rejects them, and ``sem_post`` fails once the value reaches
``SEM_VALUE_MAX``. So the server never passes a client-writable ``sem_t`` to a
glibc call that reads more than the value:

- ``try_acquire`` is glibc's ``sem_trywait``: one compare-and-swap on the value
  word, nothing else read;
- ``post`` adds the token itself and wakes a sleeper with a raw ``futex``
  system call whose flags the server chooses;
- ``acquire`` (the waiter thread, on ``submit``) registers as a waiter, sleeps
  in a raw ``futex`` call and deregisters.

Both interoperate with glibc's semaphores on the client side (glibc ≥ 2.21 on a
64-bit little-endian CPU: a ``sem_t`` starts with a uint64 whose low half is the
value — the futex word — and whose high half counts waiters). Whatever a client
writes into these words, only its own requests suffer.

Why plain stores suffice: the server is the only poster of a slot's ``done``
and the only waiter on ``submit``. A well-behaved client takes a ``done`` token
only after it was posted and submits to a slot only after taking its token, so
when the server posts, nobody else changes the value; the client's own updates
of the waiter count are atomic read-modify-writes of the whole 64-bit word,
which retry if a store of ours lands in between.

Barriers: ``_fence`` is a release (``sem_post``) followed by an acquire
(``sem_trywait``) on a private semaphore — on x86 two locked instructions, on
aarch64 a store-release followed by a load-acquire, which do not reorder. It
keeps the rows and result words before the token (what the client's acquire of
``done`` pairs with), and the token before the read of the waiter count (else
post and a client going to sleep could miss each other). The kernel's futex
wait reads the value after a full barrier of its own, after our registration.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import platform
import time

from pleclient.semaphore import SharedSemaphore

SEM_VALUE_MAX = 0x7FFFFFFF
FUTEX_WAIT, FUTEX_WAKE = 0, 1  # without FUTEX_PRIVATE_FLAG: shared between processes
SYS_FUTEX = {"x86_64": 202, "amd64": 202, "aarch64": 98, "arm64": 98,
             "riscv64": 98}.get(platform.machine().lower())
POLL_S = 0.001
"""Without a known futex system call number, ``acquire`` polls this often."""

_name = ctypes.util.find_library("c") or "libc.so.6"
_syscall_blocking = ctypes.CDLL(_name, use_errno=True).syscall  # releases the GIL
_syscall_fast = ctypes.PyDLL(_name, use_errno=True).syscall  # never blocks: keeps it
for _fn in (_syscall_blocking, _syscall_fast):
    _fn.restype = ctypes.c_long
    _fn.argtypes = [ctypes.c_long, ctypes.c_void_p, ctypes.c_int, ctypes.c_int,
                    ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int]


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


_fence_storage = (ctypes.c_uint64 * 4)()
_fence_sem = SharedSemaphore(ctypes.addressof(_fence_storage))
_fence_sem.initialize(0)


def _fence() -> None:
    """Order every memory access before it before every access after it."""
    _fence_sem.post()
    _fence_sem.try_acquire()


class PeerSemaphore(SharedSemaphore):
    """A semaphore in a client's segment, operated on by the server (see module)."""

    __slots__ = ("_words",)

    def __init__(self, address: int) -> None:
        super().__init__(address)
        self._words = (ctypes.c_uint32 * 2).from_address(address)  # value, waiters

    def post(self) -> None:
        _fence()  # the payload before the token
        words = self._words
        value = words[0]
        if value < SEM_VALUE_MAX:  # saturated only if the client wrote it so
            words[0] = value + 1
        _fence()  # the token before the waiter count
        if words[1] and SYS_FUTEX is not None:
            _syscall_fast(SYS_FUTEX, self.address, FUTEX_WAKE, 1, None, None, 0)

    def wake(self) -> None:
        """Wake every sleeper without adding a token (a waiter being retired)."""
        if SYS_FUTEX is not None:
            _syscall_fast(SYS_FUTEX, self.address, FUTEX_WAKE, 0x7FFFFFFF, None, None, 0)

    def acquire(self, timeout: float) -> bool:
        """Take a token, waiting up to ``timeout`` seconds; False on timeout (or
        an early wake-up: callers loop)."""
        if self.try_acquire():
            return True
        if timeout <= 0:
            return False
        if SYS_FUTEX is None:
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                time.sleep(POLL_S)
                if self.try_acquire():
                    return True
            return False
        words = self._words
        words[1] = 1  # registered: the client's sem_post now makes the wake-up call
        try:
            ts = _Timespec(int(timeout), int((timeout % 1) * 1e9))
            if _syscall_blocking(SYS_FUTEX, self.address, FUTEX_WAIT, 0, ctypes.byref(ts),
                                 None, 0) != 0:
                err = ctypes.get_errno()
                if err not in (errno.EAGAIN, errno.ETIMEDOUT, errno.EINTR):
                    raise OSError(err, f"futex wait: {errno.errorcode.get(err, err)}")
        finally:
            words[1] = 0
        return self.try_acquire()
