/* Row lookup for one table (see gather.h).
 *
 * gather, per range of ids (one range per native thread):
 *   1. each id is checked and located; a cache hit is copied into `out`;
 *      without an engine a miss is copied from the file mapping, under the
 *      guard of mapped.h (an unreadable page fails the request, not us);
 *   2. the misses are sorted by (file, offset) and read in rounds of up to
 *      ROUND_BLOCKS distinct 4 KiB blocks (fewer when the read buffers'
 *      bound, ple_set_read_memory, is smaller; a row straddling two blocks
 *      needs both). Each block is registered in the table's in-flight set:
 *      a block another request is reading already is waited for and copied
 *      from that request's buffer, never read twice; adjacent blocks of our
 *      own are read with one request (up to COALESCE_BLOCKS);
 *   3. every row is checked against the bytes its read returned (an error
 *      or a short read fails the request with file, offset and errno), then
 *      copied into `out` and into the cache.
 *
 * A range is gathered PIECE_ROWS ids at a time: what a thread allocates
 * for its misses (their list, the rounds' bounds, NVFP4's private rows)
 * then has a bound that does not grow with the request
 * (ple_source_scratch_bytes), and the read buffers have theirs (buffers.h),
 * so the memory a request can cause is known before it comes.
 *
 * The cache is filled only from memory no client can write: the read
 * buffers, a mapping of the file, or a scratch row of the server's own.
 * `out` is often a client's slot, which that client may rewrite at any
 * moment, so nothing is ever read back from it: a row read back from `out`
 * into the cache would be served to every client, with whatever the one
 * client wrote there in between. Every path that puts a row into the cache
 * (gather, split gathers, fill, and whatever reads rows ahead of requests)
 * keeps to this.
 *
 * In-flight set: buckets of entries, each entry owned by the request that
 * reads the block and living in that request's memory. One mutex guards
 * the buckets and every entry's fields; one condition variable is broadcast
 * when an entry is done or loses its last waiter. The block bytes are
 * written before the owner marks the entry done under the mutex, and read
 * by waiters after they saw it done under the mutex: the mutex orders them.
 * A request (a) registers, (b) reads its own blocks, (c) publishes them,
 * (d) waits for other requests' blocks, copies, drops its references, and
 * (e) waits until nobody copies from its blocks before freeing them. Step
 * (d) waits only on steps (c) of others, which wait on nothing: no cycle.
 *
 * Segments: a served row may be the concatenation of several tensors' rows
 * (NVFP4: packed values, then block scales), each with its own shards in
 * possibly other files. Every segment of a missed row is a miss of its own
 * (offset, bytes, and where in the output row it goes). Its segments are
 * put together in a private row (`composed`) and the whole row goes to
 * `out` and into the cache once all of them arrived, so the cache holds
 * whole composed rows and a hit is one copy. */
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "buffers.h"
#include "gather.h"
#include "mapped.h"
#include "pool.h"

#define ROUND_BLOCKS 4096u        /* distinct blocks per round: 16 MiB of buffer */
#define ROUND_BLOCKS_MIN 512u     /* the fewest a bound on the read buffers may leave */
#define PIECE_ROWS 16384u         /* ids one thread gathers at a time */
#define ROUNDS_AT_ONCE 2u         /* rounds of one request in flight together */
#define COALESCE_BLOCKS 32u       /* adjacent blocks read as one request: 128 KiB */
#define INFLIGHT_BUCKETS 1024u
#define SPLIT_MIN_ROWS 1024u      /* the fewest rows worth a thread of their own */
#define FILL_CHUNK_ROWS 4096u
#define HIST_BUCKETS PLE_READ_HIST_BUCKETS  /* latency.h */
#define BLOCK_BITS 40             /* key of a block: fd << 40 | block number */
#define FD_MAX ((1 << 23) - 1)
#define OFFSET_MAX (1ULL << 52)   /* block numbers < 2^40 */
#define RESIDENT_CHUNK (8u << 20) /* bytes a read of a resident segment asks at most */

typedef struct inflight {
    uint64_t key;               /* fd << 40 | block number */
    struct inflight *next;      /* bucket chain */
    const unsigned char *data;  /* the block: read by waiters once done */
    int32_t valid;              /* bytes of data read, or -errno */
    int done;
    unsigned refs;              /* requests still copying from data */
} inflight;

typedef struct src_shard {
    int fd;
    uint64_t file_offset, rows;
    char *path;
    const unsigned char *map;
    /* A resident segment (ple_source_keep_resident): its rows in memory of
     * the source's own, row 0 at `resident`, in a mapping of `resident_len`
     * bytes at `resident_map`; NULL when its rows are read from the file. */
    const unsigned char *resident;
    void *resident_map;
    size_t resident_len;
} src_shard;

struct ple_source {
    _Atomic unsigned refs;
    uint32_t table_key, row_bytes;
    uint64_t shard_size, rows;
    unsigned nshards;                    /* of the table */
    unsigned nsegs;                      /* segments per row, 1..PLE_SEGMENTS_MAX */
    uint32_t seg_bytes[PLE_SEGMENTS_MAX];
    uint32_t seg_off[PLE_SEGMENTS_MAX];  /* of each segment in the served row */
    src_shard *shards;                   /* [nshards * nsegs]: shard s, segment g at s*nsegs+g */
    unsigned resident_segs;              /* bit g: segment g is served from memory */
    unsigned lead_seg;                   /* the first segment read from the file */
    uint64_t resident_bytes;             /* the resident segments' rows */
    ple_cache *cache;
    ple_engine *engine;
    pthread_mutex_t inflight_lock;
    pthread_cond_t inflight_changed;
    inflight *buckets[INFLIGHT_BUCKETS];
    /* Statistics: relaxed counters (see common.h). */
    _Atomic uint64_t hits, misses, reads, read_bytes, read_errors, evictions;
    _Atomic uint64_t read_ns[HIST_BUCKETS], read_ns_sum;
};

/* What one range of a request counted; added to the shared counters once. */
typedef struct tally {
    uint64_t hits, misses, inserted, evictions, read_errors;
} tally;

enum { COUNT_LOOKUPS = 1 };  /* gather counts hits and misses; fill does not */

typedef struct miss {
    uint64_t sort_key;  /* fd << 40 | first block */
    uint64_t offset;    /* of the row in its file */
    uint32_t pos;       /* in the request */
    uint32_t shard;     /* index into src->shards: table shard * nsegs + segment */
    uint32_t block;     /* index of its first block in the round */
    uint32_t row;       /* rows of several segments: its row in `composed` */
} miss;

/* ------------------------------------------------------------- helpers */

static int locate(const ple_source *src, int64_t id, uint32_t *shard, uint64_t *row,
                  ple_error *err)
{
    if (id >= 0 && (uint64_t)id < src->rows) {
        uint64_t s = (uint64_t)id / src->shard_size;
        uint64_t r = (uint64_t)id - s * src->shard_size;
        if (s < src->nshards && r < src->shards[s * src->nsegs].rows) {
            *shard = (uint32_t)s;
            *row = r;
            return 0;
        }
    }
    ple_error_set(err, PLE_ERR_VALUE, 0, "row id %lld is not in the table (rows 0..%llu)",
                  (long long)id, (unsigned long long)src->rows - 1);
    return -1;
}


