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
 * tombstones), its SIEVE list and hand, and a mutex that writers hold.
 * Lookups first try without the mutex, under the shard's sequence count
 * (get_optimistic); so the index entries, slot words and visited bits, which
 * such readers touch, are relaxed atomics (plain loads and stores on x86-64
 * and aarch64), and everything else (slot keys, list links, counters) is
 * touched only under the mutex. */
#include <errno.h>
#include <pthread.h>
#include <stdalign.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "rowcache.h"

#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23  /* Linux 5.14 */
#endif

#define NONE UINT32_MAX
#define POPULATE_CHUNK (64u << 20)
#define HUGE_PAGE (2u << 20)
#define ROWS_PER_SHARD_MIN 64u
#define SHARDS_MAX 256u

/* Index entries are written only under the shard's mutex, but they are also
 * read without it by ple_cache_prefetch_row, as a hint: so both fields are
 * atomics, all accessed RELAXED (under the mutex the mutex orders them; the
 * hint needs no ordering, it is checked under the mutex before any use). On
 * x86-64 and aarch64 these are plain loads and stores. */
typedef struct index_entry {
    _Atomic uint64_t key;
    _Atomic uint32_t slot1;  /* slot + 1; 0 = empty (zeroed memory is an empty index) */
    uint32_t unused;
} index_entry;

#define LOAD(field) atomic_load_explicit(&(field), memory_order_relaxed)
#define STORE(field, value) atomic_store_explicit(&(field), (value), memory_order_relaxed)

typedef struct shard {
    alignas(64) pthread_mutex_t lock;
    uint32_t base, nslots, used;  /* slots [base, base + nslots); used fill in order */
    uint32_t index_size;
    index_entry *index;
    uint32_t newest, oldest, hand;  /* SIEVE list (slot numbers), NONE = empty */
    /* Sequence count for lock-free readers: odd while a writer (holding the
     * mutex) changes the index or a slot. See ple_cache_get_prepared. */
    _Atomic uint32_t seq;
    uint64_t inserts, evictions;
} shard;

