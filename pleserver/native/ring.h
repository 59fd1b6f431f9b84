/* One io_uring, set up and driven through raw syscalls: the miss engine runs
 * each batch of reads on a ring (reads.c), and the disk probe measures the
 * disk through one (probe.c).
 *
 * A ring carries ple_read records: the caller fills fd, offset, buf and len,
 * queues the read, and gets res and ns back in its completion callback. A
 * ring is used by one thread at a time. */
#ifndef PLE_RING_H
#define PLE_RING_H

#include <stdint.h>
#include <sys/uio.h>

#include "common.h"

/* One positional read, as the ring and the pread fallback (reads.h) run it. */
typedef struct ple_read {
    int fd;
    uint64_t offset;
    void *buf;
    uint32_t len;
    int32_t res;       /* out: bytes read (may be short at end of file) or -errno */
    uint64_t ns;       /* out: submission to completion */
    struct iovec iov;  /* the io_uring READV vector (internal) */
    uint64_t start_ns; /* internal */
} ple_read;

typedef struct ple_ring ple_ring;

/* NULL on failure, errno set (from io_uring_setup or mmap). */
ple_ring *ple_ring_open(unsigned entries);
void ple_ring_close(ple_ring *ring);
unsigned ple_ring_entries(const ple_ring *ring);
/* Reads submitted to the kernel and not reaped yet. */
unsigned ple_ring_in_flight(const ple_ring *ring);
/* Queue one read (the caller keeps at most `entries` in flight). */
void ple_ring_prep_read(ple_ring *ring, ple_read *rd);
/* Submit what was queued and wait until at least `wait` reads completed;
 * then call done(ctx, read) for each completed read. Returns the number of
 * completions, or -errno when submission failed: the queued reads the kernel
 * had not consumed were then taken back (they are not in flight), and
 * *taken_back, when not NULL, says how many (the newest ones queued). */
int ple_ring_submit_and_reap(ple_ring *ring, unsigned wait,
                             void (*done)(void *ctx, ple_read *rd), void *ctx,
                             unsigned *taken_back);

#endif
