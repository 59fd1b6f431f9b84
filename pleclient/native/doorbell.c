/* The doorbell scan (see doorbell.h).
 *
 * The serving loop reads a GPU-driven channel's doorbells only after the
 * channel's rung word said that one may have rung; then this one call reads
 * them all, instead of one Python call per slot. The slots are a page apart
 * or more, so each word is its own cache line: the loop is memory-bound, and
 * short. */
#include "doorbell.h"

#include <stdatomic.h>

uint64_t ple_doorbell_scan(char *first, size_t stride, unsigned count, uint32_t value)
{
    uint64_t rung = 0;
    for (unsigned i = 0; i < count && i < PLE_DOORBELL_SCAN_MAX; i++) {
        atomic_uint *word = (atomic_uint *)(void *)(first + (size_t)i * stride);
        /* D1: acquire, pairs with G1 (the stream's fence before its doorbell
         * write) or W1 (the CPU stand-in's release store): a doorbell seen
         * RUNG makes the ids, table and count written before it visible. */
        if (atomic_load_explicit(word, memory_order_acquire) == value)
            rung |= (uint64_t)1 << i;
    }
    return rung;
}
