/* The miss engine: batches of positional reads, run by io_uring or, where
 * io_uring is missing or refused, by a pthread pool doing pread.
 *
 * A caller hands a whole batch to ple_engine_run and gets it back with every
 * read's result. Concurrent callers are independent: with io_uring each
 * running batch owns one ring (rings are pooled, created on demand), so a
 * completion is always reaped by the thread that waits for it; with the
 * fallback, the batches of all callers share the pool's FIFO. */
#ifndef PLE_READS_H
#define PLE_READS_H

#include <stdint.h>
#include <sys/uio.h>

#include "common.h"

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

enum ple_engine_kind { PLE_KIND_AUTO, PLE_KIND_IO_URING, PLE_KIND_THREADS };

typedef struct ple_engine ple_engine;

/* queue_depth: reads in flight per batch (io_uring) ; threads: pread workers
 * (fallback). kind AUTO falls back to threads when io_uring_setup fails and
 * writes why into `reason` (empty when io_uring is used). */
ple_engine *ple_engine_open(unsigned queue_depth, int kind, unsigned threads,
                            char *reason, size_t reason_size, ple_error *err);
int ple_engine_kind(const ple_engine *eng);
/* Run every read of the batch; each read's res/ns are set on return.
 * Thread-safe. Never fails as a whole: a failure is in the reads' res. */
void ple_engine_run(ple_engine *eng, ple_read *reads, size_t n);
void ple_engine_ref(ple_engine *eng);
void ple_engine_unref(ple_engine *eng);  /* frees at the last reference */

/* One io_uring, for the engine and the disk probe. */
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
 * completions, or -errno when submission failed (queued reads were then
 * taken back and are not in flight). */
int ple_ring_submit_and_reap(ple_ring *ring, unsigned wait,
                             void (*done)(void *ctx, ple_read *rd), void *ctx);

/* pread the whole length, retrying short reads and EINTR; sets res. */
void ple_pread_full(ple_read *rd);

#endif
