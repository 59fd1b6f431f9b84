/* The disk's random-read ceiling: aligned random reads of `block` bytes over
 * some files, `queue_depth` in flight, for a while. */
#ifndef PLE_PROBE_H
#define PLE_PROBE_H

#include <stdint.h>

#include "common.h"

typedef struct ple_probe_result {
    uint64_t reads;
    double seconds;
    int kind;  /* enum ple_engine_kind: what ran */
} ple_probe_result;

/* kind: PLE_KIND_AUTO (io_uring, else threads), PLE_KIND_IO_URING or
 * PLE_KIND_THREADS (queue_depth threads doing pread). 0, or -1 with err. */
int ple_probe_random_reads(const char *const *paths, unsigned npaths, uint32_t block,
                           unsigned queue_depth, double seconds, int direct, int kind,
                           ple_probe_result *res, ple_error *err);

#endif
