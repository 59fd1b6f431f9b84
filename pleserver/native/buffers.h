/* The miss path's large buffers (a read round's blocks and bookkeeping): a
 * small process-wide pool of anonymous mappings, reused most recent first.
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
 *     PLE_BUFFER_BIG_BYTES of pages (a large round's): another one returns
 *     its pages when given back.
 * So a stream of requests keeps reusing warm buffers, and what stays after
 * a load is a few small buffers and one large one. */
#ifndef PLE_BUFFERS_H
#define PLE_BUFFERS_H

#include <stddef.h>

#define PLE_BUFFERS_KEPT 8u
#define PLE_BUFFERS_WARM 4u
#define PLE_BUFFERS_BIG_WARM 1u
#define PLE_BUFFER_BIG_BYTES (4u << 20)

/* A buffer of `size` bytes (page-aligned; zero where its pages were
 * returned), preferring one whose first `need` bytes are in memory already;
 * NULL when none can be mapped. */
void *ple_buffer_take(size_t size, size_t need);
/* Give back a buffer of `size` bytes whose first `touched` bytes may have
 * been written (a bound: the pool returns the pages of that range). */
void ple_buffer_give(void *mem, size_t size, size_t touched);

#endif