static int cmp_miss(const void *a, const void *b)
{
    const miss *x = a, *y = b;
    if (x->sort_key != y->sort_key)
        return x->sort_key < y->sort_key ? -1 : 1;
    return x->offset < y->offset ? -1 : x->offset > y->offset;
}

static void store_row(ple_source *src, uint64_t row_key, const unsigned char *row,
                      tally *t)
{
    switch (ple_cache_put(src->cache, row_key, row, src->row_bytes)) {
    case PLE_PUT_EVICTED:
        t->evictions++;
        /* fall through */
    case PLE_PUT_NEW:
        t->inserted++;
        break;
    default:
        break;
    }
}

static uint64_t row_key(const ple_source *src, uint32_t shard, uint64_t row)
{
    return (uint64_t)src->table_key << 40 | (shard * src->shard_size + row);
}

/* A miss's segment, its bytes, and the cache key of its row. */
static unsigned miss_seg(const ple_source *src, const miss *m)
{
    return m->shard % src->nsegs;
}

static uint64_t miss_row_key(const ple_source *src, const miss *m)
{
    unsigned g = miss_seg(src, m);
    uint64_t row = (m->offset - src->shards[m->shard].file_offset) / src->seg_bytes[g];
    return row_key(src, m->shard / src->nsegs, row);
}

/* --------------------------------------------------- the in-flight set */

static inflight **bucket_of(ple_source *src, uint64_t key)
{
    return &src->buckets[(key * 0x9E3779B97F4A7C15ULL) >> 54];  /* top 10 bits */
}

/* Under the lock: take a block to read (1) or find who reads it (0). */
static int claim_block(ple_source *src, uint64_t key, inflight *mine, unsigned char *data,
                       inflight **use)
{
    inflight **head = bucket_of(src, key);
    for (inflight *e = *head; e; e = e->next) {
        if (e->key == key) {
            e->refs++;
            *use = e;
            return 0;
        }
    }
    *mine = (inflight){.key = key, .next = *head, .data = data};
    *head = mine;
    *use = mine;
    return 1;
}

static void unlink_block(ple_source *src, inflight *e)
{
    inflight **p = bucket_of(src, e->key);
    while (*p != e)
        p = &(*p)->next;
    *p = e->next;
}

/* ------------------------------------------------------ reading misses */

typedef struct round_mem {
    uint64_t keys[ROUND_BLOCKS];
    inflight own[ROUND_BLOCKS];
    inflight *use[ROUND_BLOCKS];
    unsigned char owned[ROUND_BLOCKS];
    ple_read reads[ROUND_BLOCKS];
    uint32_t first_block[ROUND_BLOCKS];  /* of each read */
    unsigned char *buf;                  /* ROUND_BLOCKS blocks, 4 KiB-aligned */
    unsigned char *scratch;              /* a row that straddles blocks, put together */
    size_t charge;                       /* bytes of this buffer that may be in memory */
} round_mem;

/* A round's memory is one buffer of the pool (buffers.h): this struct, a
 * scratch row, then the blocks. */
#define ALIGN_BLOCK(x) (((x) + PLE_BLOCK - 1) / PLE_BLOCK * PLE_BLOCK)
#define ROUND_SCRATCH_AT ALIGN_BLOCK(sizeof(round_mem))
#define ROUND_BUF_AT (ROUND_SCRATCH_AT + ALIGN_BLOCK(PLE_ROW_BYTES_MAX))
#define ROUND_MEM_BYTES (ROUND_BUF_AT + (size_t)ROUND_BLOCKS * PLE_BLOCK)

/* Every row, of the widest, fits a round of the fewest blocks (a row of
 * PLE_ROW_BYTES_MAX that straddles spans 257): planning always advances. */
_Static_assert(ROUND_BLOCKS_MIN >= PLE_ROW_BYTES_MAX / PLE_BLOCK + 2, "a row must fit a round");
_Static_assert(ROUND_BLOCKS_MIN <= ROUND_BLOCKS, "the fewest blocks of a round");
_Static_assert(PLE_BUFFERS_BIG_WARM >= ROUNDS_AT_ONCE,
               "a stream of requests of several rounds keeps every round's buffer warm");

/* Blocks a round may read at most: ROUND_BLOCKS, or what the read buffers'
 * bound leaves (ple_set_read_memory). Relaxed: a number read once per
 * request; a request planned with the old one stays within its buffer. */
static _Atomic size_t round_cap = ROUND_BLOCKS;

/* Whether `take` bytes at `in_block` of block `e` were read; 0, or -1 with
 * err set (file, offset, errno). */
static int block_read(const ple_source *src, const miss *m, const inflight *e, uint32_t in_block,
                      uint32_t take, ple_error *err)
{
    uint64_t block_offset = (e->key & ((1ULL << BLOCK_BITS) - 1)) * PLE_BLOCK;
    const char *path = src->shards[m->shard].path;
    if (e->valid < 0) {
        ple_error_set(err, PLE_ERR_READ, -e->valid,
                      "reading the %u-byte block at offset %llu of %s: %s", PLE_BLOCK,
                      (unsigned long long)block_offset, path, strerror(-e->valid));
        return -1;
    }
    if (in_block + take > (uint32_t)e->valid) {
        ple_error_set(err, PLE_ERR_READ, EIO,
                      "short read at offset %llu of %s: %d of %u bytes, the file ends "
                      "before row offset %llu (truncated?): %s",
                      (unsigned long long)block_offset, path, e->valid, PLE_BLOCK,
                      (unsigned long long)m->offset, strerror(EIO));
        return -1;
    }
    return 0;
}

/* Copy one segment of a row out of the round's blocks into dst; 0, or -1
 * with err set. */
static int copy_row(ple_source *src, const round_mem *rm, const miss *m, unsigned char *dst,
                    ple_error *err)
{
    uint32_t rb = src->seg_bytes[miss_seg(src, m)], done = 0, j = m->block;
    while (done < rb) {
        const inflight *e = rm->use[j++];
        uint32_t in_block = (uint32_t)((m->offset + done) % PLE_BLOCK);
        uint32_t take = rb - done < PLE_BLOCK - in_block ? rb - done : PLE_BLOCK - in_block;
        if (block_read(src, m, e, in_block, take, err) != 0)
            return -1;
        memcpy(dst + done, e->data + in_block, take);
        done += take;
    }
    return 0;
}

/* A one-segment row as read, in memory no client can write: in its block
 * when it lies in one (no copy), else put together in the round's scratch
 * row. NULL with err set when its read failed. */
static const unsigned char *read_row(ple_source *src, const round_mem *rm, const miss *m,
                                     ple_error *err)
{
    uint32_t in_block = (uint32_t)(m->offset % PLE_BLOCK);
    if (in_block + src->row_bytes <= PLE_BLOCK) {
        const inflight *e = rm->use[m->block];
        return block_read(src, m, e, in_block, src->row_bytes, err) == 0 ? e->data + in_block
                                                                           : NULL;
    }
    return copy_row(src, rm, m, rm->scratch, err) == 0 ? rm->scratch : NULL;
}

