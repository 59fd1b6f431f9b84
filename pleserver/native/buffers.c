/* The miss path's buffer pool (see buffers.h).
 *
 * One mutex guards the list of free buffers, a stack (the most recently
 * given on top), and the charges. System calls (mmap, munmap, madvise) run
 * outside it, on a buffer that is out of the list meanwhile: no taker can be
 * writing a buffer whose pages are being returned. A charge goes down only
 * once its pages are gone (after the madvise or munmap), so the charges are
 * never below what is in memory; one goes up before the taker writes. */
#include <pthread.h>
#include <sys/mman.h>

#include "buffers.h"

typedef struct free_buffer {
    void *mem;
    size_t size, touched;  /* touched: its charge, bytes from the start that may be in memory */
} free_buffer;

static pthread_mutex_t pool_lock = PTHREAD_MUTEX_INITIALIZER;
/* Broadcast when charges went down or a buffer was listed: a waiting taker
 * looks again. */
static pthread_cond_t pool_changed = PTHREAD_COND_INITIALIZER;
static free_buffer pool[PLE_BUFFERS_KEPT];  /* [0, pooled): bottom to top */
static unsigned pooled;
static size_t limit, charged, peak;         /* limit 0: no bound */
static uint64_t waits;
static uint64_t returned_total;             /* charges of buffers given back to the kernel */

