/* An eventcount on 32-bit words that may be shared between processes: a value
 * word that a writer publishes, and a count of the threads that sleep on it
 * (its waiters word), which tells the writer whether to make the futex call.
 *
 * Plain C, no Python: the binding (sync.c) checks the offsets and releases
 * the GIL around these calls; the C test (tests/native/test_eventcount.c)
 * runs them under ASan, UBSan and TSan.
 *
 * The ordering edges, labelled as DPDK's rte_ring_c11_pvt.h labels its own
 * and cited by name from pleclient/protocol.py, channel.py and gpu.py:
 *
 *   E1  publish: release store of the word         pairs with E2
 *   E2  acquire load of the word (wait, and the binding's load)
 *                                                   pairs with E1, W1
 *   E3  publish: seq_cst fence, then the (relaxed) load of the waiters word
 *                                                   pairs with E4 and E5
 *   E4  wait: seq_cst increment of the waiters word, seq_cst fence, then the
 *       last load of the word before the futex sleep
 *                                                   pairs with E3
 *   E5  announce: relaxed store of a sleepers word (the server's "sleeping"),
 *       seq_cst fence, then the caller's next read of the value word (the
 *       kernel's, inside futex_waitv)               pairs with E3
 *
 * E3 with E4 (or E5) is Dekker's pattern: of the publisher's load of the
 * waiters word and the waiter's load of the value word, at least one sees
 * the other side's store, so a waiter never sleeps on a value that was
 * published without a wake-up call. The futex calls themselves read the word
 * under the kernel's hash-bucket lock after a full barrier, so a wake between
 * the waiter's last load and its sleep is not lost either.
 *
 * On x86-64 the release and acquire operations are plain moves and the
 * fences MFENCE (or a locked instruction); on aarch64 STLR / LDAR and DMB ISH.
 * Nothing here aborts on what a peer wrote: the words are only numbers, and
 * every wait has a deadline. */
#ifndef PLECLIENT_EVENTCOUNT_H
#define PLECLIENT_EVENTCOUNT_H

#include <stdatomic.h>
#include <stdint.h>

/* Cross-process atomics need lock-free (hence address-free) 32-bit words. */
_Static_assert(ATOMIC_INT_LOCK_FREE == 2, "32-bit atomics must be lock-free");
_Static_assert(sizeof(atomic_uint) == sizeof(uint32_t), "atomic_uint must be 32 bits");

/* Store value in word (E1: release: every store before the call is visible
 * to whoever reads the word with acquire and sees value), then (E3) read the
 * waiters word and wake every sleeper on word if it is non-zero: one futex
 * call at most, whatever the waiters word says. 1 if the call was made. */
int ple_ec_publish(atomic_uint *word, uint32_t value, atomic_uint *waiters);

/* Wait while word == value: spin up to spin_ns (yielding the CPU between
 * loads), then register in waiters (E4) and sleep on the futex, in all at
 * most timeout_ns (≥ 0). *seen is the word's last value, read with acquire
 * (E2): still value on timeout. 0, or -errno of a futex error other than a
 * wake-up, a changed word, a timeout or a signal. */
int ple_ec_wait_while(atomic_uint *word, uint32_t value, atomic_uint *waiters, int64_t timeout_ns,
                      int64_t spin_ns, uint32_t *seen);

/* Announce a sleeper before the caller's own check of a value word (E5):
 * a relaxed store of value in word, then a seq_cst fence. */
void ple_ec_announce(atomic_uint *word, uint32_t value);

/* Wake up to n sleepers on word; the number woken, or -errno. */
int ple_ec_wake(atomic_uint *word, int n);

#endif
