/* The miss engine (see reads.h): batches run on io_uring rings (ring.c),
 * or on a pool of pread threads where io_uring is missing or refused.
 *
 * Syscalls here: pread64 in the fallback; the rings' own are in ring.c. */
#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "pool.h"
#include "reads.h"

#define PLE_MAX_RINGS 32

void ple_pread_full(ple_read *rd)
{
    uint64_t start = ple_now_ns();
    uint32_t got = 0;
    while (got < rd->len) {
        ssize_t n = pread(rd->fd, (char *)rd->buf + got, rd->len - got,
                          (off_t)(rd->offset + got));
        if (n < 0 && errno == EINTR)
            continue;
        if (n < 0) {
            rd->res = -errno;
            rd->ns = ple_now_ns() - start;
            return;
        }
        if (n == 0)  /* end of file: short, the caller judges */
            break;
        got += (uint32_t)n;
    }
    rd->res = (int32_t)got;
    rd->ns = ple_now_ns() - start;
}

/* ------------------------------------------------------------------ engine */

struct ple_engine {
    _Atomic unsigned refs;
    int kind;
    unsigned queue_depth;
    ple_pool *pool;              /* threads kind */
    pthread_mutex_t lock;        /* io_uring kind: the ring pool */
    pthread_cond_t ring_freed;
    ple_ring *free_rings[PLE_MAX_RINGS];  /* a stack: the last one given back first */
    unsigned nfree;
    unsigned nrings;             /* made, free or in use */
};

ple_engine *ple_engine_open(unsigned queue_depth, int kind, unsigned threads,
                            char *reason, size_t reason_size, ple_error *err)
{
    ple_engine *eng = calloc(1, sizeof *eng);
    if (!eng) {
        ple_error_set(err, PLE_ERR_NOMEM, ENOMEM, "out of memory");
        return NULL;
    }
    atomic_init(&eng->refs, 1);
    eng->queue_depth = queue_depth;
    pthread_mutex_init(&eng->lock, NULL);
    pthread_cond_init(&eng->ring_freed, NULL);
    reason[0] = '\0';
    if (kind != PLE_KIND_THREADS) {
        /* The first ring proves io_uring works here; it is kept for use. */
        ple_ring *ring = ple_ring_open(queue_depth);
        if (ring) {
            eng->kind = PLE_KIND_IO_URING;
            eng->free_rings[0] = ring;
            eng->nfree = 1;
            eng->nrings = 1;
            return eng;
        }
        int code = errno;
        const char *why = code == ENOSYS ? " (kernel without io_uring, or seccomp)"
                        : code == EPERM ? " (seccomp profile or kernel.io_uring_disabled)"
                        : code == ENOMEM ? " (RLIMIT_MEMLOCK too low for the ring?)" : "";
        snprintf(reason, reason_size, "io_uring_setup: %s%s", strerror(code), why);
        if (kind == PLE_KIND_IO_URING) {
            ple_error_set(err, PLE_ERR_OS, code, "%s", reason);
            ple_engine_unref(eng);
            return NULL;
        }
    } else {
        snprintf(reason, reason_size, "kind=\"threads\" requested");
    }
    eng->kind = PLE_KIND_THREADS;
    eng->pool = ple_pool_open(threads);
    if (!eng->pool) {
        ple_error_set(err, PLE_ERR_OS, errno, "cannot start %u read threads: %s",
                      threads, strerror(errno));
        ple_engine_unref(eng);
        return NULL;
    }
    return eng;
}

int ple_engine_kind(const ple_engine *eng)
{
    return eng->kind;
}

/* A ring of our own for one batch: a free one, a new one, or wait. */
static ple_ring *acquire_ring(ple_engine *eng)
{
    pthread_mutex_lock(&eng->lock);
    for (;;) {
        if (eng->nfree) {
            ple_ring *ring = eng->free_rings[--eng->nfree];
            pthread_mutex_unlock(&eng->lock);
            return ring;
        }
        if (eng->nrings < PLE_MAX_RINGS) {
            eng->nrings++;
            pthread_mutex_unlock(&eng->lock);
            ple_ring *ring = ple_ring_open(eng->queue_depth);
            if (ring)
                return ring;
            pthread_mutex_lock(&eng->lock);
            eng->nrings--;  /* cannot make more: wait for one of the others */
            if (eng->nrings == 0) {
                pthread_mutex_unlock(&eng->lock);
                return NULL;
            }
        }
        pthread_cond_wait(&eng->ring_freed, &eng->lock);
    }
}

static void release_ring(ple_engine *eng, ple_ring *ring)
{
    pthread_mutex_lock(&eng->lock);
    eng->free_rings[eng->nfree++] = ring;  /* at most nrings ≤ PLE_MAX_RINGS */
    pthread_cond_signal(&eng->ring_freed);
    pthread_mutex_unlock(&eng->lock);
}

static void count_done(void *ctx, ple_read *rd)
{
    (void)rd;
    (*(size_t *)ctx)++;
}

static void fail_reads(ple_read *reads, size_t n, int code)
{
    for (size_t i = 0; i < n; i++) {
        reads[i].res = -code;
        reads[i].ns = 0;
    }
}

static void run_on_ring(ple_ring *ring, ple_read *reads, size_t n)
{
    size_t queued = 0, completed = 0;
    unsigned depth = ple_ring_entries(ring);
    while (completed < n) {
        /* Keep the queue full: refill up to the depth, then wait for one. */
        while (queued < n && queued - completed < depth)
            ple_ring_prep_read(ring, &reads[queued++]);
        unsigned taken_back = 0;
        int rc = ple_ring_submit_and_reap(ring, 1, count_done, &completed, &taken_back);
        if (rc < 0) {
            /* The kernel refused the submission: the SQEs it had not consumed
             * were taken back (the newest queued reads); they and the reads
             * not queued yet fail with that error. Reads already in flight
             * are still reaped by this loop before the buffers are handed
             * back to the caller. */
            fail_reads(reads + queued - taken_back, n - (queued - taken_back), -rc);
            completed += n - (queued - taken_back);
            queued = n;
        }
    }
}

static void pread_task(void *ctx, size_t index)
{
    ple_pread_full(&((ple_read *)ctx)[index]);
}

void ple_engine_run(ple_engine *eng, ple_read *reads, size_t n)
{
    if (n == 0)
        return;
    if (eng->kind == PLE_KIND_THREADS) {
        ple_pool_run(eng->pool, pread_task, reads, n);
        return;
    }
    ple_ring *ring = acquire_ring(eng);
    if (!ring) {  /* every ring failed since the first: pread in this thread */
        for (size_t i = 0; i < n; i++)
            ple_pread_full(&reads[i]);
        return;
    }
    run_on_ring(ring, reads, n);
    release_ring(eng, ring);
}

void ple_engine_ref(ple_engine *eng)
{
    /* Relaxed: taking a reference needs no ordering (the caller already
     * holds one, so the object cannot go away meanwhile). */
    atomic_fetch_add_explicit(&eng->refs, 1, memory_order_relaxed);
}

void ple_engine_unref(ple_engine *eng)
{
    /* Acq_rel: every user's last accesses happen before the free below. */
    if (atomic_fetch_sub_explicit(&eng->refs, 1, memory_order_acq_rel) != 1)
        return;
    while (eng->nfree)
        ple_ring_close(eng->free_rings[--eng->nfree]);
    if (eng->pool)
        ple_pool_close(eng->pool);
    pthread_cond_destroy(&eng->ring_freed);
    pthread_mutex_destroy(&eng->lock);
    free(eng);
}