/* Plan a round from m[start..] of at most `cap` distinct blocks, in order,
 * and each miss's first block; returns the end of the round's misses. */
static size_t plan_round(const ple_source *src, miss *m, size_t start, size_t n,
                         round_mem *rm, size_t cap, size_t *nblocks)
{
    size_t nb = 0, i = start;
    for (; i < n; i++) {
        uint64_t first = m[i].sort_key;
        uint32_t rb = src->seg_bytes[miss_seg(src, &m[i])];
        uint64_t last = first + (m[i].offset % PLE_BLOCK + rb - 1) / PLE_BLOCK;
        uint64_t have = nb ? rm->keys[nb - 1] : 0;
        size_t add = nb && have >= first ? (size_t)(last > have ? last - have : 0)
                                         : (size_t)(last - first + 1);
        if (nb + add > cap)
            break;
        /* Sorted by offset: this row's blocks up to `have` are the last ones
         * appended, in order. */
        m[i].block = (uint32_t)(nb && have >= first ? nb - 1 - (have - first) : nb);
        for (uint64_t k = last - add + 1; k <= last && add; k++)
            rm->keys[nb++] = k;
    }
    *nblocks = nb;
    return i;
}

static void record_read(ple_source *src, const ple_read *rd)
{
    ple_count(&src->reads, 1);
    ple_count(&src->read_bytes, rd->res > 0 ? (uint64_t)rd->res : 0);
    ple_count(&src->read_ns[ple_latency_bucket(rd->ns)], 1);
    ple_count(&src->read_ns_sum, rd->ns);
}

/* Read a round's blocks and take its rows: a one-segment row into `out` and
 * into the cache, a segment of a longer row into its private row of
 * `composed` (the caller moves whole rows on). */
static int read_round(ple_source *src, miss *m, size_t start, size_t end, size_t nb,
                      round_mem *rm, unsigned char *out, unsigned char *composed, tally *t,
                      ple_error *err)
{
    /* (a) register */
    pthread_mutex_lock(&src->inflight_lock);
    for (size_t j = 0; j < nb; j++)
        rm->owned[j] = (unsigned char)claim_block(src, rm->keys[j], &rm->own[j],
                                                  rm->buf + j * PLE_BLOCK, &rm->use[j]);
    pthread_mutex_unlock(&src->inflight_lock);

    /* (b) read our blocks, adjacent ones together */
    size_t nr = 0;
    for (size_t j = 0; j < nb;) {
        if (!rm->owned[j]) {
            j++;
            continue;
        }
        size_t len = 1;
        while (j + len < nb && len < COALESCE_BLOCKS && rm->owned[j + len]
               && rm->keys[j + len] == rm->keys[j + len - 1] + 1)
            len++;
        rm->reads[nr] = (ple_read){
            .fd = (int)(rm->keys[j] >> BLOCK_BITS),
            .offset = (rm->keys[j] & ((1ULL << BLOCK_BITS) - 1)) * PLE_BLOCK,
            .buf = rm->buf + j * PLE_BLOCK,
            .len = (uint32_t)(len * PLE_BLOCK),
        };
        rm->first_block[nr++] = (uint32_t)j;
        j += len;
    }
    ple_engine_run(src->engine, rm->reads, nr);

    /* (c) publish */
    pthread_mutex_lock(&src->inflight_lock);
    for (size_t r = 0; r < nr; r++) {
        const ple_read *rd = &rm->reads[r];
        record_read(src, rd);
        for (uint32_t q = 0; q < rd->len / PLE_BLOCK; q++) {
            inflight *e = &rm->own[rm->first_block[r] + q];
            int64_t left = (int64_t)rd->res - (int64_t)q * PLE_BLOCK;
            e->valid = rd->res < 0 ? rd->res
                     : (int32_t)(left < 0 ? 0 : left > PLE_BLOCK ? PLE_BLOCK : left);
            e->done = 1;
        }
    }
    if (nr)
        pthread_cond_broadcast(&src->inflight_changed);
    /* (d) wait for the blocks other requests read */
    for (size_t j = 0; j < nb; j++)
        while (!rm->use[j]->done)
            pthread_cond_wait(&src->inflight_changed, &src->inflight_lock);
    pthread_mutex_unlock(&src->inflight_lock);

    int rc = 0;
    for (size_t i = start; i < end; i++) {
        if (src->nsegs > 1) {
            /* Whole only after every round: out and cache then, by gather_range. */
            unsigned char *row = composed + (size_t)m[i].row * src->row_bytes;
            if (copy_row(src, rm, &m[i], row + src->seg_off[miss_seg(src, &m[i])], err) != 0) {
                t->read_errors++;
                rc = -1;
            }
            continue;
        }
        const unsigned char *row = read_row(src, rm, &m[i], err);
        if (!row) {
            t->read_errors++;
            rc = -1;
            continue;
        }
        memcpy(out + (size_t)m[i].pos * src->row_bytes, row, src->row_bytes);
        /* From the read buffer (or the scratch row), never from `out`: the
         * client may have rewritten its slot since the copy above. */
        if (src->cache)
            store_row(src, miss_row_key(src, &m[i]), row, t);
    }

    /* (d) drop our references, (e) wait for our waiters, leave the set */
    pthread_mutex_lock(&src->inflight_lock);
    int released = 0;
    for (size_t j = 0; j < nb; j++)
        if (!rm->owned[j] && --rm->use[j]->refs == 0)
            released = 1;
    if (released)
        pthread_cond_broadcast(&src->inflight_changed);
    for (size_t j = 0; j < nb; j++) {
        if (!rm->owned[j])
            continue;
        while (rm->own[j].refs)
            pthread_cond_wait(&src->inflight_changed, &src->inflight_lock);
        unlink_block(src, &rm->own[j]);
    }
    pthread_mutex_unlock(&src->inflight_lock);
    return rc;
}

/* Memory for rounds of up to `blocks` blocks (a warm buffer if the pool
 * has one; waits while the read buffers' bound has no room for it); NULL
 * when none can be mapped. Its charge covers everything a round of that
 * many blocks writes: the bookkeeping, the scratch row and the blocks. */
static round_mem *round_mem_new(size_t blocks)
{
    size_t charge;
    round_mem *rm = ple_buffer_take(ROUND_MEM_BYTES, ROUND_BUF_AT + blocks * PLE_BLOCK, &charge);
    if (!rm)
        return NULL;
    rm->scratch = (unsigned char *)rm + ROUND_SCRATCH_AT;
    rm->buf = (unsigned char *)rm + ROUND_BUF_AT;
    rm->charge = charge;
    return rm;
}

static void round_mem_free(round_mem *rm)
{
    size_t charge = rm->charge;  /* (read before the buffer is given away) */
    ple_buffer_give(rm, ROUND_MEM_BYTES, charge);
}

/* The rounds of one request, ROUNDS_AT_ONCE at a time: one round's reads
 * are in flight while another's last reads drain and its rows are copied. */
