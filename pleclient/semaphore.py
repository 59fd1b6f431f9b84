"""Process-shared POSIX semaphores living *inside* a channel segment.

``sem_init(sem, pshared=1, 0)`` on memory that both processes map gives a
semaphore with no name: nothing in ``/dev/shm`` that another process could
open, and nothing to unlink or leak. Only the holders of the segment's file
descriptor can touch it. glibc's post is a release and a successful wait an
acquire (the barrier the protocol's ordering rule rests on); an uncontended
post or trywait is a user-space atomic, a system call happens only when a
waiter sleeps.

Called through ctypes: ``post`` and ``try_acquire`` without releasing the GIL
(they never block), ``acquire`` with a timeout through a GIL-releasing call.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import time

SEM_BYTES = 32  # sizeof(sem_t) with glibc on 64-bit Linux (x86-64 and aarch64)
CLOCK_MONOTONIC = 1

_name = ctypes.util.find_library("c") or "libc.so.6"
_blocking = ctypes.CDLL(_name, use_errno=True)  # releases the GIL around calls
_fast = ctypes.PyDLL(_name, use_errno=True)  # keeps the GIL: for calls that never block


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


_sem_init = _fast.sem_init
_sem_init.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint]
_sem_post = _fast.sem_post
_sem_post.argtypes = [ctypes.c_void_p]
_sem_trywait = _fast.sem_trywait
_sem_trywait.argtypes = [ctypes.c_void_p]
_sem_getvalue = _fast.sem_getvalue
_sem_getvalue.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_int)]
try:
    _sem_clockwait = _blocking.sem_clockwait  # glibc ≥ 2.30: waits on CLOCK_MONOTONIC
    _sem_clockwait.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.POINTER(_Timespec)]
    _sem_timedwait = None
except AttributeError:  # older glibc (or musl): CLOCK_REALTIME deadlines
    _sem_clockwait = None
    _sem_timedwait = _blocking.sem_timedwait
    _sem_timedwait.argtypes = [ctypes.c_void_p, ctypes.POINTER(_Timespec)]


class SharedSemaphore:
    """A semaphore at ``address`` inside a shared mapping the caller keeps alive."""

    __slots__ = ("address",)

    def __init__(self, address: int) -> None:
        self.address = ctypes.c_void_p(address)

    def initialize(self, value: int = 0) -> None:
        if _sem_init(self.address, 1, value) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"sem_init: {errno.errorcode.get(err, err)}")

    def post(self) -> None:
        if _sem_post(self.address) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"sem_post: {errno.errorcode.get(err, err)}")

    def try_acquire(self) -> bool:
        return _sem_trywait(self.address) == 0

    def acquire(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds; True when a post was taken."""
        if _sem_trywait(self.address) == 0:
            return True
        if timeout <= 0:
            return False
        if _sem_clockwait is not None:
            deadline = time.monotonic_ns() + int(timeout * 1e9)
        else:
            deadline = time.time_ns() + int(timeout * 1e9)
        ts = _Timespec(deadline // 1_000_000_000, deadline % 1_000_000_000)
        while True:
            if _sem_clockwait is not None:
                rc = _sem_clockwait(self.address, CLOCK_MONOTONIC, ctypes.byref(ts))
            else:
                rc = _sem_timedwait(self.address, ctypes.byref(ts))
            if rc == 0:
                return True
            err = ctypes.get_errno()
            if err == errno.EINTR:
                continue
            if err == errno.ETIMEDOUT:
                return False
            raise OSError(err, f"sem_clockwait: {errno.errorcode.get(err, err)}")

    @property
    def value(self) -> int:
        v = ctypes.c_int()
        _sem_getvalue(self.address, ctypes.byref(v))
        return v.value
