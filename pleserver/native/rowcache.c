/* The row cache (see rowcache.h).
 *
 * Memory: one anonymous mapping holds, in order, the row slots and the
 * per-row metadata (index entries, slot keys, SIEVE links and visited
 * bits). MAP_HUGETLB is tried first; else the region is 2 MiB-aligned and
 * given MADV_HUGEPAGE. Pages are committed on first use, or all at once by
 * mlock when asked.
 *
 * Shards: the key's hash picks the shard (top bits) and the home position in
 * the shard's index (low bits). Each shard owns a fixed range of slots, its
 * index (linear probing, load <= 0.7, backward-shift deletion, no
 * tombstones), its SIEVE list and hand, and a mutex that guards all of that
 * and the slot bytes. Everything a shard owns is touched only under its
 * mutex, so plain loads and stores suffice; the only atomics are the
 * cache-wide hit/miss counters (relaxed) and the reference count. */
#include <errno.h>
#include <pthread.h>
#include <stdalign.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#include "rowcache.h"

#define NONE UINT32_MAX
#define HUGE_PAGE (2u << 20)
#define ROWS_PER_SHARD_MIN 64u
#define SHARDS_MAX 256u

typedef struct index_entry {
    uint64_t key;
    uint32_t slot1;  /* slot + 1; 0 = empty (zeroed memory is an empty index) */
    uint32_t unused;
} index_entry;

typedef struct shard {
    alignas(64) pthread_mutex_t lock;
    uint32_t base, nslots, used;  /* slots [base, base + nslots); used fill in order */
    uint32_t index_size;
    index_entry *index;
    uint32_t newest, oldest, hand;  /* SIEVE list (slot numbers), NONE = empty */
    uint64_t inserts, evictions;
} shard;

struct ple_cache {
    _Atomic unsigned refs;
    _Atomic uint64_t hits, misses;
    uint32_t slot_bytes;
    uint64_t capacity;
    unsigned shard_bits;
    shard *shards;
    unsigned nshards;
    unsigned char *region;   /* the mapping */
    size_t region_size;
    unsigned char *slots;    /* capacity * slot_bytes */
    uint64_t *keys;          /* per slot */
    uint32_t *newer, *older; /* per slot: SIEVE list links */
    unsigned char *visited;  /* per slot: SIEVE visited bit */
    int hugetlb, thp, mlocked;
};

static uint64_t mix(uint64_t x)  /* murmur3 fmix64 */
{
    x ^= x >> 33;
    x *= 0xff51afd7ed558ccdULL;
    x ^= x >> 33;
    x *= 0xc4ceb9fe1a85ec53ULL;
    x ^= x >> 33;
    return x;
}

static shard *shard_of(ple_cache *c, uint64_t h)
{
    return &c->shards[c->shard_bits ? h >> (64 - c->shard_bits) : 0];
}

static uint32_t home_of(const shard *s, uint64_t h)
{
    return (uint32_t)(((h & 0xffffffffu) * s->index_size) >> 32);
}

/* ----------------------------------------------------------- the index */

/* Position of `key`, or of the empty entry where it would go (*found = 0). */
static uint32_t index_find(const shard *s, uint64_t key, uint64_t h, int *found)
{
    uint32_t pos = home_of(s, h);
    while (s->index[pos].slot1) {
        if (s->index[pos].key == key) {
            *found = 1;
            return pos;
        }
        pos = pos + 1 == s->index_size ? 0 : pos + 1;
    }
    *found = 0;
    return pos;
}

/* Backward-shift deletion: move later entries of the probe run into the hole
 * when their home position allows it, so lookups never need tombstones. */
static void index_delete(shard *s, uint32_t hole)
{
    uint32_t pos = hole;
    for (;;) {
        pos = pos + 1 == s->index_size ? 0 : pos + 1;
        if (!s->index[pos].slot1)
            break;
        uint32_t home = home_of(s, mix(s->index[pos].key));
        /* The entry may move to `hole` unless its home lies cyclically in
         * (hole, pos]. */
        int stays = hole <= pos ? (home > hole && home <= pos) : (home > hole || home <= pos);
        if (!stays) {
            s->index[hole] = s->index[pos];
            hole = pos;
        }
    }
    s->index[hole].slot1 = 0;
}