typedef struct rounds {
    ple_source *src;
    miss *m;
    const size_t *bounds;  /* round r: misses [bounds[r], bounds[r + 1]) */
    size_t nrounds, blocks;
    _Atomic size_t next;   /* relaxed: only hands out round numbers */
    unsigned char *out, *composed;
    tally tallies[ROUNDS_AT_ONCE];
    ple_error errors[ROUNDS_AT_ONCE];
    int rcs[ROUNDS_AT_ONCE];
} rounds;

static void rounds_task(void *ctx, size_t k)
{
    rounds *rs = ctx;
    round_mem *rm = round_mem_new(rs->blocks);
    if (!rm) {  /* the other task, if any, takes the rounds */
        ple_error_set(&rs->errors[k], PLE_ERR_NOMEM, ENOMEM, "no memory for read buffers");
        rs->rcs[k] = -1;
        return;
    }
    for (;;) {
        size_t r = atomic_fetch_add_explicit(&rs->next, 1, memory_order_relaxed);
        if (r >= rs->nrounds)
            break;
        size_t nb;
        plan_round(rs->src, rs->m, rs->bounds[r], rs->bounds[r + 1], rm, rs->blocks, &nb);
        if (read_round(rs->src, rs->m, rs->bounds[r], rs->bounds[r + 1], nb, rm, rs->out,
                       rs->composed, &rs->tallies[k], &rs->errors[k]) != 0)
            rs->rcs[k] = -1;
    }
    round_mem_free(rm);
}

static ple_pool *get_split_pool(unsigned workers);

static int read_misses(ple_source *src, miss *m, size_t n, unsigned char *out,
                       unsigned char *composed, tally *t, ple_error *err)
{
    qsort(m, n, sizeof *m, cmp_miss);
    rounds rs = {.src = src, .m = m, .out = out, .composed = composed};
    /* A round's blocks: no more than its misses can span (every miss, at
     * most its row's blocks and one more when it straddles), and no more
     * than the bound leaves; every round is planned with this one number,
     * so none writes past the buffer's charge. */
    size_t cap = atomic_load_explicit(&round_cap, memory_order_relaxed);
    rs.blocks = n * ((src->row_bytes + PLE_BLOCK - 1) / PLE_BLOCK + 1);
    if (rs.blocks > cap)
        rs.blocks = cap;
    size_t *bounds = malloc((n + 1) * sizeof *bounds);
    round_mem *plan = round_mem_new(0);
    if (!bounds || !plan) {
        free(bounds);
        if (plan)
            round_mem_free(plan);
        ple_error_set(err, PLE_ERR_NOMEM, ENOMEM, "no memory for %zu misses", n);
        return -1;
    }
    bounds[0] = 0;
    for (size_t start = 0; start < n; start = bounds[rs.nrounds]) {
        size_t nb;
        bounds[++rs.nrounds] = plan_round(src, m, start, n, plan, rs.blocks, &nb);
    }
    round_mem_free(plan);
    rs.bounds = bounds;
    size_t tasks = rs.nrounds < ROUNDS_AT_ONCE ? rs.nrounds : ROUNDS_AT_ONCE;
    ple_pool *pool = tasks > 1 ? get_split_pool(tasks - 1) : NULL;
    if (pool)
        ple_pool_run(pool, rounds_task, &rs, tasks);
    else
        rounds_task(&rs, 0);
    free(bounds);
    int rc = 0;
    for (size_t k = 0; k < ROUNDS_AT_ONCE; k++) {
        t->inserted += rs.tallies[k].inserted;
        t->evictions += rs.tallies[k].evictions;
        t->read_errors += rs.tallies[k].read_errors;
        if (rs.rcs[k] != 0 && rc == 0) {
            *err = rs.errors[k];
            rc = -1;
        }
    }
    return rc;
}

/* ---------------------------------------------------------------- gather */

/* Ids are looked up in batches: every id of a batch is located, its index
 * entry prefetched, then its slot (or mapped row) prefetched, before the
 * first locked lookup, so the memory latencies of a batch overlap instead of
 * adding up (a mutex's atomic instruction would otherwise serialize them). */
#define LOOKUP_BATCH 16u

typedef struct located {
    uint32_t shard;
    uint64_t row;
    ple_cache_probe probe;
} located;

static int locate_batch(ple_source *src, const int64_t *ids, size_t count, located *loc,
                        ple_error *err)
{
    for (size_t k = 0; k < count; k++) {
        /* Each id is read once: the caller's array may change under us. */
        if (locate(src, ids[k], &loc[k].shard, &loc[k].row, err) != 0)
            return -1;
        uint64_t key = row_key(src, loc[k].shard, loc[k].row);
        if (src->cache) {
            ple_cache_prepare(src->cache, key, &loc[k].probe);
        } else {
            const src_shard *sh = &src->shards[loc[k].shard * src->nsegs];
            loc[k].probe.key = key;
            __builtin_prefetch(sh->map + sh->file_offset + loc[k].row * src->seg_bytes[0]);
        }
    }
    if (src->cache)
        for (size_t k = 0; k < count; k++)
            ple_cache_prefetch_row(src->cache, &loc[k].probe);
    return 0;
}

/* Copies out of the file mappings, each of a segment at `offsets[k]` of
 * shard entry `parts[k]`, guarded (mapped.h): an unreadable page fails the
 * request with a read error naming the file and offset, never the server. */
static int copy_mapped(const ple_source *src, const ple_copy *copies, const uint32_t *parts,
                       const uint64_t *offsets, size_t n, ple_error *err)
{
    const void *fault = NULL;
    size_t k = ple_mapped_copies(copies, n, &fault);
    if (k == n)
        return 0;
    const src_shard *sh = &src->shards[parts[k]];
    uint64_t at = offsets[k] + (uint64_t)((const unsigned char *)fault
                                          - (const unsigned char *)copies[k].src);
    ple_error_set(err, PLE_ERR_READ, EIO,
                  "reading %zu bytes at offset %llu of %s through its mapping: the page at "
                  "offset %llu cannot be read (a disk error, or the file was truncated): %s",
                  copies[k].len, (unsigned long long)offsets[k], sh->path,
                  (unsigned long long)(at - at % PLE_BLOCK), strerror(EIO));
    return -1;
}

