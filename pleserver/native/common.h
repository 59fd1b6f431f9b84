/* Shared definitions of the native data plane: the error record every
 * entry point fills, the block size of the miss engine, small helpers.
 *
 * Errors travel as a ple_error filled by the native code without the GIL;
 * module.c is the one place that turns it into a Python exception. */
#ifndef PLE_COMMON_H
#define PLE_COMMON_H

#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <time.h>

/* Reads are whole aligned blocks: O_DIRECT wants buffer, offset and length
 * aligned to the logical block size, and 4 KiB covers every device. */
#define PLE_BLOCK 4096u

enum ple_error_kind {
    PLE_OK = 0,
    PLE_ERR_VALUE,  /* bad argument: ValueError */
    PLE_ERR_NOMEM,  /* MemoryError */
    PLE_ERR_OS,     /* OSError(code, msg) */
    PLE_ERR_READ,   /* ReadError(code, msg): names file, offset and strerror */
};

typedef struct ple_error {
    int kind;   /* enum ple_error_kind */
    int code;   /* errno for PLE_ERR_OS / PLE_ERR_READ */
    char msg[512];
} ple_error;

/* Record an error (printf-style message); the first error recorded wins. */
void ple_error_set(ple_error *err, int kind, int code, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));

static inline uint64_t ple_now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

/* Statistics counters are relaxed atomics: each is a sum read on its own,
 * nothing is published through them, so no ordering is needed. */
static inline void ple_count(_Atomic uint64_t *counter, uint64_t n)
{
    if (n)
        atomic_fetch_add_explicit(counter, n, memory_order_relaxed);
}

static inline uint64_t ple_counted(const _Atomic uint64_t *counter)
{
    return atomic_load_explicit(counter, memory_order_relaxed);
}

#endif
