/* The task pool (see pool.h).
 *
 * One mutex guards the FIFO of jobs and each job's counters; workers sleep
 * on `work`, callers on `done`. A job lives on its caller's stack: the caller
 * returns only after `finished == n` was seen under the mutex, and no worker
 * touches a job after its last `finished++` (done under the same mutex). */
#include <errno.h>
#include <pthread.h>
#include <stdlib.h>

#include "pool.h"

#define PLE_POOL_MAX_WORKERS 256

typedef struct ple_job {
    ple_task_fn fn;
    void *ctx;
    size_t n, next, finished;
    struct ple_job *link;
} ple_job;

struct ple_pool {
    pthread_mutex_t lock;
    pthread_cond_t work, done;
    ple_job *head, *tail;
    int stopping;
    unsigned nthreads;
    pthread_t threads[PLE_POOL_MAX_WORKERS];
};

/* Under the lock: take the next task of `job` (which has one left); a job
 * whose every task is handed out leaves the queue, wherever it stands. */
static void take_from(ple_pool *pool, ple_job *job, size_t *index)
{
    *index = job->next++;
    if (job->next < job->n)
        return;
    ple_job *prev = NULL;
    for (ple_job *j = pool->head; j; prev = j, j = j->link) {
        if (j != job)
            continue;
        if (prev)
            prev->link = job->link;
        else
            pool->head = job->link;
        if (pool->tail == job)
            pool->tail = prev;
        return;
    }
}

/* Under the lock: the next task of the oldest job, or NULL. */
static ple_job *take_task(ple_pool *pool, size_t *index)
{
    ple_job *job = pool->head;
    if (job)
        take_from(pool, job, index);
    return job;
}

static void finish_task(ple_pool *pool, ple_job *job)
{
    if (++job->finished == job->n)
        pthread_cond_broadcast(&pool->done);
}

static void *worker(void *arg)
{
    ple_pool *pool = arg;
    pthread_mutex_lock(&pool->lock);
    for (;;) {
        size_t index;
        ple_job *job = take_task(pool, &index);
        if (!job) {
            if (pool->stopping)
                break;
            pthread_cond_wait(&pool->work, &pool->lock);
            continue;
        }
        pthread_mutex_unlock(&pool->lock);
        job->fn(job->ctx, index);
        pthread_mutex_lock(&pool->lock);
        finish_task(pool, job);
    }
    pthread_mutex_unlock(&pool->lock);
    return NULL;
}

ple_pool *ple_pool_open(unsigned workers)
{
    ple_pool *pool = calloc(1, sizeof *pool);
    if (!pool)
        return NULL;
    pthread_mutex_init(&pool->lock, NULL);
    pthread_cond_init(&pool->work, NULL);
    pthread_cond_init(&pool->done, NULL);
    if (workers && ple_pool_grow(pool, workers) == 0) {
        ple_pool_close(pool);
        errno = EAGAIN;
        return NULL;
    }
    return pool;
}

unsigned ple_pool_grow(ple_pool *pool, unsigned workers)
{
    if (workers > PLE_POOL_MAX_WORKERS)
        workers = PLE_POOL_MAX_WORKERS;
    pthread_mutex_lock(&pool->lock);
    while (pool->nthreads < workers) {
        /* Workers only copy rows or wait in pread: a small stack is plenty. */
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setstacksize(&attr, 256 << 10);
        int rc = pthread_create(&pool->threads[pool->nthreads], &attr, worker, pool);
        pthread_attr_destroy(&attr);
        if (rc != 0)
            break;
        pool->nthreads++;
    }
    unsigned running = pool->nthreads;
    pthread_mutex_unlock(&pool->lock);
    return running;
}

void ple_pool_run(ple_pool *pool, ple_task_fn fn, void *ctx, size_t n)
{
    if (n == 0)
        return;
    ple_job job = {.fn = fn, .ctx = ctx, .n = n};
    pthread_mutex_lock(&pool->lock);
    if (pool->tail)
        pool->tail->link = &job;
    else
        pool->head = &job;
    pool->tail = &job;
    if (n > 1)
        pthread_cond_broadcast(&pool->work);
    /* Run our own job's tasks while it has any left, wherever it stands in
     * the queue (not others': a caller's latency should not depend on other
     * callers' jobs). Never wait for our job to reach the head: a caller may
     * itself be a worker running a task of an earlier job (a split gather
     * whose ranges read their misses through this pool), and the earlier
     * job cannot finish before ours does. */
    while (job.next < job.n) {
        size_t index;
        take_from(pool, &job, &index);
        pthread_mutex_unlock(&pool->lock);
        fn(ctx, index);
        pthread_mutex_lock(&pool->lock);
        finish_task(pool, &job);
    }
    while (job.finished < job.n)
        pthread_cond_wait(&pool->done, &pool->lock);
    pthread_mutex_unlock(&pool->lock);
}

void ple_pool_close(ple_pool *pool)
{
    pthread_mutex_lock(&pool->lock);
    pool->stopping = 1;
    pthread_cond_broadcast(&pool->work);
    pthread_mutex_unlock(&pool->lock);
    for (unsigned i = 0; i < pool->nthreads; i++)
        pthread_join(pool->threads[i], NULL);
    pthread_cond_destroy(&pool->work);
    pthread_cond_destroy(&pool->done);
    pthread_mutex_destroy(&pool->lock);
    free(pool);
}