/* At most PIECE_ROWS ids of a range, in the calling thread. */
static int gather_piece(ple_source *src, const int64_t *ids, size_t n, unsigned char *out,
                        tally *t, ple_error *err)
{
    uint32_t rb = src->row_bytes;
    unsigned nsegs = src->nsegs;
    miss *m = NULL;
    /* Reads from the front of `m`, resident segments' copies from its back:
     * a missed row adds nsegs entries in all, so they never meet. */
    size_t nm = 0, nr = 0, cap = n * nsegs;
    if (src->engine && (n > SIZE_MAX / nsegs / sizeof *m || !(m = malloc(n * nsegs * sizeof *m)))) {
        ple_error_set(err, PLE_ERR_NOMEM, ENOMEM, "no memory for %zu misses", n);
        return -1;
    }
    /* A cache over mappings takes rows from a private row put together here
     * (never from `out`, nor from the mapping under the cache's lock). */
    unsigned char *private_row = NULL;
    if (!src->engine && src->cache && !(private_row = malloc(rb))) {
        ple_error_set(err, PLE_ERR_NOMEM, ENOMEM, "no memory for a row of %u bytes", rb);
        return -1;
    }
    int rc = 0;
    uint32_t missed = 0;  /* rows, numbered for `composed` */
    located loc[LOOKUP_BATCH];
    /* Without an engine: a batch's copies out of the mappings, done at once. */
    ple_copy copies[LOOKUP_BATCH * PLE_SEGMENTS_MAX];
    uint32_t parts[LOOKUP_BATCH * PLE_SEGMENTS_MAX];
    uint64_t offsets[LOOKUP_BATCH * PLE_SEGMENTS_MAX];
    for (size_t base = 0; base < n && rc == 0; base += LOOKUP_BATCH) {
        size_t count = n - base < LOOKUP_BATCH ? n - base : LOOKUP_BATCH, nc = 0;
        if (locate_batch(src, ids + base, count, loc, err) != 0) {
            rc = -1;
            break;
        }
        for (size_t k = 0; k < count && rc == 0; k++) {
            size_t i = base + k;
            unsigned char *dst = out + i * rb;
            if (src->cache && ple_cache_get_prepared(src->cache, &loc[k].probe, dst, rb)) {
                t->hits++;
                continue;
            }
            t->misses++;
            unsigned char *into = private_row ? private_row : dst;
            size_t first = nc;
            for (unsigned g = 0; g < nsegs; g++) {
                uint32_t flat = loc[k].shard * nsegs + g;
                const src_shard *sh = &src->shards[flat];
                uint64_t offset = sh->file_offset + loc[k].row * src->seg_bytes[g];
                if (src->engine) {
                    if (sh->resident)  /* from the back of `m`, copied once `composed`
                                        * exists: its byte in the resident rows */
                        m[cap - 1 - nr++] = (miss){.offset = loc[k].row * src->seg_bytes[g],
                                                   .pos = (uint32_t)i, .shard = flat,
                                                   .row = missed};
                    else
                        m[nm++] = (miss){.sort_key = (uint64_t)sh->fd << BLOCK_BITS
                                                     | offset / PLE_BLOCK,
                                         .offset = offset, .pos = (uint32_t)i, .shard = flat,
                                         .row = missed};
                    continue;
                }
                copies[nc] = (ple_copy){into + src->seg_off[g], sh->map + offset,
                                        src->seg_bytes[g]};
                parts[nc] = flat;
                offsets[nc++] = offset;
            }
            missed++;
            if (!private_row)
                continue;
            /* A cache over mappings: the row from the mapping into the private
             * row, then into `out` and into the cache from there. */
            if (copy_mapped(src, copies + first, parts + first, offsets + first, nc - first,
                            err) != 0) {
                t->read_errors++;
                rc = -1;
                break;
            }
            nc = first;
            memcpy(dst, private_row, rb);
            store_row(src, loc[k].probe.key, private_row, t);
        }
        if (rc == 0 && nc && copy_mapped(src, copies, parts, offsets, nc, err) != 0) {
            t->read_errors++;
            rc = -1;
        }
    }
    unsigned char *composed = NULL;
    if (rc == 0 && nm && nsegs > 1 && !(composed = malloc((size_t)missed * rb))) {
        ple_error_set(err, PLE_ERR_NOMEM, ENOMEM, "no memory for %u rows", missed);
        rc = -1;
    }
    if (rc == 0 && nm)
        rc = read_misses(src, m, nm, out, composed, t, err);
    /* The resident segments of the missed rows, from memory. */
    if (rc == 0 && composed)
        for (size_t j = 0; j < nr; j++) {
            const miss *r = &m[cap - 1 - j];
            unsigned g = miss_seg(src, r);
            memcpy(composed + (size_t)r->row * rb + src->seg_off[g],
                   src->shards[r->shard].resident + r->offset, src->seg_bytes[g]);
        }
    /* Rows of several segments: every segment is in its private row now
     * (rc == 0); each row once, through its first segment read from the
     * file, into `out` and from the private row into the cache. A failed
     * request caches nothing of its rows. */
    if (rc == 0 && composed)
        for (size_t j = 0; j < nm; j++) {
            if (miss_seg(src, &m[j]) != src->lead_seg)
                continue;
            const unsigned char *row = composed + (size_t)m[j].row * rb;
            memcpy(out + (size_t)m[j].pos * rb, row, rb);
            if (src->cache)
                store_row(src, miss_row_key(src, &m[j]), row, t);
        }
    free(composed);
    free(private_row);
    free(m);
    return rc;
}

/* One range of a request, in the calling thread, a piece at a time. */
static int gather_range(ple_source *src, const int64_t *ids, size_t n, unsigned char *out,
                        tally *t, ple_error *err)
{
    for (size_t a = 0; a < n; a += PIECE_ROWS) {
        size_t len = n - a < PIECE_ROWS ? n - a : PIECE_ROWS;
        if (gather_piece(src, ids + a, len, out + a * src->row_bytes, t, err) != 0)
            return -1;
    }
    return 0;
}

static void add_tally(ple_source *src, const tally *t, int flags)
{
    if (flags & COUNT_LOOKUPS) {
        ple_count(&src->hits, t->hits);
        ple_count(&src->misses, t->misses);
        if (src->cache)
            ple_cache_count(src->cache, t->hits, t->misses);
    }
    ple_count(&src->evictions, t->evictions);
    ple_count(&src->read_errors, t->read_errors);
}

/* The pool that splits large requests, shared by every table; it grows to
 * the most threads asked for and lives as long as the process. */
static pthread_mutex_t split_pool_lock = PTHREAD_MUTEX_INITIALIZER;
static ple_pool *split_pool;

static ple_pool *get_split_pool(unsigned workers)
{
    pthread_mutex_lock(&split_pool_lock);
    if (!split_pool)
        split_pool = ple_pool_open(0);
    if (split_pool)
        ple_pool_grow(split_pool, workers);
    ple_pool *pool = split_pool;
    pthread_mutex_unlock(&split_pool_lock);
    return pool;
}

typedef struct split {
    ple_source *src;
    const int64_t *ids;
    unsigned char *out;
    size_t n, per_task;
    tally *tallies;
    ple_error *errors;
    int *rcs;
} split;

static void split_task(void *ctx, size_t k)
{
    split *sp = ctx;
    size_t a = k * sp->per_task, b = a + sp->per_task < sp->n ? a + sp->per_task : sp->n;
    sp->rcs[k] = gather_range(sp->src, sp->ids + a, b - a, sp->out + a * sp->src->row_bytes,
                              &sp->tallies[k], &sp->errors[k]);
}

/* A request: split over the pool when large, counted once at the end; the
 * counts are also added to *counted. */
