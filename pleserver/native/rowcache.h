/* The row cache: fixed-size slots in one anonymous region reserved up front,
 * an open-addressing hash index, SIEVE eviction, all split into shards with
 * a lock each so concurrent readers rarely meet.
 *
 * A key is (table_key << 40) | row. The budget covers the slots and the
 * index/eviction metadata together (PLE_CACHE_ROW_OVERHEAD bytes per row). */
#ifndef PLE_ROWCACHE_H
#define PLE_ROWCACHE_H

#include <stddef.h>
#include <stdint.h>

#include "common.h"

#define PLE_CACHE_ROW_OVERHEAD 40u

typedef struct ple_cache ple_cache;

typedef struct ple_cache_stats {
    uint64_t capacity_rows, used_rows, hits, misses, inserts, evictions;
    uint64_t reserved_bytes, populated_bytes;
    int hugetlb, thp, mlocked;
    unsigned shards;
} ple_cache_stats;

ple_cache *ple_cache_open(uint64_t budget_bytes, uint32_t slot_bytes, int hugepages,
                          int lock_memory, ple_error *err);
uint64_t ple_cache_capacity(const ple_cache *cache);
uint32_t ple_cache_slot_bytes(const ple_cache *cache);
const char *ple_cache_policy(void);
/* Copy the row of `key` (len <= slot_bytes) into dst: 1 on a hit, 0 on a miss. */
int ple_cache_get(ple_cache *cache, uint64_t key, void *dst, size_t len);
/* The same in steps, for lookups in batches: prepare hashes the key and
 * prefetches its index entry, prefetch_row prefetches its slot, so the memory
 * misses of a batch overlap; get_prepared then looks it up. */
typedef struct ple_cache_probe {
    uint64_t key, hash;
} ple_cache_probe;
void ple_cache_prepare(ple_cache *cache, uint64_t key, ple_cache_probe *probe);
/* After prepare: prefetch the row's slot, found by a lock-free look at the
 * index (a hint only; get_prepared looks again under the lock). */
void ple_cache_prefetch_row(ple_cache *cache, const ple_cache_probe *probe);
int ple_cache_get_prepared(ple_cache *cache, const ple_cache_probe *probe, void *dst,
                           size_t len);
/* After prepare: whether the row is cached, without reading it or counting a
 * use in the eviction policy (the hint counters ask; a lookup would get). */
int ple_cache_contains(ple_cache *cache, const ple_cache_probe *probe);
/* Store the row of `key`, evicting if the shard is full. Returns whether the
 * key was cached already (its slot is rewritten), new, or new in the slot of
 * an evicted row. */
enum { PLE_PUT_PRESENT, PLE_PUT_NEW, PLE_PUT_EVICTED };
int ple_cache_put(ple_cache *cache, uint64_t key, const void *src, size_t len);
/* Add a request's hit and miss counts (callers count locally, add once). */
void ple_cache_count(ple_cache *cache, uint64_t hits, uint64_t misses);
void ple_cache_get_stats(ple_cache *cache, ple_cache_stats *st);
/* The cached keys, in a malloc'd array (*keys, caller frees); -1 on ENOMEM. */
int64_t ple_cache_keys(ple_cache *cache, uint64_t **keys);
void ple_cache_ref(ple_cache *cache);
void ple_cache_unref(ple_cache *cache);

#endif
