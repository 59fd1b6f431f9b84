/* The miss path's large buffers (a read round's blocks and bookkeeping): a
 * small process-wide pool of anonymous mappings, reused most recent first,
 * and a bound on the bytes they may hold in memory.
 *
 * Not malloc: glibc's allocator, once a large block was freed, raises its
 * mmap threshold and keeps later large blocks in its per-thread arenas, so
 * after a load of misses the daemon held 100-200 MiB of freed read buffers
 * for good. Here every buffer is a mapping of its own, and what the pool
 * keeps of them is bounded:
 *   - at most PLE_BUFFERS_KEPT free buffers stay mapped (one given back
 *     beyond that is unmapped);
 *   - only the PLE_BUFFERS_WARM most recently given keep their pages; a
 *     buffer pushed further down returns its pages to the kernel
 *     (MADV_DONTNEED) and stays mapped, empty;
 *   - of those, at most PLE_BUFFERS_BIG_WARM with more than
 *     PLE_BUFFER_BIG_BYTES of pages (a large round's): when another is
 *     given back, the one given back longest ago returns its pages. Two: a
 *     request of more misses than a round holds reads two rounds at once
 *     (gather.c, ROUNDS_AT_ONCE), each in a large buffer; with one kept
 *     warm, the other's pages were faulted in again by every such request,
 *     about one zeroed page per missed row.
 * So a stream of requests keeps reusing warm buffers, and what stays after
 * a load is a few small buffers and two large ones.
 *
 * The bound (ple_buffers_set_limit): every buffer, taken or free, carries a
 * *charge*, the bytes from its start that may be in memory (what its taker
 * may write, or what it kept of its pages). The charges together never pass
 * the limit: a take that would pass it first returns the pages of free
 * buffers, then waits until buffers are given back. Under a memory limit
 * (a cgroup's) the read buffers are then one known number, whatever the
 * number of requests and threads that read, instead of what those happen to
 * hold at once (up to ≈ 17 MiB each). A taker waits only while it holds no
 * buffer, and every holder finishes its round without taking another, so a
 * wait always ends. */
#ifndef PLE_BUFFERS_H
#define PLE_BUFFERS_H

#include <stddef.h>
#include <stdint.h>

#define PLE_BUFFERS_KEPT 8u
#define PLE_BUFFERS_WARM 4u
#define PLE_BUFFERS_BIG_WARM 2u
#define PLE_BUFFER_BIG_BYTES (4u << 20)

typedef struct ple_buffers_stats {
    size_t limit;      /* 0: no bound */
    size_t charged;    /* the charges now, buffers taken and free */
    size_t peak;       /* the highest `charged` since the bound was set */
    uint64_t waits;    /* takes that had to wait for a buffer given back */
    uint64_t returned; /* charges of buffers given back to the kernel since the start:
                          at most what later rounds fault in again */
} ple_buffers_stats;

/* The bound on the charges, in bytes (0: none). Free buffers return their
 * pages until the charges fit it; buffers taken count until given back
 * (takers wait meanwhile). The peak counts again from the charges then. */
void ple_buffers_set_limit(size_t bytes);
void ple_buffers_get_stats(ple_buffers_stats *st);

/* A buffer of `size` bytes (page-aligned; zero where its pages were
 * returned) whose first `need` bytes its taker may write, preferring one
 * whose first `need` bytes are in memory already; NULL when none can be
 * mapped. Waits while `need` more bytes would pass the bound. *charge is
 * set to the buffer's charge (at least `need`): give it back with it. */
void *ple_buffer_take(size_t size, size_t need, size_t *charge);
/* Give back a buffer of `size` bytes taken with *charge == charge. */
void ple_buffer_give(void *mem, size_t size, size_t charge);

#endif
