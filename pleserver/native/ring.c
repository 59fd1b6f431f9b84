/* One io_uring through raw syscalls (see ring.h).
 *
 * Ring protocol (kernel ABI, include/uapi/linux/io_uring.h):
 *   SQ: we write the SQE and the index array slot, then store the SQ tail
 *       with RELEASE (the kernel's acquire of the tail then sees the SQE).
 *       We read the SQ head with ACQUIRE: the kernel has finished reading the
 *       SQEs before it advances the head (only needed to take back SQEs the
 *       kernel did not consume).
 *   CQ: we load the CQ tail with ACQUIRE (the kernel wrote the CQEs before
 *       its release of the tail), read the CQEs, then store the CQ head with
 *       RELEASE (we are done reading those CQEs before the kernel may reuse
 *       them).
 *   Our own SQ tail and CQ head have one writer, us: kept in plain locals.
 * The ring words are plain `unsigned` in shared memory; they are accessed
 * through `_Atomic unsigned *`, which has the size and alignment of
 * `unsigned` (lock-free) on x86-64 and aarch64.
 *
 * Syscalls: io_uring_setup (425) and io_uring_enter (426) — the same numbers
 * on x86-64 and aarch64 — plus mmap/munmap/close. Reads use IORING_OP_READV
 * (Linux 5.1+), no setup flags. */
#include <errno.h>
#include <linux/io_uring.h>
#include <sched.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "ring.h"

#ifndef __NR_io_uring_setup
#define __NR_io_uring_setup 425
#endif
#ifndef __NR_io_uring_enter
#define __NR_io_uring_enter 426
#endif

struct ple_ring {
    int fd;
    unsigned entries;
    void *sq_map, *cq_map;
    size_t sq_map_size, cq_map_size;
    struct io_uring_sqe *sqes;
    size_t sqes_size;
    _Atomic unsigned *sq_head, *sq_tail, *cq_head, *cq_tail;
    unsigned *sq_array, sq_mask, cq_mask;
    struct io_uring_cqe *cqes;
    unsigned sq_local_tail;  /* our next SQ tail (only we write it) */
    unsigned sq_submitted;   /* SQ tail the kernel was last told about */
    unsigned in_flight;      /* submitted, not reaped */
};

static void *ring_word(void *map, unsigned offset)
{
    return (char *)map + offset;
}

/* Set up one ring: io_uring_setup, then map the SQ ring, the CQ ring (one
 * map when the kernel says IORING_FEAT_SINGLE_MMAP) and the SQE array. */
ple_ring *ple_ring_open(unsigned entries)
{
    struct io_uring_params p;
    memset(&p, 0, sizeof p);
    int fd = (int)syscall(__NR_io_uring_setup, entries, &p);
    if (fd < 0)
        return NULL;
    ple_ring *ring = calloc(1, sizeof *ring);
    if (!ring) {
        close(fd);
        errno = ENOMEM;
        return NULL;
    }
    ring->fd = fd;
    ring->entries = p.sq_entries;
    ring->sq_map_size = p.sq_off.array + p.sq_entries * sizeof(unsigned);
    ring->cq_map_size = p.cq_off.cqes + p.cq_entries * sizeof(struct io_uring_cqe);
    int single = (p.features & IORING_FEAT_SINGLE_MMAP) != 0;
    if (single && ring->cq_map_size > ring->sq_map_size)
        ring->sq_map_size = ring->cq_map_size;
    ring->sq_map = mmap(NULL, ring->sq_map_size, PROT_READ | PROT_WRITE,
                        MAP_SHARED | MAP_POPULATE, fd, IORING_OFF_SQ_RING);
    if (ring->sq_map == MAP_FAILED)
        goto fail;
    ring->cq_map = single ? ring->sq_map
                          : mmap(NULL, ring->cq_map_size, PROT_READ | PROT_WRITE,
                                 MAP_SHARED | MAP_POPULATE, fd, IORING_OFF_CQ_RING);
    if (ring->cq_map == MAP_FAILED)
        goto fail;
    ring->sqes_size = p.sq_entries * sizeof(struct io_uring_sqe);
    ring->sqes = mmap(NULL, ring->sqes_size, PROT_READ | PROT_WRITE,
                      MAP_SHARED | MAP_POPULATE, fd, IORING_OFF_SQES);
    if (ring->sqes == MAP_FAILED)
        goto fail;
    ring->sq_head = ring_word(ring->sq_map, p.sq_off.head);
    ring->sq_tail = ring_word(ring->sq_map, p.sq_off.tail);
    ring->sq_mask = *(unsigned *)ring_word(ring->sq_map, p.sq_off.ring_mask);
    ring->sq_array = ring_word(ring->sq_map, p.sq_off.array);
    ring->cq_head = ring_word(ring->cq_map, p.cq_off.head);
    ring->cq_tail = ring_word(ring->cq_map, p.cq_off.tail);
    ring->cq_mask = *(unsigned *)ring_word(ring->cq_map, p.cq_off.ring_mask);
    ring->cqes = ring_word(ring->cq_map, p.cq_off.cqes);
    /* Relaxed: nothing else touches the ring yet. */
    ring->sq_local_tail = atomic_load_explicit(ring->sq_tail, memory_order_relaxed);
    ring->sq_submitted = ring->sq_local_tail;
    return ring;
fail:;
    int saved = errno;
    if (ring->sqes && ring->sqes != MAP_FAILED)
        munmap(ring->sqes, ring->sqes_size);
    if (ring->cq_map && ring->cq_map != MAP_FAILED && ring->cq_map != ring->sq_map)
        munmap(ring->cq_map, ring->cq_map_size);
    if (ring->sq_map && ring->sq_map != MAP_FAILED)
        munmap(ring->sq_map, ring->sq_map_size);
    close(fd);
    free(ring);
    errno = saved;
    return NULL;
}