struct ple_cache {
    _Atomic unsigned refs;
    _Atomic uint64_t hits, misses;
    uint32_t slot_bytes;
    uint32_t slot_words;     /* a slot's stride, in 8-byte words */
    uint64_t capacity;
    unsigned shard_bits;
    shard *shards;
    unsigned nshards;
    unsigned char *region;   /* the mapping */
    size_t region_size;
    _Atomic uint64_t *slots; /* capacity * slot_words: see slot_read */
    uint64_t *keys;          /* per slot */
    uint32_t *newer, *older; /* per slot: SIEVE list links */
    _Atomic unsigned char *visited;  /* per slot: SIEVE visited bit (relaxed) */
    int hugetlb, thp, mlocked;
    /* Background commit of the region (see populate): relaxed atomics, the
     * join in unref orders the thread's end before the unmap. */
    pthread_t populator;
    int populating;
    _Atomic int stop_populating;
    _Atomic uint64_t populated;
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
    while (LOAD(s->index[pos].slot1)) {
        if (LOAD(s->index[pos].key) == key) {
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
        uint32_t slot1 = LOAD(s->index[pos].slot1);
        if (!slot1)
            break;
        uint64_t key = LOAD(s->index[pos].key);
        uint32_t home = home_of(s, mix(key));
        /* The entry may move to `hole` unless its home lies cyclically in
         * (hole, pos]. */
        int stays = hole <= pos ? (home > hole && home <= pos) : (home > hole || home <= pos);
        if (!stays) {
            STORE(s->index[hole].key, key);
            STORE(s->index[hole].slot1, slot1);
            hole = pos;
        }
    }
    STORE(s->index[hole].slot1, 0);
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
    if (!LOAD(c->visited[slot]))  /* no store (and no dirty line) when set already */
        STORE(c->visited[slot], 1);
}

static void policy_insert(ple_cache *c, shard *s, uint32_t slot)
{
    STORE(c->visited[slot], 0);
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
    while (LOAD(c->visited[slot])) {
        STORE(c->visited[slot], 0);
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

void ple_cache_prepare(ple_cache *c, uint64_t key, ple_cache_probe *p)
{
    p->key = key;
    p->hash = mix(key);
    const shard *s = shard_of(c, p->hash);
    __builtin_prefetch(&s->index[home_of(s, p->hash)]);
}

void ple_cache_prefetch_row(ple_cache *c, const ple_cache_probe *p)
{
    const shard *s = shard_of(c, p->hash);
    uint32_t pos = home_of(s, p->hash);
    for (int probes = 0; probes < 8; probes++) {  /* bounded: entries move meanwhile */
        uint32_t slot1 = LOAD(s->index[pos].slot1);
        if (!slot1)
            return;
        if (LOAD(s->index[pos].key) == p->key) {
            const unsigned char *row =
                (const unsigned char *)(c->slots + (size_t)(slot1 - 1) * c->slot_words);
            for (uint32_t at = 0; at < c->slot_bytes; at += 64)
                __builtin_prefetch(row + at);
            __builtin_prefetch(row + c->slot_bytes - 1);
            return;
        }
        pos = pos + 1 == s->index_size ? 0 : pos + 1;
    }
}

int ple_cache_get(ple_cache *c, uint64_t key, void *dst, size_t len)
{
    ple_cache_probe p = {key, mix(key)};
    return ple_cache_get_prepared(c, &p, dst, len);
}

/* Slot bytes are relaxed atomic 8-byte words, so that a lock-free reader
 * racing with a writer is defined behaviour (it then retries, see below). On
 * x86-64 and aarch64 these are plain loads and stores. */
static void slot_read(const ple_cache *c, uint32_t slot, void *dst, size_t len)
{
    _Atomic uint64_t *w = c->slots + (size_t)slot * c->slot_words;
    unsigned char *out = dst;
    size_t words = len / 8, i = 0;
    for (; i < words; i++) {
        uint64_t v = atomic_load_explicit(&w[i], memory_order_relaxed);
        memcpy(out + 8 * i, &v, 8);
    }
    if (len % 8) {
        uint64_t v = atomic_load_explicit(&w[i], memory_order_relaxed);
        memcpy(out + 8 * i, &v, len % 8);
    }
}

static void slot_write(ple_cache *c, uint32_t slot, const void *src, size_t len)
{
    _Atomic uint64_t *w = c->slots + (size_t)slot * c->slot_words;
    const unsigned char *in = src;
    size_t words = len / 8, i = 0;
    for (; i < words; i++) {
        uint64_t v;
        memcpy(&v, in + 8 * i, 8);
        atomic_store_explicit(&w[i], v, memory_order_relaxed);
    }
    if (len % 8) {
        uint64_t v = 0;
        memcpy(&v, in + 8 * i, len % 8);
        atomic_store_explicit(&w[i], v, memory_order_relaxed);
    }
}

/* A lookup without the mutex (a sequence lock, as in Boehm, "Can seqlocks
 * get along with programming language memory models?", 2012): read the
 * shard's sequence (ACQUIRE), look up and copy with relaxed loads, then an
 * ACQUIRE fence and the sequence again (relaxed). Equal and even: no writer
 * touched the shard meanwhile, so the answer is right. Returns 0 when it
 * cannot tell (a writer was active, or a probe ran long). A hit needs no
 * atomic read-modify-write, so lookups of a batch overlap their memory
 * misses and several threads read one shard without bouncing a lock. */
static int get_optimistic(ple_cache *c, shard *s, const ple_cache_probe *p, void *dst,
                          size_t len, int *found)
{
    uint32_t before = atomic_load_explicit(&s->seq, memory_order_acquire);
    if (before & 1)
        return 0;
    uint32_t pos = home_of(s, p->hash), slot1 = 0;
    int probes = 0;
    for (;; probes++) {
        if (probes == 64)
            return 0;
        uint32_t v = LOAD(s->index[pos].slot1);
        if (!v)
            break;
        if (LOAD(s->index[pos].key) == p->key) {
            slot1 = v;
            break;
        }
        pos = pos + 1 == s->index_size ? 0 : pos + 1;
    }
    if (slot1)  /* any value ever stored is a slot of this shard: in bounds */
        slot_read(c, slot1 - 1, dst, len);
    atomic_thread_fence(memory_order_acquire);
    if (atomic_load_explicit(&s->seq, memory_order_relaxed) != before)
        return 0;
    if (slot1)
        policy_hit(c, slot1 - 1);
    *found = slot1 != 0;
    return 1;
}

int ple_cache_get_prepared(ple_cache *c, const ple_cache_probe *p, void *dst, size_t len)
{
    uint64_t key = p->key, h = p->hash;
    shard *s = shard_of(c, h);
    int found;
    if (get_optimistic(c, s, p, dst, len, &found))
        return found;
    pthread_mutex_lock(&s->lock);
    uint32_t pos = index_find(s, key, h, &found);
    if (found) {
        uint32_t slot = LOAD(s->index[pos].slot1) - 1;
        policy_hit(c, slot);
        slot_read(c, slot, dst, len);
    }
    pthread_mutex_unlock(&s->lock);
    return found;
}

int ple_cache_contains(ple_cache *c, const ple_cache_probe *p)
{
    shard *s = shard_of(c, p->hash);
    int found;
    pthread_mutex_lock(&s->lock);
    (void)index_find(s, p->key, p->hash, &found);
    pthread_mutex_unlock(&s->lock);
    return found;
}

int ple_cache_put(ple_cache *c, uint64_t key, const void *src, size_t len)
{
    uint64_t h = mix(key);
    shard *s = shard_of(c, h);
    int found;
    pthread_mutex_lock(&s->lock);
    /* Odd while we write (relaxed: we are the only writer, under the mutex);
     * the RELEASE fence orders it before our index and slot stores, the
     * RELEASE store of the even value orders those stores before it. */
    uint32_t seq = atomic_load_explicit(&s->seq, memory_order_relaxed);
    atomic_store_explicit(&s->seq, seq + 1, memory_order_relaxed);
    atomic_thread_fence(memory_order_release);
    uint32_t pos = index_find(s, key, h, &found);
    uint32_t slot;
    int evicted = 0;
    if (found) {
        slot = LOAD(s->index[pos].slot1) - 1;
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
        STORE(s->index[pos].key, key);
        STORE(s->index[pos].slot1, slot + 1);
        policy_insert(c, s, slot);
        s->inserts++;
    }
    slot_write(c, slot, src, len);
    atomic_store_explicit(&s->seq, seq + 2, memory_order_release);
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
    st->populated_bytes = atomic_load_explicit(&c->populated, memory_order_relaxed);
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

/* Commit the whole region in the background, 64 MiB at a time, with
 * MADV_POPULATE_WRITE (which faults pages in without touching their bytes,
 * so it may run while the cache is in use). Without it the first requests
 * after a start would each pay for zeroing fresh (huge) pages. Kernels
 * before 5.14 refuse the advice: pages are then committed on first use. */
static void *populate(void *arg)
{
    ple_cache *c = arg;
    /* Lowest priority (nice is per thread on Linux): committing gigabytes
     * must not take CPU time from requests. Failure only costs that. */
    setpriority(PRIO_PROCESS, (id_t)syscall(SYS_gettid), 19);
    for (size_t off = 0; off < c->region_size; off += POPULATE_CHUNK) {
        if (atomic_load_explicit(&c->stop_populating, memory_order_relaxed))
            break;
        size_t len = c->region_size - off < POPULATE_CHUNK ? c->region_size - off
                                                          : POPULATE_CHUNK;
        if (madvise(c->region + off, len, MADV_POPULATE_WRITE) != 0)
            break;
        atomic_fetch_add_explicit(&c->populated, len, memory_order_relaxed);
    }
    return NULL;
}

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
    uint32_t slot_words = (slot_bytes + 7) / 8;
    uint64_t per_row = (uint64_t)slot_words * 8 + PLE_CACHE_ROW_OVERHEAD;
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
    c->slot_words = slot_words;
    while (c->shard_bits < 8 && (capacity >> (c->shard_bits + 1)) >= ROWS_PER_SHARD_MIN)
        c->shard_bits++;
    c->nshards = 1u << c->shard_bits;
    uint32_t per_shard = (uint32_t)(capacity / c->nshards);
    c->capacity = (uint64_t)per_shard * c->nshards;
    uint32_t index_size = (uint32_t)((uint64_t)per_shard * 10 / 7 + 1);

    size_t slots_size = align_up(c->capacity * slot_words * 8, 64);
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
    c->slots = (_Atomic uint64_t *)p;
    p += slots_size;
    index_entry *index = (index_entry *)p;
    p += index_bytes;
    c->keys = (uint64_t *)p;
    p += keys_size;
    c->newer = (uint32_t *)p;
    p += links_size;
    c->older = (uint32_t *)p;
    p += links_size;
    c->visited = (_Atomic unsigned char *)p;

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
        atomic_store_explicit(&c->populated, c->region_size, memory_order_relaxed);
    } else {
        c->populating = pthread_create(&c->populator, NULL, populate, c) == 0;
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
    if (c->populating) {
        atomic_store_explicit(&c->stop_populating, 1, memory_order_relaxed);
        pthread_join(c->populator, NULL);
    }
    for (unsigned i = 0; i < c->nshards; i++)
        pthread_mutex_destroy(&c->shards[i].lock);
    free(c->shards);
    munmap(c->region, c->region_size);
    free(c);
}
