/* A small persistent pthread pool that runs "fn(ctx, i) for i in [0, n)".
 *
 * Used for the pread fallback of the miss engine (one task per read) and for
 * splitting large gathers over threads (one task per chunk). The caller
 * takes tasks too, so a job never waits for a worker to wake up before it
 * starts, and a pool of 0 workers is plain sequential execution. */
#ifndef PLE_POOL_H
#define PLE_POOL_H

#include <stddef.h>

typedef void (*ple_task_fn)(void *ctx, size_t index);
typedef struct ple_pool ple_pool;

/* A pool with `workers` threads; NULL (errno set) when none could start. */
ple_pool *ple_pool_open(unsigned workers);
/* Start more workers, up to `workers` in all; returns the count running. */
unsigned ple_pool_grow(ple_pool *pool, unsigned workers);
/* Run the n tasks and return when all have finished. Thread-safe: workers
 * serve the jobs of concurrent callers in FIFO order, and each caller runs
 * its own job's tasks too, so a task may itself call ple_pool_run on the
 * same pool (nested jobs always finish, if need be on their callers alone). */
void ple_pool_run(ple_pool *pool, ple_task_fn fn, void *ctx, size_t n);
/* Stop and join the workers (no job may be running), free the pool. */
void ple_pool_close(ple_pool *pool);

#endif
