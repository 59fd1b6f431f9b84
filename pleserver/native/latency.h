/* The read-latency histogram's buckets: 4 per power of two of nanoseconds.
 * Bucket b >= 4 (exponent e = b / 4) holds [(4 + b % 4) << (e - 2),
 * (5 + b % 4) << (e - 2)), buckets 0..3 the values 0..3; so buckets 0 .. 4k-1
 * hold every read under 2^k ns (what the metrics endpoint exports as a
 * histogram, pleserver.observe.metrics). Pure arithmetic: the counts live
 * with whoever counts (gather.c's per-table sources). */
#ifndef PLE_LATENCY_H
#define PLE_LATENCY_H

#include <stdint.h>

#define PLE_READ_HIST_BUCKETS 256u

/* The bucket of `ns` (the last one for anything past the range). */
unsigned ple_latency_bucket(uint64_t ns);
/* The upper edge of bucket `b` (< PLE_READ_HIST_BUCKETS), in ns. */
uint64_t ple_latency_bucket_edge(unsigned b);
/* The upper edge of the bucket holding quantile q of `total` counts in
 * `hist` (PLE_READ_HIST_BUCKETS of them); 0 when total is 0. */
uint64_t ple_latency_quantile(const uint64_t *hist, uint64_t total, double q);

#endif