/* ------------------------------------------------- the eviction policy
 * SIEVE (Zhang et al., NSDI '24): a FIFO list, newest at the head; a hit only
 * sets the slot's visited bit; the hand walks from the oldest towards the
 * newest, clearing visited bits, and evicts the first unvisited slot, then
 * stays there. Hits never move list entries, so they are as cheap as a
 * CLOCK hit, and new rows that are never hit again leave first. To try
 * another policy, replace these three functions. */

static void policy_hit(ple_cache *c, uint32_t slot)
{
    c->visited[slot] = 1;
}

static void policy_insert(ple_cache *c, shard *s, uint32_t slot)
{
    c->visited[slot] = 0;
    c->newer[slot] = NONE;
    c->older[slot] = s->newest;
    if (s->newest != NONE)
        c->newer[s->newest] = slot;
    s->newest = slot;
    if (s->oldest == NONE)
        s->oldest = slot;
}

/* Pick the victim and unlink it from the list; the shard is full. */
static uint32_t policy_evict(ple_cache *c, shard *s)
{
    uint32_t slot = s->hand != NONE ? s->hand : s->oldest;
    while (c->visited[slot]) {
        c->visited[slot] = 0;
        slot = c->newer[slot] != NONE ? c->newer[slot] : s->oldest;
    }
    s->hand = c->newer[slot];
    if (c->newer[slot] != NONE)
        c->older[c->newer[slot]] = c->older[slot];
    else
        s->newest = c->older[slot];
    if (c->older[slot] != NONE)
        c->newer[c->older[slot]] = c->newer[slot];
    else
        s->oldest = c->newer[slot];
    return slot;
}

/* ------------------------------------------------------ get and put */

int ple_cache_get(ple_cache *c, uint64_t key, void *dst, size_t len)
{
    uint64_t h = mix(key);
    shard *s = shard_of(c, h);
    int found;
    pthread_mutex_lock(&s->lock);
    uint32_t pos = index_find(s, key, h, &found);
    if (found) {
        uint32_t slot = s->index[pos].slot1 - 1;
        policy_hit(c, slot);
        memcpy(dst, c->slots + (size_t)slot * c->slot_bytes, len);
    }
    pthread_mutex_unlock(&s->lock);
    return found;
}

int ple_cache_put(ple_cache *c, uint64_t key, const void *src, size_t len)
{
    uint64_t h = mix(key);
    shard *s = shard_of(c, h);
    int found;
    pthread_mutex_lock(&s->lock);
    uint32_t pos = index_find(s, key, h, &found);
    uint32_t slot;
    int evicted = 0;
    if (found) {
        slot = s->index[pos].slot1 - 1;
    } else {
        if (s->used < s->nslots) {
            slot = s->base + s->used++;
        } else {
            slot = policy_evict(c, s);
            int victim_found;
            uint64_t victim = c->keys[slot];
            index_delete(s, index_find(s, victim, mix(victim), &victim_found));
            s->evictions++;
            evicted = 1;
            pos = index_find(s, key, h, &found);  /* the deletion moved entries */
        }
        c->keys[slot] = key;
        s->index[pos].key = key;
        s->index[pos].slot1 = slot + 1;
        policy_insert(c, s, slot);
        s->inserts++;
    }
    memcpy(c->slots + (size_t)slot * c->slot_bytes, src, len);
    pthread_mutex_unlock(&s->lock);
    return found ? PLE_PUT_PRESENT : evicted ? PLE_PUT_EVICTED : PLE_PUT_NEW;
}

void ple_cache_count(ple_cache *c, uint64_t hits, uint64_t misses)
{
    ple_count(&c->hits, hits);
    ple_count(&c->misses, misses);
}

