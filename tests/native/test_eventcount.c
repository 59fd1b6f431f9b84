/* The eventcount (pleclient/native/eventcount.c) between threads, built and
 * run under ASan + UBSan and under TSan by tests/test_native_eventcount.py.
 *
 *   test_eventcount ROUNDS
 *
 * 1. Ping-pong: two threads hand a token back and forth ROUNDS times through
 *    two eventcounts, without spinning, so a hand-off the waiter has not seen
 *    yet goes through the futex. Before each publish the publisher writes a
 *    plain int, the payload, and the waiter reads it after its wait: E1/E2
 *    must order it (TSan reports the race otherwise), and it must hold the
 *    value published. A lost wake-up leaves a waiter asleep until its
 *    timeout, and the test fails there, naming the round.
 * 2. The same, with a spin before each sleep (the waits that end spinning).
 * 3. Broadcast: one publisher, WAITERS threads waiting on the same word for
 *    each of ROUNDS / 10 values, all registered in one waiters word.
 * 4. Timeout: a wait on a word nobody publishes returns the unchanged value
 *    after its timeout, and leaves the waiters word as it found it.
 * 5. A waiters word scribbled to any number: publish makes one wake call,
 *    and a wait still ends when the word moves.
 *
 * Exit 0 when all hold; otherwise 1, with what failed on stderr. */
#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "eventcount.h"

#ifndef WAIT_NS
#define WAIT_NS (20LL * 1000000000) /* a wait this long is a lost wake-up */
#endif
#define WAITERS 4

static int failed;

#define CHECK(cond, ...)                                                     \
    do {                                                                     \
        if (!(cond)) {                                                       \
            fprintf(stderr, "%s:%d: ", __FILE__, __LINE__);                  \
            fprintf(stderr, __VA_ARGS__);                                    \
            fputc('\n', stderr);                                             \
            __atomic_store_n(&failed, 1, __ATOMIC_RELAXED);                  \
            return NULL;                                                     \
        }                                                                    \
    } while (0)

static int64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

/* Waits while *word == old; the value that ended the wait, which must be new. */
static int wait_for(atomic_uint *word, atomic_uint *waiters, uint32_t old, int64_t spin_ns,
                    uint32_t *seen)
{
    int rc = ple_ec_wait_while(word, old, waiters, WAIT_NS, spin_ns, seen);
    return rc == 0 && *seen != old;
}

/* ---------------------------------------------------------------- ping-pong */
struct pingpong {
    atomic_uint ping, ping_waiters, pong, pong_waiters;
    int payload; /* plain: ordered by E1/E2 alone */
    unsigned rounds;
    int64_t spin_ns;
};

static void *ping_side(void *arg)
{
    struct pingpong *pp = arg;
    uint32_t seen;
    for (unsigned k = 1; k <= pp->rounds; k++) {
        pp->payload = (int)k;
        ple_ec_publish(&pp->ping, k, &pp->ping_waiters);
        CHECK(wait_for(&pp->pong, &pp->pong_waiters, k - 1, pp->spin_ns, &seen),
              "ping-pong round %u: no pong within %lld s (a lost wake-up), word %u", k,
              WAIT_NS / 1000000000, seen);
        CHECK(seen == k, "ping-pong round %u: pong is %u", k, seen);
        CHECK(pp->payload == -(int)k, "ping-pong round %u: payload %d after pong", k,
              pp->payload);
    }
    return NULL;
}

static void *pong_side(void *arg)
{
    struct pingpong *pp = arg;
    uint32_t seen;
    for (unsigned k = 1; k <= pp->rounds; k++) {
        CHECK(wait_for(&pp->ping, &pp->ping_waiters, k - 1, pp->spin_ns, &seen),
              "ping-pong round %u: no ping within %lld s (a lost wake-up), word %u", k,
              WAIT_NS / 1000000000, seen);
        CHECK(seen == k, "ping-pong round %u: ping is %u", k, seen);
        CHECK(pp->payload == (int)k, "ping-pong round %u: payload %d after ping", k,
              pp->payload);
        pp->payload = -(int)k;
        ple_ec_publish(&pp->pong, k, &pp->pong_waiters);
    }
    return NULL;
}

