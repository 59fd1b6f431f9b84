/* The miss path's buffer pool (see buffers.h).
 *
 * One mutex guards the list of free buffers, a stack (the most recently
 * given on top). System calls (mmap, munmap, madvise) run outside it, on a
 * buffer that is out of the list meanwhile: no taker can be writing a
 * buffer whose pages are being returned. */
#include <pthread.h>
#include <sys/mman.h>

#include "buffers.h"

typedef struct free_buffer {
    void *mem;
    size_t size, touched;  /* touched: bytes from the start that may be in memory */
} free_buffer;

static pthread_mutex_t pool_lock = PTHREAD_MUTEX_INITIALIZER;
static free_buffer pool[PLE_BUFFERS_KEPT];  /* [0, pooled): bottom to top */
static unsigned pooled;

/* Under the lock: take entry k out of the list. */
static free_buffer remove_at(unsigned k)
{
    free_buffer b = pool[k];
    for (; k + 1 < pooled; k++)
        pool[k] = pool[k + 1];
    pooled--;
    return b;
}

/* Out of the list: return its pages, keep the mapping. */
static void empty(free_buffer *b)
{
    madvise(b->mem, b->touched, MADV_DONTNEED);
    b->touched = 0;
}

void *ple_buffer_take(size_t size, size_t need)
{
    pthread_mutex_lock(&pool_lock);
    int pick = -1;
    for (int k = (int)pooled - 1; k >= 0; k--) {
        if (pool[k].size != size)
            continue;
        if (pick < 0)
            pick = k;  /* the most recent, unless one is warm enough */
        if (pool[k].touched >= need) {
            pick = k;
            break;
        }
    }
    if (pick >= 0) {
        void *mem = remove_at((unsigned)pick).mem;
        pthread_mutex_unlock(&pool_lock);
        return mem;
    }
    pthread_mutex_unlock(&pool_lock);
    void *mem = mmap(NULL, size, PROT_READ | PROT_WRITE,
                     MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    return mem == MAP_FAILED ? NULL : mem;
}

/* Under the lock: list a buffer on top (warm) or at the bottom (empty);
 * 0 when the pool is full. */
static int list(free_buffer b, int on_top)
{
    if (pooled == PLE_BUFFERS_KEPT)
        return 0;
    unsigned at = on_top ? pooled : 0;
    for (unsigned k = pooled; k > at; k--)
        pool[k] = pool[k - 1];
    pool[at] = b;
    pooled++;
    return 1;
}

void ple_buffer_give(void *mem, size_t size, size_t touched)
{
    free_buffer b = {mem, size, touched < size ? touched : size}, cold = {0};
    pthread_mutex_lock(&pool_lock);
    if (pooled == PLE_BUFFERS_KEPT) {
        pthread_mutex_unlock(&pool_lock);
        munmap(mem, size);
        return;
    }
    unsigned big = 0;
    for (unsigned k = 0; k < pooled; k++)
        big += pool[k].touched > PLE_BUFFER_BIG_BYTES;
    /* The buffer this one pushes out of the warm ones, if it has pages. */
    if (pooled >= PLE_BUFFERS_WARM && pool[pooled - PLE_BUFFERS_WARM].touched)
        cold = remove_at(pooled - PLE_BUFFERS_WARM);
    pthread_mutex_unlock(&pool_lock);
    if (b.touched > PLE_BUFFER_BIG_BYTES && big >= PLE_BUFFERS_BIG_WARM)
        empty(&b);
    if (cold.mem)
        empty(&cold);
    pthread_mutex_lock(&pool_lock);
    int cold_listed = !cold.mem || list(cold, 0), listed = list(b, 1);
    pthread_mutex_unlock(&pool_lock);
    if (!cold_listed)  /* the pool filled up meanwhile */
        munmap(cold.mem, cold.size);
    if (!listed)
        munmap(mem, size);
}
