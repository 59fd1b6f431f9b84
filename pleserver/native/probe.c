/* The disk probe (see probe.h). Offsets are uniform over the files' aligned
 * blocks (a file is picked in proportion to its blocks); the generator is
 * xorshift64*, seeded from the clock. io_uring keeps exactly queue_depth
 * reads in flight: every completion is replaced at once. The fallback runs
 * queue_depth threads, each with one pread at a time. */
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "probe.h"
#include "reads.h"
#include "ring.h"

typedef struct target {
    int *fds;
    uint64_t *cum_blocks;  /* blocks in files [0, i] */
    unsigned nfiles;
    uint32_t block;
    uint64_t deadline_ns;
} target;

static uint64_t next_random(uint64_t *state)
{
    uint64_t x = *state;
    x ^= x >> 12;
    x ^= x << 25;
    x ^= x >> 27;
    *state = x;
    return x * 0x2545F4914F6CDD1DULL;
}

static void random_read(const target *t, uint64_t *rng, ple_read *rd)
{
    uint64_t b = next_random(rng) % t->cum_blocks[t->nfiles - 1];
    unsigned f = 0;
    while (t->cum_blocks[f] <= b)
        f++;
    uint64_t first = f ? t->cum_blocks[f - 1] : 0;
    rd->fd = t->fds[f];
    rd->offset = (b - first) * t->block;
    rd->len = t->block;
}

typedef struct ring_run {
    const target *t;
    ple_ring *ring;
    uint64_t rng, reads;
    int failed;  /* errno of the first failed read: no more are started */
} ring_run;

static void on_complete(void *ctx, ple_read *rd)
{
    ring_run *run = ctx;
    if (rd->res != (int32_t)rd->len) {
        if (!run->failed)
            run->failed = rd->res < 0 ? -rd->res : EIO;
        return;
    }
    run->reads++;
    if (!run->failed && ple_now_ns() < run->t->deadline_ns) {  /* replace it at once */
        random_read(run->t, &run->rng, rd);
        ple_ring_prep_read(run->ring, rd);
    }
}

static int probe_ring(const target *t, ple_ring *ring, unsigned depth, unsigned char *bufs,
                      uint64_t *reads, ple_error *err)
{
    ple_read *rds = calloc(depth, sizeof *rds);
    if (!rds) {
        ple_error_set(err, PLE_ERR_NOMEM, ENOMEM, "out of memory");
        return -1;
    }
    ring_run run = {.t = t, .ring = ring, .rng = ple_now_ns() | 1};
    for (unsigned i = 0; i < depth; i++) {
        rds[i].buf = bufs + (size_t)i * t->block;
        random_read(t, &run.rng, &rds[i]);
        ple_ring_prep_read(ring, &rds[i]);
    }
    int submit_error = 0;
    do {
        int got = ple_ring_submit_and_reap(ring, 1, on_complete, &run, NULL);
        if (got < 0 && !submit_error) {
            submit_error = -got;
            run.failed = run.failed ? run.failed : -got;
        }
    } while (ple_ring_in_flight(ring));  /* the buffers are ours again only then */
    free(rds);
    *reads = run.reads;
    if (run.failed) {
        ple_error_set(err, PLE_ERR_OS, run.failed, "%s: %s",
                      submit_error ? "io_uring_enter" : "probe read", strerror(run.failed));
        return -1;
    }
    return 0;
}

typedef struct thread_run {
    const target *t;
    unsigned char *buf;
    uint64_t reads;
    int failed;
} thread_run;

static void *probe_thread(void *arg)
{
    thread_run *run = arg;
    uint64_t rng = ple_now_ns() ^ (uintptr_t)run;
    ple_read rd = {.buf = run->buf};
    rng |= 1;
    while (ple_now_ns() < run->t->deadline_ns) {
        random_read(run->t, &rng, &rd);
        ple_pread_full(&rd);
        if (rd.res != (int32_t)rd.len) {
            run->failed = rd.res < 0 ? -rd.res : EIO;
            break;
        }
        run->reads++;
    }
    return NULL;
}