static int gather(ple_source *src, const int64_t *ids, size_t n, unsigned char *out,
                  unsigned threads, int flags, tally *counted, ple_error *err)
{
    tally t = {0};
    if (n == 0)
        return 0;
    size_t tasks = threads > 1 ? n / SPLIT_MIN_ROWS : 1;
    if (tasks > threads)
        tasks = threads;
    ple_pool *pool = tasks > 1 ? get_split_pool(threads - 1) : NULL;
    int rc = 0;
    if (!pool) {
        rc = gather_range(src, ids, n, out, &t, err);
    } else {
        split sp = {.src = src, .ids = ids, .out = out, .n = n,
                    .per_task = (n + tasks - 1) / tasks};
        sp.tallies = calloc(tasks, sizeof *sp.tallies);
        sp.errors = calloc(tasks, sizeof *sp.errors);
        sp.rcs = calloc(tasks, sizeof *sp.rcs);
        if (!sp.tallies || !sp.errors || !sp.rcs) {
            ple_error_set(err, PLE_ERR_NOMEM, ENOMEM, "no memory to split %zu rows", n);
            rc = -1;
        } else {
            ple_pool_run(pool, split_task, &sp, tasks);
            for (size_t k = 0; k < tasks; k++) {
                t.hits += sp.tallies[k].hits;
                t.misses += sp.tallies[k].misses;
                t.inserted += sp.tallies[k].inserted;
                t.evictions += sp.tallies[k].evictions;
                t.read_errors += sp.tallies[k].read_errors;
                if (sp.rcs[k] != 0 && rc == 0) {
                    *err = sp.errors[k];
                    rc = -1;
                }
            }
        }
        free(sp.tallies);
        free(sp.errors);
        free(sp.rcs);
    }
    add_tally(src, &t, flags);
    counted->inserted += t.inserted;
    return rc;
}

int ple_source_gather(ple_source *src, const int64_t *ids, size_t n, unsigned char *out,
                      unsigned threads, ple_error *err)
{
    tally t = {0};
    return gather(src, ids, n, out, threads, COUNT_LOOKUPS, &t, err);
}

int64_t ple_source_gather_hits(ple_source *src, const int64_t *ids, size_t n,
                               unsigned char *out, ple_error *err)
{
    if (!src->cache)
        return (int64_t)n;
    located loc[LOOKUP_BATCH];
    for (size_t base = 0; base < n; base += LOOKUP_BATCH) {
        size_t count = n - base < LOOKUP_BATCH ? n - base : LOOKUP_BATCH;
        if (locate_batch(src, ids + base, count, loc, err) != 0)
            return -1;
        for (size_t k = 0; k < count; k++) {
            if (ple_cache_get_prepared(src->cache, &loc[k].probe,
                                       out + (base + k) * src->row_bytes, src->row_bytes))
                continue;
            /* The caller gathers the request instead; its ids are still all
             * checked, so a bad id is reported here as it would be there. */
            uint32_t shard;
            uint64_t row;
            for (size_t j = base + count; j < n; j++)
                if (locate(src, ids[j], &shard, &row, err) != 0)
                    return -1;
            return (int64_t)(n - base - k);
        }
    }
    /* Counted only when served: a request handed on to gather counts there. */
    tally t = {.hits = n};
    add_tally(src, &t, COUNT_LOOKUPS);
    return 0;
}

int64_t ple_source_cached(ple_source *src, const int64_t *ids, size_t n,
                          unsigned char *cached, ple_error *err)
{
    if (!src->cache) {
        memset(cached, 0, n);
        return 0;
    }
    located loc[LOOKUP_BATCH];
    int64_t found = 0;
    for (size_t base = 0; base < n; base += LOOKUP_BATCH) {
        size_t count = n - base < LOOKUP_BATCH ? n - base : LOOKUP_BATCH;
        if (locate_batch(src, ids + base, count, loc, err) != 0)
            return -1;
        for (size_t k = 0; k < count; k++) {
            cached[base + k] = (unsigned char)ple_cache_contains(src->cache, &loc[k].probe);
            found += cached[base + k];
        }
    }
    return found;
}

int64_t ple_source_fill(ple_source *src, const int64_t *ids, size_t n, ple_error *err)
{
    if (!src->cache) {
        ple_error_set(err, PLE_ERR_VALUE, 0, "fill needs a row cache (this table has none)");
        return -1;
    }
    size_t chunk = n < FILL_CHUNK_ROWS ? n : FILL_CHUNK_ROWS;
    unsigned char *scratch = malloc(chunk * src->row_bytes + 1);
    if (!scratch) {
        ple_error_set(err, PLE_ERR_NOMEM, ENOMEM, "no memory to fill the cache");
        return -1;
    }
    tally t = {0};
    int rc = 0;
    for (size_t a = 0; a < n && rc == 0; a += chunk) {
        size_t len = n - a < chunk ? n - a : chunk;
        rc = gather(src, ids + a, len, scratch, 1, 0, &t, err);
    }
    free(scratch);
    return rc == 0 ? (int64_t)t.inserted : -1;
}

/* ----------------------------------------------------------- lifecycle */

/* Shard i's part of one segment (`row_bytes` of its rows). */
static int check_shard(const ple_shard_spec *sp, unsigned i, uint32_t row_bytes,
                       uint64_t shard_size, int have_engine, int direct, ple_error *err)
{
    const char *path = sp->path ? sp->path : "?";
    if (sp->rows > shard_size || sp->file_offset > OFFSET_MAX
        || sp->rows * row_bytes > OFFSET_MAX - sp->file_offset) {
        ple_error_set(err, PLE_ERR_VALUE, 0, "shard %u of %s: %llu rows at offset %llu do not "
                      "fit the table (shard_size %llu) or a file", i, path,
                      (unsigned long long)sp->rows, (unsigned long long)sp->file_offset,
                      (unsigned long long)shard_size);
        return -1;
    }
    if (sp->rows == 0)
        return 0;
    if (!have_engine) {
        if (!sp->map) {
            ple_error_set(err, PLE_ERR_VALUE, 0, "shard %u of %s: no engine and no mapping to "
                          "read its rows from", i, path);
            return -1;
        }
        return 0;
    }
    struct stat st;
    if (sp->fd < 0 || fstat(sp->fd, &st) != 0) {
        ple_error_set(err, PLE_ERR_VALUE, 0, "shard %u of %s: fd %d is not an open file", i,
                      path, sp->fd);
        return -1;
    }
    if ((uint64_t)st.st_size < sp->file_offset + sp->rows * row_bytes) {
        ple_error_set(err, PLE_ERR_VALUE, 0, "shard %u of %s: rows end at byte %llu but the "
                      "file has %lld bytes", i, path,
                      (unsigned long long)(sp->file_offset + sp->rows * row_bytes),
                      (long long)st.st_size);
        return -1;
    }
    int fl = fcntl(sp->fd, F_GETFL);
    if (direct && (fl < 0 || !(fl & O_DIRECT))) {
        ple_error_set(err, PLE_ERR_VALUE, 0, "shard %u of %s: direct=True but fd %d was not "
                      "opened with O_DIRECT", i, path, sp->fd);
        return -1;
    }
    return 0;
}

