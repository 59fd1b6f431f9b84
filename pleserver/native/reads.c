/* The miss engine (see reads.h): batches run on io_uring rings (ring.c),
 * or on a pool of pread threads where io_uring is missing or refused.
 *
 * The engine's reads in flight, all rings together, are bounded by its
 * queue_depth: each ring takes credits for the reads it submits and gives
 * them back as they complete. Without the bound every running batch kept
 * queue_depth reads in flight of its own (four gather workers on one large
 * request: 512 at the device), and a small request's reads queued behind
 * all of them. A batch of at most SMALL_BATCH reads (a decode step's
 * lookup, a bystander's) may also take credits of a reserve of SMALL_BATCH
 * (at most queue_depth) that larger batches never use: it never waits for a
 * large one's credits, and has all its reads in flight at once (a smaller
 * reserve would send them in waves behind a busy engine); at the device it
 * waits behind at most queue_depth reads and the other small batches'.
 * Large batches share queue_depth evenly: each keeps at most its share
 * (queue_depth over the large batches running) in flight, so one long round
 * cannot take every credit back as fast as it gives them up while another
 * batch waits.
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
#define SMALL_BATCH 64   /* reads: a batch this small may use the reserve */

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
    pthread_mutex_t lock;        /* io_uring kind: the ring pool and the credits */
    pthread_cond_t ring_freed;
    pthread_cond_t credits_freed;
    unsigned credits;            /* reads that may still be put in flight (of queue_depth) */
    unsigned reserve;            /* and of the reserve, for small batches only */
    unsigned reserve_size;
    unsigned in_flight;          /* reads in flight, every ring together */
    unsigned large_batches;      /* large batches running: they share queue_depth */
    unsigned peak_in_flight;     /* its highest since the engine opened */
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
    eng->credits = queue_depth;
    eng->reserve = queue_depth < SMALL_BATCH ? queue_depth : SMALL_BATCH;
    eng->reserve_size = eng->reserve;
    pthread_mutex_init(&eng->lock, NULL);
    pthread_cond_init(&eng->ring_freed, NULL);
    pthread_cond_init(&eng->credits_freed, NULL);
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

void ple_engine_in_flight(ple_engine *eng, unsigned *now, unsigned *peak, unsigned *reserve)
{
    pthread_mutex_lock(&eng->lock);
    *now = eng->in_flight;
    *peak = eng->peak_in_flight;
    *reserve = eng->kind == PLE_KIND_IO_URING ? eng->reserve_size : 0;
    pthread_mutex_unlock(&eng->lock);
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

/* What one batch holds of the engine's credits. */
typedef struct {
    unsigned common;
    unsigned reserve;
} held_credits;

/* Take up to `want` credits (≥ 1) for a batch; with `block`, wait until at
 * least one is free (the batch has nothing in flight to reap meanwhile).
 * A small batch takes the reserve's first. The number taken. */
static unsigned take_credits(ple_engine *eng, unsigned want, int small, int block,
                             held_credits *held)
{
    pthread_mutex_lock(&eng->lock);
    while (block && eng->credits == 0 && !(small && eng->reserve > 0))
        pthread_cond_wait(&eng->credits_freed, &eng->lock);
    if (!small) {  /* at most its share (≥ 1: a batch with none in flight progresses) */
        unsigned share = eng->queue_depth / (eng->large_batches ? eng->large_batches : 1);
        if (share < 1)
            share = 1;
        unsigned room = held->common < share ? share - held->common : 0;
        if (room == 0 && block)
            room = 1;
        if (want > room)
            want = room;
    }
    unsigned got = 0;
    if (small) {
        unsigned r = want < eng->reserve ? want : eng->reserve;
        eng->reserve -= r;
        held->reserve += r;
        got += r;
    }
    unsigned c = want - got < eng->credits ? want - got : eng->credits;
    eng->credits -= c;
    held->common += c;
    got += c;
    eng->in_flight += got;
    if (eng->in_flight > eng->peak_in_flight)
        eng->peak_in_flight = eng->in_flight;
    pthread_mutex_unlock(&eng->lock);
    return got;
}

/* Give back `n` credits of a batch's (reads completed, or never submitted):
 * the reserve's first, so that small batches find it free. */
static void give_credits(ple_engine *eng, unsigned n, held_credits *held)
{
    if (n == 0)
        return;
    pthread_mutex_lock(&eng->lock);
    unsigned r = n < held->reserve ? n : held->reserve;
    held->reserve -= r;
    eng->reserve += r;
    held->common -= n - r;
    eng->credits += n - r;
    eng->in_flight -= n;
    pthread_cond_broadcast(&eng->credits_freed);
    pthread_mutex_unlock(&eng->lock);
}

static void fail_reads(ple_read *reads, size_t n, int code)
{
    for (size_t i = 0; i < n; i++) {
        reads[i].res = -code;
        reads[i].ns = 0;
    }
}

/* A large batch begins or ends: the large batches' shares change. */
static void count_large(ple_engine *eng, int begins)
{
    pthread_mutex_lock(&eng->lock);
    if (begins)
        eng->large_batches++;
    else
        eng->large_batches--;
    pthread_mutex_unlock(&eng->lock);
}

static void run_on_ring(ple_engine *eng, ple_ring *ring, ple_read *reads, size_t n)
{
    size_t queued = 0, completed = 0;
    unsigned depth = ple_ring_entries(ring);
    int small = n <= SMALL_BATCH;
    held_credits held = {0, 0};
    if (!small)
        count_large(eng, 1);
    while (completed < n) {
        /* Keep the queue full, within the ring's depth and the engine's
         * credits (waited for only with nothing of ours to reap), then wait
         * for one completion. */
        size_t room = depth - (queued - completed);
        if (room > n - queued)
            room = n - queued;
        unsigned got = room ? take_credits(eng, (unsigned)room, small, queued == completed,
                                           &held) : 0;
        for (unsigned i = 0; i < got; i++)
            ple_ring_prep_read(ring, &reads[queued++]);
        unsigned taken_back = 0;
        size_t before = completed;
        int rc = ple_ring_submit_and_reap(ring, 1, count_done, &completed, &taken_back);
        /* The reads reaped, also by a call that then failed a submission. */
        give_credits(eng, (unsigned)(completed - before), &held);
        if (rc < 0) {
            /* The kernel refused the submission: the SQEs it had not consumed
             * were taken back (the newest queued reads); they and the reads
             * not queued yet fail with that error. Reads already in flight
             * are still reaped by this loop before the buffers are handed
             * back to the caller. */
            give_credits(eng, taken_back, &held);
            fail_reads(reads + queued - taken_back, n - (queued - taken_back), -rc);
            completed += n - (queued - taken_back);
            queued = n;
        }
    }
    if (!small)
        count_large(eng, 0);
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
    run_on_ring(eng, ring, reads, n);
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
    pthread_cond_destroy(&eng->credits_freed);
    pthread_mutex_destroy(&eng->lock);
    free(eng);
}