static int probe_threads(const target *t, unsigned depth, unsigned char *bufs,
                         uint64_t *reads, ple_error *err)
{
    pthread_t *tids = calloc(depth, sizeof *tids);
    thread_run *runs = calloc(depth, sizeof *runs);
    unsigned started = 0;
    if (tids && runs) {
        for (; started < depth; started++) {
            runs[started] = (thread_run){.t = t, .buf = bufs + (size_t)started * t->block};
            if (pthread_create(&tids[started], NULL, probe_thread, &runs[started]) != 0)
                break;
        }
    }
    int failed = started < depth ? EAGAIN : 0;
    *reads = 0;
    for (unsigned i = 0; i < started; i++) {
        pthread_join(tids[i], NULL);
        *reads += runs[i].reads;
        if (!failed)
            failed = runs[i].failed;
    }
    free(tids);
    free(runs);
    if (failed) {
        ple_error_set(err, PLE_ERR_OS, failed, "probe with %u threads: %s", depth,
                      strerror(failed));
        return -1;
    }
    return 0;
}

int ple_probe_random_reads(const char *const *paths, unsigned npaths, uint32_t block,
                           unsigned queue_depth, double seconds, int direct, int kind,
                           ple_probe_result *res, ple_error *err)
{
    target t = {.nfiles = 0, .block = block};
    unsigned char *bufs = NULL;
    ple_ring *ring = NULL;
    int rc = -1;
    t.fds = calloc(npaths, sizeof *t.fds);
    t.cum_blocks = calloc(npaths, sizeof *t.cum_blocks);
    if (!t.fds || !t.cum_blocks
        || posix_memalign((void **)&bufs, PLE_BLOCK, (size_t)queue_depth * block) != 0) {
        ple_error_set(err, PLE_ERR_NOMEM, ENOMEM, "out of memory");
        goto out;
    }
    for (; t.nfiles < npaths; t.nfiles++) {
        const char *path = paths[t.nfiles];
        int fd = open(path, O_RDONLY | O_CLOEXEC | (direct ? O_DIRECT : 0));
        struct stat st;
        if (fd < 0 || fstat(fd, &st) != 0) {
            ple_error_set(err, PLE_ERR_OS, errno, "cannot open %s%s: %s", path,
                          direct ? " with O_DIRECT" : "", strerror(errno));
            if (fd >= 0)
                close(fd);
            goto out;
        }
        t.fds[t.nfiles] = fd;
        uint64_t prev = t.nfiles ? t.cum_blocks[t.nfiles - 1] : 0;
        t.cum_blocks[t.nfiles] = prev + (uint64_t)st.st_size / block;
    }
    if (t.cum_blocks[npaths - 1] == 0) {
        ple_error_set(err, PLE_ERR_VALUE, 0, "the files hold no whole %u-byte block", block);
        goto out;
    }
    res->kind = PLE_KIND_THREADS;
    if (kind != PLE_KIND_THREADS) {
        ring = ple_ring_open(queue_depth);
        if (!ring && kind == PLE_KIND_IO_URING) {
            ple_error_set(err, PLE_ERR_OS, errno, "io_uring_setup: %s", strerror(errno));
            goto out;
        }
    }
    uint64_t start = ple_now_ns();
    t.deadline_ns = start + (uint64_t)(seconds * 1e9);
    if (ring) {  /* the kernel may round the ring up: keep queue_depth in flight */
        res->kind = PLE_KIND_IO_URING;
        rc = probe_ring(&t, ring, queue_depth, bufs, &res->reads, err);
    } else {
        rc = probe_threads(&t, queue_depth, bufs, &res->reads, err);
    }
    res->seconds = (double)(ple_now_ns() - start) / 1e9;
out:
    if (ring)
        ple_ring_close(ring);
    for (unsigned i = 0; i < t.nfiles; i++)
        close(t.fds[i]);
    free(t.fds);
    free(t.cum_blocks);
    free(bufs);
    return rc;
}
