/* The miss engine: batches of positional reads, run by io_uring or, where
 * io_uring is missing or refused, by a pthread pool doing pread.
 *
 * A caller hands a whole batch of ple_read (ring.h) to ple_engine_run and
 * gets it back with every read's result. Concurrent callers are independent:
 * with io_uring each running batch owns one ring (ring.h; rings are pooled,
 * created on demand), so a completion is always reaped by the thread that
 * waits for it; with the fallback, the batches of all callers share the
 * pool's FIFO. */
#ifndef PLE_READS_H
#define PLE_READS_H

#include <stddef.h>

#include "common.h"
#include "ring.h"

enum ple_engine_kind { PLE_KIND_AUTO, PLE_KIND_IO_URING, PLE_KIND_THREADS };

typedef struct ple_engine ple_engine;

/* queue_depth: reads in flight at most, every batch together (io_uring; a
 * batch of at most 64 reads may also use a reserve of 64, at most
 * queue_depth); threads: pread workers (fallback). kind AUTO falls back to threads when io_uring_setup fails and
 * writes why into `reason` (empty when io_uring is used). */
ple_engine *ple_engine_open(unsigned queue_depth, int kind, unsigned threads,
                            char *reason, size_t reason_size, ple_error *err);
int ple_engine_kind(const ple_engine *eng);
/* io_uring: the reads in flight now, every batch together, their highest
 * since the engine opened, and the small batches' reserve (0 with threads). */
void ple_engine_in_flight(ple_engine *eng, unsigned *now, unsigned *peak, unsigned *reserve);
/* Run every read of the batch; each read's res/ns are set on return.
 * Thread-safe. Never fails as a whole: a failure is in the reads' res. */
void ple_engine_run(ple_engine *eng, ple_read *reads, size_t n);
void ple_engine_ref(ple_engine *eng);
void ple_engine_unref(ple_engine *eng);  /* frees at the last reference */

/* pread the whole length, retrying short reads and EINTR; sets res. */
void ple_pread_full(ple_read *rd);

#endif