ple_source *ple_source_open(uint32_t table_key, uint32_t row_bytes, uint64_t shard_size,
                            const ple_shard_spec *shards, unsigned nshards,
                            const uint32_t *seg_bytes, unsigned nsegs,
                            ple_cache *cache, ple_engine *engine, int direct,
                            ple_error *err)
{
    uint32_t one_seg[1] = {row_bytes};
    if (!seg_bytes) {
        seg_bytes = one_seg;
        nsegs = 1;
    }
    uint64_t seg_sum = 0;
    for (unsigned g = 0; g < nsegs && nsegs <= PLE_SEGMENTS_MAX; g++)
        seg_sum += seg_bytes[g] ? seg_bytes[g] : (uint64_t)1 << 32;  /* a 0 never adds up */
    if (nsegs == 0 || nsegs > PLE_SEGMENTS_MAX || seg_sum != row_bytes) {
        ple_error_set(err, PLE_ERR_VALUE, 0, "bad row segments: %u segment(s) (1..%u), each of "
                      "at least 1 byte, must add up to row_bytes %u", nsegs, PLE_SEGMENTS_MAX,
                      row_bytes);
        return NULL;
    }
    if (nshards % nsegs) {
        ple_error_set(err, PLE_ERR_VALUE, 0, "%u shard entries for %u segments: give one per "
                      "segment of every shard (shard-major)", nshards, nsegs);
        return NULL;
    }
    unsigned nparts = nshards;  /* entries: table shard s, segment g at s * nsegs + g */
    nshards /= nsegs;
    if (table_key > PLE_TABLE_KEY_MAX || row_bytes == 0 || row_bytes > PLE_ROW_BYTES_MAX
        || shard_size == 0 || nshards == 0 || shard_size > (1ULL << 40) / nshards) {
        ple_error_set(err, PLE_ERR_VALUE, 0, "bad table layout: table_key %u (max %u), "
                      "row_bytes %u (1..%u), shard_size %llu x %u shards (at most 2^40 rows)",
                      table_key, PLE_TABLE_KEY_MAX, row_bytes, PLE_ROW_BYTES_MAX,
                      (unsigned long long)shard_size, nshards);
        return NULL;
    }
    if (!engine && ple_mapped_guard_install() != 0) {
        if (errno == EOVERFLOW)
            ple_error_set(err, PLE_ERR_OS, errno, "cannot install the SIGBUS handler that lets a "
                          "read of an unreadable mapped page fail its request: too many other SIGBUS "
                          "handlers were installed over it since the first table was opened");
        else
            ple_error_set(err, PLE_ERR_OS, errno, "cannot install the SIGBUS handler that lets a "
                          "read of an unreadable mapped page fail its request: %s", strerror(errno));
        return NULL;
    }
    if (cache && row_bytes > ple_cache_slot_bytes(cache)) {
        ple_error_set(err, PLE_ERR_VALUE, 0, "rows of %u bytes do not fit the cache's %u-byte "
                      "slots", row_bytes, ple_cache_slot_bytes(cache));
        return NULL;
    }
    for (unsigned i = 0; i < nparts; i++) {
        if (check_shard(&shards[i], i / nsegs, seg_bytes[i % nsegs], shard_size, engine != NULL,
                        direct, err))
            return NULL;
        if (shards[i].rows != shards[i - i % nsegs].rows) {
            ple_error_set(err, PLE_ERR_VALUE, 0, "shard %u: segment %u has %llu rows, segment 0 "
                          "%llu; every segment of a shard must have its rows", i / nsegs,
                          i % nsegs, (unsigned long long)shards[i].rows,
                          (unsigned long long)shards[i - i % nsegs].rows);
            return NULL;
        }
    }
    ple_source *src = calloc(1, sizeof *src);
    if (!src || !(src->shards = calloc(nparts, sizeof *src->shards))) {
        free(src);
        ple_error_set(err, PLE_ERR_NOMEM, ENOMEM, "out of memory");
        return NULL;
    }
    atomic_init(&src->refs, 1);
    src->table_key = table_key;
    src->row_bytes = row_bytes;
    src->shard_size = shard_size;
    src->nshards = nshards;
    src->nsegs = nsegs;
    for (unsigned g = 0, off = 0; g < nsegs; off += seg_bytes[g], g++) {
        src->seg_bytes[g] = seg_bytes[g];
        src->seg_off[g] = off;
    }
    pthread_mutex_init(&src->inflight_lock, NULL);
    pthread_cond_init(&src->inflight_changed, NULL);
    for (unsigned i = 0; i < nparts; i++)
        src->shards[i].fd = -1;
    for (unsigned i = 0; i < nparts; i++) {
        src_shard *sh = &src->shards[i];
        sh->file_offset = shards[i].file_offset;
        sh->rows = shards[i].rows;
        sh->map = shards[i].map;
        uint64_t first = (uint64_t)(i / nsegs) * shard_size;
        if (shards[i].rows && first + shards[i].rows > src->rows)
            src->rows = first + shards[i].rows;
        sh->path = strdup(shards[i].path ? shards[i].path : "?");
        /* Our own fd: the caller closing or reusing its number cannot make a
         * read land in another file. */
        if (engine && shards[i].rows)
            sh->fd = fcntl(shards[i].fd, F_DUPFD_CLOEXEC, 0);
        if (!sh->path || (engine && shards[i].rows && (sh->fd < 0 || sh->fd > FD_MAX))) {
            int code = !sh->path ? ENOMEM : sh->fd < 0 ? errno : EMFILE;
            ple_error_set(err, PLE_ERR_OS, code, "cannot duplicate fd %d of shard %u: %s",
                          shards[i].fd, i / nsegs, strerror(code));
            ple_source_unref(src);
            return NULL;
        }
    }
    if (cache) {
        ple_cache_ref(cache);
        src->cache = cache;
    }
    if (engine) {
        ple_engine_ref(engine);
        src->engine = engine;
    }
    return src;
}

/* Segment `seg` of shard entry `sh` (`len` bytes at its file offset) read
 * into a mapping of its own: whole aligned blocks, so that an O_DIRECT fd
 * reads it as well as a buffered one. */
static int read_resident(src_shard *sh, size_t len, int direct, ple_error *err)
{
    uint64_t first = sh->file_offset - sh->file_offset % PLE_BLOCK;
    uint64_t end = sh->file_offset + len;
    end += (PLE_BLOCK - end % PLE_BLOCK) % PLE_BLOCK;
    size_t size = (size_t)(end - first);
    void *map = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (map == MAP_FAILED) {
        ple_error_set(err, PLE_ERR_NOMEM, errno, "no memory for the %zu resident bytes of %s "
                      "(resident_scales): %s", len, sh->path, strerror(errno));
        return -1;
    }
    size_t done = 0, need = (size_t)(sh->file_offset + len - first);
    while (done < need) {
        size_t ask = size - done < RESIDENT_CHUNK ? size - done : RESIDENT_CHUNK;
        ssize_t got = pread(sh->fd, (unsigned char *)map + done, ask, (off_t)(first + done));
        if (got < 0 && errno == EINTR)
            continue;
        if (got <= 0) {
            int code = got < 0 ? errno : EIO;
            ple_error_set(err, PLE_ERR_READ, code, "reading the %zu resident bytes at offset "
                          "%llu of %s: %s", len, (unsigned long long)sh->file_offset, sh->path,
                          got < 0 ? strerror(code) : "the file ends before them (truncated?)");
            munmap(map, size);
            return -1;
        }
        done += (size_t)got;
    }
    /* Nothing writes them again; a buffered fd's pages are dropped, so that
     * the rows are not held twice (here and in the page cache). */
    mprotect(map, size, PROT_READ);
    if (!direct)
        posix_fadvise(sh->fd, (off_t)first, (off_t)size, POSIX_FADV_DONTNEED);
    sh->resident_map = map;
    sh->resident_len = size;
    sh->resident = (const unsigned char *)map + (sh->file_offset - first);
    return 0;
}