static void ping_pong(unsigned rounds, int64_t spin_ns)
{
    struct pingpong pp;
    memset(&pp, 0, sizeof pp);
    pp.rounds = rounds;
    pp.spin_ns = spin_ns;
    pthread_t a, b;
    pthread_create(&b, NULL, pong_side, &pp);
    pthread_create(&a, NULL, ping_side, &pp);
    pthread_join(a, NULL);
    pthread_join(b, NULL);
    if (atomic_load(&pp.ping_waiters) != 0 || atomic_load(&pp.pong_waiters) != 0) {
        fprintf(stderr, "ping-pong: waiters words %u and %u after every wait ended\n",
                atomic_load(&pp.ping_waiters), atomic_load(&pp.pong_waiters));
        failed = 1;
    }
}

/* ---------------------------------------------------------------- broadcast */
struct broadcast {
    atomic_uint word, waiters;
    int payload;
    unsigned rounds;
    pthread_barrier_t round_over;
};

static void *broadcast_waiter(void *arg)
{
    struct broadcast *bc = arg;
    uint32_t seen;
    for (unsigned k = 1; k <= bc->rounds; k++) {
        int ok = wait_for(&bc->word, &bc->waiters, k - 1, 0, &seen);
        int payload = bc->payload;
        pthread_barrier_wait(&bc->round_over); /* every round, failed or not */
        if (!ok || seen != k || payload != (int)k) {
            fprintf(stderr, "broadcast round %u: %s, word %u, payload %d\n", k,
                    ok ? "wrong value" : "no wake-up in time (a lost wake-up)", seen, payload);
            __atomic_store_n(&failed, 1, __ATOMIC_RELAXED);
        }
    }
    return NULL;
}

static void broadcast(unsigned rounds)
{
    struct broadcast bc;
    memset(&bc, 0, sizeof bc);
    bc.rounds = rounds;
    pthread_barrier_init(&bc.round_over, NULL, WAITERS + 1);
    pthread_t waiters[WAITERS];
    for (int i = 0; i < WAITERS; i++)
        pthread_create(&waiters[i], NULL, broadcast_waiter, &bc);
    for (unsigned k = 1; k <= rounds; k++) {
        bc.payload = (int)k;
        ple_ec_publish(&bc.word, k, &bc.waiters);
        pthread_barrier_wait(&bc.round_over); /* every waiter saw k */
    }
    for (int i = 0; i < WAITERS; i++)
        pthread_join(waiters[i], NULL);
    pthread_barrier_destroy(&bc.round_over);
}

/* ------------------------------------------------- timeout, scribbled waiters */
static void *timeout_and_scribbles(void *arg)
{
    (void)arg;
    atomic_uint word = 7, waiters = 0;
    uint32_t seen = 0;
    int64_t start = now_ns();
    int rc = ple_ec_wait_while(&word, 7, &waiters, 50 * 1000000LL, 1000000, &seen);
    int64_t waited = now_ns() - start;
    CHECK(rc == 0 && seen == 7, "timeout: rc %d, word %u", rc, seen);
    CHECK(waited >= 50 * 1000000LL, "timeout: returned after %lld ns", (long long)waited);
    CHECK(atomic_load(&waiters) == 0, "timeout: waiters word %u", atomic_load(&waiters));
    rc = ple_ec_wait_while(&word, 7, &waiters, 0, 0, &seen);
    CHECK(rc == 0 && seen == 7, "a zero timeout: rc %d, word %u", rc, seen);
    rc = ple_ec_wait_while(&word, 6, &waiters, WAIT_NS, 0, &seen);
    CHECK(rc == 0 && seen == 7, "a word that differs already: rc %d, word %u", rc, seen);

    atomic_store(&waiters, 0xFFFFFFF0u); /* a peer's scribble */
    CHECK(ple_ec_publish(&word, 8, &waiters) == 1, "publish with a scribbled waiters word");
    CHECK(ple_ec_wake(&word, 1) == 0, "a wake with no sleeper woke someone");
    return NULL;
}

int main(int argc, char **argv)
{
    unsigned rounds = argc > 1 ? (unsigned)strtoul(argv[1], NULL, 10) : 20000;
    if (rounds < 10) {
        fprintf(stderr, "usage: %s ROUNDS (at least 10)\n", argv[0]);
        return 2;
    }
    timeout_and_scribbles(NULL);
    ping_pong(rounds, 0);
    ping_pong(rounds / 10, 20000);
    broadcast(rounds / 10);
    if (failed)
        return 1;
    printf("eventcount: %u ping-pong rounds, %u spinning, %u broadcasts to %d waiters: "
           "no lost wake-up\n", rounds, rounds / 10, rounds / 10, WAITERS);
    return 0;
}