void ple_ring_close(ple_ring *ring)
{
    munmap(ring->sqes, ring->sqes_size);
    if (ring->cq_map != ring->sq_map)
        munmap(ring->cq_map, ring->cq_map_size);
    munmap(ring->sq_map, ring->sq_map_size);
    close(ring->fd);
    free(ring);
}

unsigned ple_ring_entries(const ple_ring *ring)
{
    return ring->entries;
}

unsigned ple_ring_in_flight(const ple_ring *ring)
{
    return ring->in_flight;
}

void ple_ring_prep_read(ple_ring *ring, ple_read *rd)
{
    unsigned index = ring->sq_local_tail & ring->sq_mask;
    struct io_uring_sqe *sqe = &ring->sqes[index];
    memset(sqe, 0, sizeof *sqe);
    rd->iov.iov_base = rd->buf;
    rd->iov.iov_len = rd->len;
    sqe->opcode = IORING_OP_READV;
    sqe->fd = rd->fd;
    sqe->off = rd->offset;
    sqe->addr = (uint64_t)(uintptr_t)&rd->iov;
    sqe->len = 1;
    sqe->user_data = (uint64_t)(uintptr_t)rd;
    ring->sq_array[index] = index;
    ring->sq_local_tail++;
    rd->start_ns = ple_now_ns();
}

static int reap(ple_ring *ring, void (*done)(void *, ple_read *), void *ctx)
{
    unsigned head = atomic_load_explicit(ring->cq_head, memory_order_relaxed); /* ours */
    unsigned tail = atomic_load_explicit(ring->cq_tail, memory_order_acquire);  /* CQEs visible */
    int count = 0;
    uint64_t now = head != tail ? ple_now_ns() : 0;
    for (; head != tail; head++, count++) {
        struct io_uring_cqe *cqe = &ring->cqes[head & ring->cq_mask];
        ple_read *rd = (ple_read *)(uintptr_t)cqe->user_data;
        rd->res = cqe->res;
        rd->ns = now - rd->start_ns;
        ring->in_flight--;
        done(ctx, rd);
    }
    /* Release: our reads of these CQEs are done before the kernel reuses them. */
    atomic_store_explicit(ring->cq_head, head, memory_order_release);
    return count;
}

int ple_ring_submit_and_reap(ple_ring *ring, unsigned wait,
                             void (*done)(void *, ple_read *), void *ctx,
                             unsigned *taken_back)
{
    int reaped = 0;
    for (;;) {
        /* Release: the SQEs and index slots written by prep (also those a
         * `done` callback queued) are visible to the kernel before the tail. */
        atomic_store_explicit(ring->sq_tail, ring->sq_local_tail, memory_order_release);
        unsigned to_submit = ring->sq_local_tail - ring->sq_submitted;
        if (wait > ring->in_flight + to_submit)  /* never wait for what cannot come */
            wait = ring->in_flight + to_submit;
        if (!to_submit && !wait)
            return reaped;
        long rc = syscall(__NR_io_uring_enter, ring->fd, to_submit, wait,
                          wait ? IORING_ENTER_GETEVENTS : 0, NULL, 0);
        if (rc >= 0) {
            ring->sq_submitted += (unsigned)rc;
            ring->in_flight += (unsigned)rc;
        } else if (errno == EINTR || errno == EAGAIN || errno == EBUSY) {
            /* Interrupted, or short of resources until completions are
             * reaped: reap, then try again. */
            if (errno != EINTR)
                sched_yield();
        } else {
            /* Submission refused: take back what the kernel did not consume
             * (acquire: it finished reading those SQEs before moving head). */
            int saved = errno;
            unsigned head = atomic_load_explicit(ring->sq_head, memory_order_acquire);
            if (taken_back)
                *taken_back = ring->sq_local_tail - head;
            ring->sq_local_tail = ring->sq_submitted = head;
            atomic_store_explicit(ring->sq_tail, head, memory_order_release);
            return -saved;
        }
        int got = reap(ring, done, ctx);
        reaped += got;
        wait = (unsigned)got >= wait ? 0 : wait - (unsigned)got;
    }
}