void ple_cache_get_stats(ple_cache *c, ple_cache_stats *st)
{
    memset(st, 0, sizeof *st);
    st->capacity_rows = c->capacity;
    st->hits = ple_counted(&c->hits);
    st->misses = ple_counted(&c->misses);
    for (unsigned i = 0; i < c->nshards; i++) {
        shard *s = &c->shards[i];
        pthread_mutex_lock(&s->lock);
        st->used_rows += s->used;
        st->inserts += s->inserts;
        st->evictions += s->evictions;
        pthread_mutex_unlock(&s->lock);
    }
    st->reserved_bytes = c->region_size;
    st->hugetlb = c->hugetlb;
    st->thp = c->thp;
    st->mlocked = c->mlocked;
    st->shards = c->nshards;
}

int64_t ple_cache_keys(ple_cache *c, uint64_t **keys)
{
    size_t cap = 1024, n = 0;
    uint64_t *out = malloc(cap * sizeof *out);
    if (!out)
        return -1;
    for (unsigned i = 0; i < c->nshards; i++) {
        shard *s = &c->shards[i];
        pthread_mutex_lock(&s->lock);
        if (n + s->used > cap) {
            while (n + s->used > cap)
                cap *= 2;
            uint64_t *grown = realloc(out, cap * sizeof *out);
            if (!grown) {
                pthread_mutex_unlock(&s->lock);
                free(out);
                return -1;
            }
            out = grown;
        }
        memcpy(out + n, c->keys + s->base, (size_t)s->used * sizeof *out);
        n += s->used;
        pthread_mutex_unlock(&s->lock);
    }
    *keys = out;
    return (int64_t)n;
}

/* ------------------------------------------------------- setup */

static size_t align_up(size_t x, size_t a)
{
    return (x + a - 1) / a * a;
}

/* The anonymous region: hugetlb pages if the system has some reserved,
 * else a 2 MiB-aligned mapping advised to use transparent huge pages. */