int ple_source_keep_resident(ple_source *src, unsigned seg, ple_error *err)
{
    if (!src->engine) {
        ple_error_set(err, PLE_ERR_VALUE, 0, "a table without a read engine (io mmap) reads "
                      "every segment from its mapping: nothing to keep resident");
        return -1;
    }
    if (seg >= src->nsegs) {
        ple_error_set(err, PLE_ERR_VALUE, 0, "segment %u of a row of %u segment(s)", seg,
                      src->nsegs);
        return -1;
    }
    unsigned all = (1u << src->nsegs) - 1, mask = src->resident_segs | 1u << seg;
    if (mask == all) {
        ple_error_set(err, PLE_ERR_VALUE, 0, "segment %u is the last of the row read from the "
                      "file: a table keeps at least one segment on disk (all in memory is io "
                      "mmap's page cache, or a row cache of every row)", seg);
        return -1;
    }
    if (src->resident_segs & 1u << seg)
        return 0;
    int direct = 0;
    for (unsigned s = 0; s < src->nshards; s++) {
        src_shard *sh = &src->shards[s * src->nsegs + seg];
        if (!sh->rows)
            continue;
        int fl = fcntl(sh->fd, F_GETFL);
        direct = fl >= 0 && (fl & O_DIRECT);
        if (read_resident(sh, (size_t)sh->rows * src->seg_bytes[seg], direct, err) != 0) {
            for (unsigned t = 0; t < s; t++) {  /* this segment's shards read so far */
                src_shard *done = &src->shards[t * src->nsegs + seg];
                if (done->resident_map)
                    munmap(done->resident_map, done->resident_len);
                done->resident_map = NULL;
                done->resident = NULL;
            }
            return -1;
        }
    }
    for (unsigned s = 0; s < src->nshards; s++)
        src->resident_bytes += src->shards[s * src->nsegs + seg].rows * src->seg_bytes[seg];
    src->resident_segs = mask;
    while (src->resident_segs & 1u << src->lead_seg)
        src->lead_seg++;
    return 0;
}

uint64_t ple_source_rows(const ple_source *src)
{
    return src->rows;
}

size_t ple_source_scratch_bytes(const ple_source *src)
{
    /* gather_piece: its misses, NVFP4's private rows or a cache's private
     * row; read_misses: the rounds' bounds; gather: a split's bookkeeping,
     * for as many tasks as a call may ask threads (256). */
    size_t misses = (size_t)PIECE_ROWS * src->nsegs, piece = 0;
    if (src->engine)
        piece = misses * sizeof(miss) + (misses + 1) * sizeof(size_t)
              + (src->nsegs > 1 ? (size_t)PIECE_ROWS * src->row_bytes : 0);
    else if (src->cache)
        piece = src->row_bytes;
    return piece + 256 * (sizeof(tally) + sizeof(ple_error) + sizeof(int));
}

size_t ple_source_fill_scratch_bytes(const ple_source *src)
{
    return (size_t)FILL_CHUNK_ROWS * src->row_bytes + 1;
}

size_t ple_read_round_bytes(void)
{
    return ROUND_MEM_BYTES;
}

size_t ple_read_memory_min(void)
{
    return ROUND_BUF_AT + (size_t)ROUND_BLOCKS_MIN * PLE_BLOCK;
}

int ple_set_read_memory(size_t bytes, ple_error *err)
{
    if (bytes && bytes < ple_read_memory_min()) {
        ple_error_set(err, PLE_ERR_VALUE, 0, "a bound of %zu bytes on the read buffers is "
                      "below the smallest round's %zu (its bookkeeping and %u blocks of "
                      "%u bytes): give at least that, or 0 for no bound", bytes,
                      ple_read_memory_min(), ROUND_BLOCKS_MIN, PLE_BLOCK);
        return -1;
    }
    size_t blocks = bytes ? (bytes - ROUND_BUF_AT) / PLE_BLOCK : ROUND_BLOCKS;
    atomic_store_explicit(&round_cap, blocks < ROUND_BLOCKS ? blocks : ROUND_BLOCKS,
                          memory_order_relaxed);
    ple_buffers_set_limit(bytes);
    return 0;
}

void ple_get_read_memory(ple_read_memory *st)
{
    ple_buffers_stats b;
    ple_buffers_get_stats(&b);
    *st = (ple_read_memory){.limit = b.limit, .charged = b.charged, .peak = b.peak,
                            .waits = b.waits, .returned = b.returned,
                            .round_blocks = atomic_load_explicit(&round_cap,
                                                                 memory_order_relaxed)};
}

void ple_source_get_stats(ple_source *src, ple_source_stats *st)
{
    uint64_t *h = st->read_ns_hist, total = 0;
    for (unsigned b = 0; b < HIST_BUCKETS; b++)
        total += h[b] = ple_counted(&src->read_ns[b]);
    st->read_ns_sum = ple_counted(&src->read_ns_sum);
    st->hits = ple_counted(&src->hits);
    st->misses = ple_counted(&src->misses);
    st->reads = ple_counted(&src->reads);
    st->read_bytes = ple_counted(&src->read_bytes);
    st->read_errors = ple_counted(&src->read_errors);
    st->evictions = ple_counted(&src->evictions);
    st->read_ns_p50 = ple_latency_quantile(h, total, 0.50);
    st->read_ns_p99 = ple_latency_quantile(h, total, 0.99);
    st->resident_bytes = src->resident_bytes;  /* set before the source was shared */
}

void ple_source_ref(ple_source *src)
{
    /* Relaxed: the caller holds a reference already. */
    atomic_fetch_add_explicit(&src->refs, 1, memory_order_relaxed);
}

void ple_source_unref(ple_source *src)
{
    /* Acq_rel: every user's last accesses happen before the frees below. */
    if (atomic_fetch_sub_explicit(&src->refs, 1, memory_order_acq_rel) != 1)
        return;
    for (unsigned i = 0; i < src->nshards * src->nsegs; i++) {
        if (src->shards[i].fd >= 0)
            close(src->shards[i].fd);
        if (src->shards[i].resident_map)
            munmap(src->shards[i].resident_map, src->shards[i].resident_len);
        free(src->shards[i].path);
    }
    free(src->shards);
    if (src->cache)
        ple_cache_unref(src->cache);
    if (src->engine)
        ple_engine_unref(src->engine);
    pthread_cond_destroy(&src->inflight_changed);
    pthread_mutex_destroy(&src->inflight_lock);
    free(src);
}
