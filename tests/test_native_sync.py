"""The channel's synchronization words (``pleclient._sync``): publish and wait
between real processes over a shared memfd, futex_waitv over many words, and
arguments checked at the door (ValueError/TypeError, never a crash)."""

from __future__ import annotations

import mmap
import os
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from pleclient import _sync
from tests.host import require_futex_waitv

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VALUE, WAITERS = 0, 4  # byte offsets of an eventcount's two words


@pytest.fixture
def shared():
    """A page of shared memory (a memfd) and Words over it; the fd for children."""
    fd = os.memfd_create("ple.test.sync", 0)
    os.ftruncate(fd, 4096)
    mm = mmap.mmap(fd, 4096)
    words = _sync.Words(mm)
    yield fd, words
    words.release()
    mm.close()
    os.close(fd)


def child(code: str, fd: int) -> subprocess.Popen:
    """A Python child that maps ``fd`` as ``words`` and runs ``code``."""
    prelude = textwrap.dedent("""
        import mmap, sys, time
        from pleclient import _sync
        mm = mmap.mmap(int(sys.argv[1]), 4096)
        words = _sync.Words(mm)
    """)
    return subprocess.Popen(
        [sys.executable, "-c", prelude + textwrap.dedent(code), str(fd)],
        cwd=REPO,
        pass_fds=(fd,),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_a_sleeper_in_another_process_is_woken_by_publish_and_sees_the_payload(shared):
    fd, words = shared
    sleeper = child(
        """
        words.store(12, 1)  # "about to wait"
        value = words.wait_while(0, 0, 4, 30.0)
        print(value, words.load(8), flush=True)  # the payload, published before the word
    """,
        fd,
    )
    deadline = time.monotonic() + 30
    while words.load(12) != 1 or words.load(WAITERS) == 0:  # asleep: registered
        assert time.monotonic() < deadline and sleeper.poll() is None, sleeper.stderr.read()
        time.sleep(0.001)
    words.store(8, 0xC0FFEE)
    assert words.publish(VALUE, 7, WAITERS) is True  # a sleeper was registered: woken
    out, err = sleeper.communicate(timeout=30)
    assert out.split() == ["7", str(0xC0FFEE)], err
    assert words.load(WAITERS) == 0  # deregistered


def test_publish_without_a_sleeper_makes_no_wake_call(shared):
    _, words = shared
    assert words.publish(VALUE, 1, WAITERS) is False
    assert words.load(VALUE) == 1


def test_wait_while_returns_at_once_when_the_word_already_differs(shared):
    _, words = shared
    words.store(VALUE, 3)
    started = time.monotonic()
    assert words.wait_while(VALUE, 2, WAITERS, 10.0, 10.0) == 3
    assert time.monotonic() - started < 1.0


def test_wait_while_times_out_with_the_unchanged_value_and_deregisters(shared):
    _, words = shared
    started = time.monotonic()
    assert words.wait_while(VALUE, 0, WAITERS, 0.05, 0.01) == 0
    assert 0.05 <= time.monotonic() - started < 5.0
    assert words.load(WAITERS) == 0


def test_futex_waitv_wakes_on_whichever_word_moves(shared):
    require_futex_waitv()
    fd, words = shared
    own = _sync.Words(bytearray(8))
    entries = [(own, 0, 0)] + [(words, 4 * i, 0) for i in range(1, 64)]
    for moved in (1, 40, 63):
        mover = child(
            f"""
            time.sleep(0.05)
            words.store({4 * moved}, 1)
            words.wake({4 * moved})
        """,
            fd,
        )
        woken = _sync.futex_waitv(entries, 30.0)
        assert mover.wait(30) == 0
        assert woken == moved or (woken == -1 and words.load(4 * moved) == 1)
        words.store(4 * moved, 0)


def test_futex_waitv_returns_at_once_when_a_word_differs_and_times_out_otherwise(shared):
    require_futex_waitv()
    _, words = shared
    words.store(8, 5)
    assert _sync.futex_waitv([(words, 0, 0), (words, 8, 4)], 10.0) == -1  # 5 ≠ 4
    started = time.monotonic()
    assert _sync.futex_waitv([(words, 0, 0)], 0.05) == -1
    assert time.monotonic() - started >= 0.05


def test_futex_waitv_returns_when_a_polled_word_leaves_its_idle_value(shared):
    """A word no one wakes a futex on (a GPU stream's rung word), written by
    another process without a wake: found by the native polls alone."""
    require_futex_waitv()
    fd, words = shared
    own = _sync.Words(bytearray(8))
    writer = child(
        """
        time.sleep(0.05)
        words.store(16, 1)  # no wake: as a stream writes it
    """,
        fd,
    )
    polled = [(words, 12, 0), (words, 16, 0)]
    started = time.monotonic()
    assert _sync.futex_waitv([(own, 0, 0)], 30.0, polled=polled, poll=0.0005) == 1 + 1
    assert time.monotonic() - started < 10.0 and writer.wait(30) == 0
    # a polled word that already differs returns at once; none: the timeout
    assert _sync.futex_waitv([(own, 0, 0)], 30.0, polled=polled, poll=0.001) == 2
    words.store(16, 0)
    started = time.monotonic()
    assert _sync.futex_waitv([(own, 0, 0)], 0.05, polled=polled, poll=0.001) == -1
    assert time.monotonic() - started >= 0.05
    # the futex words still wake it between polls
    waker = child(
        """
        time.sleep(0.05)
        words.store(0, 1)
        words.wake(0)
    """,
        fd,
    )
    assert _sync.futex_waitv([(own, 0, 0), (words, 0, 0)], 30.0, polled=polled, poll=1.0) in (
        1,
        -1,
    )
    assert waker.wait(30) == 0 and words.load(0) == 1


def test_futex_waitv_refuses_polled_words_without_a_poll_interval_or_of_bad_shape(shared):
    _, words = shared
    own = _sync.Words(bytearray(8))
    with pytest.raises(ValueError, match="poll must be > 0"):
        _sync.futex_waitv([(own, 0, 0)], 1.0, polled=[(words, 0, 0)])
    with pytest.raises(TypeError, match="polled words: entry 0"):
        _sync.futex_waitv([(own, 0, 0)], 1.0, polled=[(words, 0)], poll=0.001)
    with pytest.raises(ValueError, match="word offset"):
        _sync.futex_waitv([(own, 0, 0)], 1.0, polled=[(words, 4096, 0)], poll=0.001)
    too_many = [(words, 0, 0)] * (_sync.FUTEX_WAITV_MAX + 1)
    with pytest.raises(ValueError, match="polled words"):
        _sync.futex_waitv([(own, 0, 0)], 1.0, polled=too_many, poll=0.001)


def test_futex_waitv_is_available_on_this_kernel():
    """CI runs a kernel ≥ 5.16; the serving loop's fallback is tested in
    tests/test_core_lookup.py with idle_wait = poll."""
    release = tuple(int(x) for x in os.uname().release.split(".")[:2])
    assert (release >= (5, 16)) == _sync.HAVE_FUTEX_WAITV


@pytest.mark.parametrize("offset", [-4, 2, 4094, 4096, 1 << 40])
def test_offsets_outside_the_buffer_or_unaligned_are_refused(shared, offset):
    _, words = shared
    for call in (
        lambda: words.load(offset),
        lambda: words.store(offset, 1),
        lambda: words.publish(offset, 1, 0),
        lambda: words.publish(0, 1, offset),
        lambda: words.wait_while(offset, 0, 4, 0.0),
        lambda: words.wake(offset),
        lambda: words.add(offset, 1),
        lambda: words.exchange(offset, 1),
        lambda: words.scan(offset, 4, 1, 0),
        lambda: _sync.futex_waitv([(words, offset, 0)], 0.0),
    ):
        with pytest.raises((ValueError, OverflowError)):
            call()


def test_bad_arguments_are_refused_at_the_door(shared):
    _, words = shared
    with pytest.raises(ValueError):
        words.wait_while(0, 0, 4, -1.0)
    with pytest.raises(ValueError):
        words.wait_while(0, 0, 4, float("nan"))
    with pytest.raises(ValueError):
        words.wake(0, 0)
    with pytest.raises(ValueError):
        _sync.futex_waitv([], 0.0)
    with pytest.raises(ValueError):
        _sync.futex_waitv([(words, 0, 0)] * (_sync.FUTEX_WAITV_MAX + 1), 0.0)
    with pytest.raises(TypeError):
        _sync.futex_waitv([(b"not words", 0, 0)], 0.0)
    with pytest.raises(BufferError):
        _sync.Words(b"read-only")


def test_released_words_refuse_every_call_and_a_waiting_thread_blocks_release():
    mm = mmap.mmap(-1, 4096)
    mine = _sync.Words(mm)
    waiting = threading.Thread(target=mine.wait_while, args=(0, 0, 4, 0.5))
    waiting.start()
    deadline = time.monotonic() + 5
    while mine.load(4) == 0 and time.monotonic() < deadline:  # registered: inside the wait
        time.sleep(0.001)
    with pytest.raises(BufferError):
        mine.release()
    waiting.join()
    mine.release()
    with pytest.raises(ValueError, match="released"):
        mine.load(0)
    mm.close()  # no export left


def test_add_wraps_modulo_two_to_the_32(shared):
    _, words = shared
    words.store(0, 0xFFFFFFFF)
    assert words.add(0, 1) == 0
    assert words.add(0, -1) == 0xFFFFFFFF


def test_exchange_returns_the_word_it_replaced(shared):
    _, words = shared
    words.store(8, 1)
    assert words.exchange(8, 0) == 1
    assert words.exchange(8, 0) == 0
    assert words.load(8) == 0


def test_scan_answers_which_words_at_a_stride_hold_the_value(shared):
    _, words = shared
    for offset in (40, 40 + 3 * 64, 40 + 63 * 64):  # 64 words, 64 bytes apart
        words.store(offset, 1)
    words.store(40 + 5 * 64, 2)
    assert words.scan(40, 64, 64, 1) == 1 | 1 << 3 | 1 << 63
    assert words.scan(40, 64, 3, 1) == 1
    assert words.scan(40, 64, 64, 7) == 0
    assert words.scan(4092, 4, 1, 0) == 1  # the buffer's last word


@pytest.mark.parametrize(
    "offset, stride, count",
    [
        (0, 4, 0),  # no word
        (0, 4, 65),  # past the 64 bits of the answer
        (0, 6, 2),  # unaligned stride
        (0, 0, 2),
        (0, -4, 2),
        (4092, 4, 2),  # the second word past the end
        (0, 4096, 2),
        (0, 1 << 62, 3),  # an offset that overflows
        (2, 4, 1),
    ],
)
def test_scan_refuses_words_outside_the_buffer(shared, offset, stride, count):
    _, words = shared
    with pytest.raises((ValueError, OverflowError)):
        words.scan(offset, stride, count, 0)