static unsigned char *reserve(ple_cache *c, size_t size, int hugepages)
{
    if (hugepages) {
        size_t huge = align_up(size, HUGE_PAGE);
        void *p = mmap(NULL, huge, PROT_READ | PROT_WRITE,
                       MAP_PRIVATE | MAP_ANONYMOUS | MAP_HUGETLB, -1, 0);
        if (p != MAP_FAILED) {
            c->hugetlb = 1;
            c->region_size = huge;
            return p;
        }
        size = huge;
        unsigned char *raw = mmap(NULL, size + HUGE_PAGE, PROT_READ | PROT_WRITE,
                                  MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (raw == MAP_FAILED)
            return NULL;
        unsigned char *aligned = (unsigned char *)align_up((uintptr_t)raw, HUGE_PAGE);
        if (aligned > raw)
            munmap(raw, (size_t)(aligned - raw));
        size_t tail = (size_t)(raw + size + HUGE_PAGE - (aligned + size));
        if (tail)
            munmap(aligned + size, tail);
        c->thp = madvise(aligned, size, MADV_HUGEPAGE) == 0;
        c->region_size = size;
        return aligned;
    }
    void *p = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    c->region_size = size;
    return p == MAP_FAILED ? NULL : p;
}

ple_cache *ple_cache_open(uint64_t budget, uint32_t slot_bytes, int hugepages,
                          int lock_memory, ple_error *err)
{
    uint64_t per_row = (uint64_t)slot_bytes + PLE_CACHE_ROW_OVERHEAD;
    uint64_t capacity = budget / per_row;
    if (slot_bytes == 0 || capacity == 0 || capacity >= NONE) {
        ple_error_set(err, PLE_ERR_VALUE, 0,
                      "cache budget %llu bytes with %u-byte slots holds %llu rows; "
                      "it must hold between 1 and %u rows",
                      (unsigned long long)budget, slot_bytes,
                      (unsigned long long)capacity, NONE - 1);
        return NULL;
    }
    ple_cache *c = calloc(1, sizeof *c);
    if (!c)
        goto nomem;
    atomic_init(&c->refs, 1);
    c->slot_bytes = slot_bytes;
    while (c->shard_bits < 8 && (capacity >> (c->shard_bits + 1)) >= ROWS_PER_SHARD_MIN)
        c->shard_bits++;
    c->nshards = 1u << c->shard_bits;
    uint32_t per_shard = (uint32_t)(capacity / c->nshards);
    c->capacity = (uint64_t)per_shard * c->nshards;
    uint32_t index_size = (uint32_t)((uint64_t)per_shard * 10 / 7 + 1);

    size_t slots_size = align_up(c->capacity * slot_bytes, 64);
    size_t index_bytes = align_up((size_t)index_size * sizeof(index_entry), 64) * c->nshards;
    size_t keys_size = align_up(c->capacity * sizeof(uint64_t), 64);
    size_t links_size = align_up(c->capacity * sizeof(uint32_t), 64);
    size_t total = slots_size + index_bytes + keys_size + 2 * links_size + c->capacity;
    c->region = reserve(c, total, hugepages);
    if (!c->region) {
        free(c);
        goto nomem;
    }
    unsigned char *p = c->region;
    c->slots = p;
    p += slots_size;
    index_entry *index = (index_entry *)p;
    p += index_bytes;
    c->keys = (uint64_t *)p;
    p += keys_size;
    c->newer = (uint32_t *)p;
    p += links_size;
    c->older = (uint32_t *)p;
    p += links_size;
    c->visited = p;

    c->shards = aligned_alloc(64, align_up(sizeof(shard) * c->nshards, 64));
    if (!c->shards) {
        munmap(c->region, c->region_size);
        free(c);
        goto nomem;
    }
    size_t index_stride = align_up((size_t)index_size * sizeof(index_entry), 64)
                          / sizeof(index_entry);
    for (unsigned i = 0; i < c->nshards; i++) {
        shard *s = &c->shards[i];
        memset(s, 0, sizeof *s);
        pthread_mutex_init(&s->lock, NULL);
        s->base = i * per_shard;
        s->nslots = per_shard;
        s->index_size = index_size;
        s->index = index + i * index_stride;
        s->newest = s->oldest = s->hand = NONE;
    }
    if (lock_memory) {
        if (mlock(c->region, c->region_size) != 0) {
            int code = errno;
            ple_error_set(err, PLE_ERR_OS, code,
                          "mlock of the %zu-byte row cache failed (%s): raise RLIMIT_MEMLOCK "
                          "(LimitMEMLOCK= in the systemd unit) to at least that, or turn "
                          "mlock off", c->region_size, strerror(code));
            ple_cache_unref(c);
            return NULL;
        }
        c->mlocked = 1;
    }
    return c;
nomem:
    ple_error_set(err, PLE_ERR_NOMEM, ENOMEM, "cannot reserve %llu bytes for the row cache",
                  (unsigned long long)budget);
    return NULL;
}

uint64_t ple_cache_capacity(const ple_cache *c)
{
    return c->capacity;
}

uint32_t ple_cache_slot_bytes(const ple_cache *c)
{
    return c->slot_bytes;
}

const char *ple_cache_policy(void)
{
    return "sieve";
}

void ple_cache_ref(ple_cache *c)
{
    /* Relaxed: the caller holds a reference already. */
    atomic_fetch_add_explicit(&c->refs, 1, memory_order_relaxed);
}

void ple_cache_unref(ple_cache *c)
{
    /* Acq_rel: every user's last accesses happen before the unmap below. */
    if (atomic_fetch_sub_explicit(&c->refs, 1, memory_order_acq_rel) != 1)
        return;
    for (unsigned i = 0; i < c->nshards; i++)
        pthread_mutex_destroy(&c->shards[i].lock);
    free(c->shards);
    munmap(c->region, c->region_size);
    free(c);
}
