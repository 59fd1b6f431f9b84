/* Row lookup for one table: cache hits, misses read by the miss engine (or
 * copied from the file mappings), large requests split over native threads.
 *
 * A table is `nshards` shards of `shard_size` rows (the last may be short):
 * id → shard = id / shard_size, row = id % shard_size, file offset =
 * shard.file_offset + row * row_bytes.
 *
 * A row may be made of segments (1..PLE_SEGMENTS_MAX): runs of bytes stored
 * in tensors of their own, each split into the same shards. Segment g of
 * shard s is at file offset shard_spec[s * nsegs + g].file_offset + row *
 * seg_bytes[g] and lands in the served row after the segments before it. */
#ifndef PLE_GATHER_H
#define PLE_GATHER_H

#include <stddef.h>
#include <stdint.h>

#include "common.h"
#include "latency.h"
#include "reads.h"
#include "rowcache.h"

#define PLE_TABLE_KEY_MAX ((1u << 24) - 1)
#define PLE_ROW_BYTES_MAX (1u << 20)
#define PLE_SEGMENTS_MAX 4u

typedef struct ple_shard_spec {
    int fd;                     /* -1 when the table has no engine */
    uint64_t file_offset;       /* of the shard's row 0 */
    uint64_t rows;
    const char *path;           /* for error messages */
    const unsigned char *map;   /* the file's mapping (file offset 0), or NULL */
} ple_shard_spec;

typedef struct ple_source_stats {
    uint64_t hits, misses, reads, read_bytes, read_errors, evictions;
    uint64_t read_ns_p50, read_ns_p99;
    uint64_t read_ns_sum;                           /* of every timed read */
    uint64_t read_ns_hist[PLE_READ_HIST_BUCKETS];   /* counts, not cumulative */
    uint64_t resident_bytes;                        /* rows of its resident segments */
} ple_source_stats;

typedef struct ple_source ple_source;

/* Checks the layout (sizes, overflow, files long enough) and takes its own
 * duplicates of the fds and references to the cache and engine. `shards`
 * has one entry per segment of every shard, shard-major (nshards entries in
 * all); seg_bytes NULL means one segment of row_bytes. */
ple_source *ple_source_open(uint32_t table_key, uint32_t row_bytes, uint64_t shard_size,
                            const ple_shard_spec *shards, unsigned nshards,
                            const uint32_t *seg_bytes, unsigned nsegs,
                            ple_cache *cache, ple_engine *engine, int direct,
                            ple_error *err);
/* Serve segment `seg` of every shard from memory: read once here into
 * mappings the source owns (freed with it), so that a missed row costs the
 * reads of its other segments only. A table with a read engine only, and at
 * least one segment left on disk. Only before the source is shared with
 * another thread (it writes what gathers read without a lock): the binding
 * calls it from its constructor. 0, or -1 with err set (nothing kept). */
int ple_source_keep_resident(ple_source *src, unsigned seg, ple_error *err);
uint64_t ple_source_rows(const ple_source *src);
/* Rows of ids into out ([n, row_bytes]); 0, or -1 with err set. Every id is
 * checked against the table here, where it is used. */
int ple_source_gather(ple_source *src, const int64_t *ids, size_t n, unsigned char *out,
                      unsigned threads, ple_error *err);
/* Cache hits only: the number of ids not served, or -1 with err set. */
int64_t ple_source_gather_hits(ple_source *src, const int64_t *ids, size_t n,
                               unsigned char *out, ple_error *err);
/* Which rows of ids are cached: cached[i] = 1 or 0, no I/O, no counters, no
 * use in the eviction policy; the number cached, or -1 with err set. */
int64_t ple_source_cached(ple_source *src, const int64_t *ids, size_t n,
                          unsigned char *cached, ple_error *err);
/* Read the rows of ids into the cache: rows inserted, or -1 with err set. */
int64_t ple_source_fill(ple_source *src, const int64_t *ids, size_t n, ple_error *err);
void ple_source_get_stats(ple_source *src, ple_source_stats *st);
/* Heap a thread holds at most while it gathers from this table (ids are
 * gathered a piece at a time, so this does not grow with the request), and
 * what fill adds to it. */
size_t ple_source_scratch_bytes(const ple_source *src);
size_t ple_source_fill_scratch_bytes(const ple_source *src);
void ple_source_ref(ple_source *src);
void ple_source_unref(ple_source *src);

/* The read buffers of every table (buffers.h): one round's buffer at its
 * largest, and the smallest bound that still leaves a round for any row. */
size_t ple_read_round_bytes(void);
size_t ple_read_memory_min(void);
/* Bound the bytes the read buffers may hold in memory, all tables and
 * threads together (0: no bound); rounds shrink to fit a bound below one
 * round's buffer. 0, or -1 with err set for a bound below the minimum. */
int ple_set_read_memory(size_t bytes, ple_error *err);

typedef struct ple_read_memory {
    size_t limit, charged, peak;  /* bytes; limit 0: no bound */
    uint64_t waits;               /* rounds that waited for a buffer given back */
    uint64_t returned;            /* bytes of buffer pages given back to the kernel */
    size_t round_blocks;          /* blocks a round may read at most */
} ple_read_memory;
void ple_get_read_memory(ple_read_memory *st);

#endif