/* Under the lock: take entry k out of the list. */
static free_buffer remove_at(unsigned k)
{
    free_buffer b = pool[k];
    for (; k + 1 < pooled; k++)
        pool[k] = pool[k + 1];
    pooled--;
    return b;
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

/* Under the lock. */
static void charge_add(size_t n)
{
    charged += n;
    if (charged > peak)
        peak = charged;
}

static void charge_sub(size_t n)
{
    charged -= n;
    pthread_cond_broadcast(&pool_changed);
}

/* Under the lock: a buffer charged `n` bytes went back to the kernel
 * (emptied or unmapped): its charge goes, and the bytes returned (pages a
 * later round must fault in again, at most `n` of them) grow. */
static void charge_returned(size_t n)
{
    returned_total += n;
    charge_sub(n);
}

/* Out of the list: return its pages, keep the mapping. */
static void empty(free_buffer *b)
{
    madvise(b->mem, b->touched, MADV_DONTNEED);
    b->touched = 0;
}

void ple_buffers_set_limit(size_t bytes)
{
    pthread_mutex_lock(&pool_lock);
    limit = bytes;
    /* Free buffers' pages past the new bound go now (buffers taken are
     * their holders' until given back), so the peak counts from here. */
    for (;;) {
        int victim = -1;
        for (unsigned k = 0; k < pooled && victim < 0; k++)
            if (pool[k].touched)
                victim = (int)k;
        if (!limit || charged <= limit || victim < 0)
            break;
        free_buffer v = remove_at((unsigned)victim);
        pthread_mutex_unlock(&pool_lock);
        size_t returned = v.touched;
        empty(&v);
        pthread_mutex_lock(&pool_lock);
        charge_returned(returned);
        if (!list(v, 0)) {
            pthread_mutex_unlock(&pool_lock);
            munmap(v.mem, v.size);
            pthread_mutex_lock(&pool_lock);
        }
    }
    peak = charged;
    pthread_cond_broadcast(&pool_changed);
    pthread_mutex_unlock(&pool_lock);
}

void ple_buffers_get_stats(ple_buffers_stats *st)
{
    pthread_mutex_lock(&pool_lock);
    *st = (ple_buffers_stats){.limit = limit, .charged = charged, .peak = peak, .waits = waits,
                              .returned = returned_total};
    pthread_mutex_unlock(&pool_lock);
}

void *ple_buffer_take(size_t size, size_t need, size_t *charge)
{
    if (need > size)
        need = size;
    int waited = 0;
    pthread_mutex_lock(&pool_lock);
    for (;;) {
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
        size_t have = pick >= 0 ? pool[pick].touched : 0;
        size_t extra = need > have ? need - have : 0;
        /* Nothing charged at all: even a need above the bound goes ahead,
         * since no one could give anything back to wait for. */
        if (!limit || charged + extra <= limit || charged == 0) {
            charge_add(extra);
            free_buffer b = pick >= 0 ? remove_at((unsigned)pick) : (free_buffer){0};
            pthread_mutex_unlock(&pool_lock);
            *charge = have > need ? have : need;
            if (b.mem)
                return b.mem;
            void *mem = mmap(NULL, size, PROT_READ | PROT_WRITE,
                             MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
            if (mem != MAP_FAILED)
                return mem;
            pthread_mutex_lock(&pool_lock);
            charge_sub(extra);
            pthread_mutex_unlock(&pool_lock);
            return NULL;
        }
        /* Over the bound: first the pages of a free buffer (the one given
         * back longest ago that has any, not the one picked). */
        int victim = -1;
        for (unsigned k = 0; k < pooled && victim < 0; k++)
            if ((int)k != pick && pool[k].touched)
                victim = (int)k;
        if (victim >= 0) {
            free_buffer v = remove_at((unsigned)victim);
            pthread_mutex_unlock(&pool_lock);
            size_t returned = v.touched;
            empty(&v);
            pthread_mutex_lock(&pool_lock);
            charge_returned(returned);
            if (!list(v, 0)) {  /* the pool filled up meanwhile */
                pthread_mutex_unlock(&pool_lock);
                munmap(v.mem, v.size);
                pthread_mutex_lock(&pool_lock);
            }
            continue;
        }
        /* Then for buffers given back: every holder finishes its round
         * without taking another. */
        if (!waited) {
            waits++;
            waited = 1;
        }
        pthread_cond_wait(&pool_changed, &pool_lock);
    }
}

void ple_buffer_give(void *mem, size_t size, size_t charge)
{
    free_buffer b = {mem, size, charge < size ? charge : size}, cold = {0}, old_big = {0};
    pthread_mutex_lock(&pool_lock);
    if (pooled == PLE_BUFFERS_KEPT) {
        pthread_mutex_unlock(&pool_lock);
        munmap(mem, size);
        pthread_mutex_lock(&pool_lock);
        charge_returned(b.touched);
        pthread_mutex_unlock(&pool_lock);
        return;
    }
    /* A large buffer given back stays warm: past PLE_BUFFERS_BIG_WARM large
     * ones, the one given back longest ago returns its pages. (Emptying the
     * one given back instead kept a stale large buffer warm for good while
     * the buffers in use faulted their pages in anew at every request.) */
    if (b.touched > PLE_BUFFER_BIG_BYTES) {
        unsigned big = 0, oldest = 0;
        for (unsigned k = pooled; k-- > 0;)
            if (pool[k].touched > PLE_BUFFER_BIG_BYTES) {
                oldest = k;
                big++;
            }
        if (big >= PLE_BUFFERS_BIG_WARM)
            old_big = remove_at(oldest);
    }
    /* The buffer this one pushes out of the warm ones, if it has pages. */
    if (pooled >= PLE_BUFFERS_WARM && pool[pooled - PLE_BUFFERS_WARM].touched)
        cold = remove_at(pooled - PLE_BUFFERS_WARM);
    pthread_mutex_unlock(&pool_lock);
    size_t returned = 0;
    if (old_big.mem) {
        returned += old_big.touched;
        empty(&old_big);
    }
    if (cold.mem) {
        returned += cold.touched;
        empty(&cold);
    }
    pthread_mutex_lock(&pool_lock);
    charge_returned(returned);  /* (and a waiting taker may reuse this buffer's pages) */
    /* The warm one first: if other gives filled the pool meanwhile, an
     * emptied one (at the bottom, nothing charged) is unmapped instead. */
    int listed = list(b, 1);
    int old_listed = !old_big.mem || list(old_big, 0);
    int cold_listed = !cold.mem || list(cold, 0);
    pthread_mutex_unlock(&pool_lock);
    if (!old_listed)
        munmap(old_big.mem, old_big.size);
    if (!cold_listed)
        munmap(cold.mem, cold.size);
    if (!listed) {
        munmap(mem, size);
        pthread_mutex_lock(&pool_lock);
        charge_returned(b.touched);
        pthread_mutex_unlock(&pool_lock);
    }
}
