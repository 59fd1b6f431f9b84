/* The read-latency histogram's buckets (latency.h). */
#include "latency.h"

unsigned ple_latency_bucket(uint64_t ns)
{
    if (ns < 4)
        return (unsigned)ns;
    unsigned e = 63u - (unsigned)__builtin_clzll(ns);  /* ns >= 4: e >= 2 */
    unsigned b = e * 4 + (unsigned)((ns >> (e - 2)) & 3);
    return b < PLE_READ_HIST_BUCKETS ? b : PLE_READ_HIST_BUCKETS - 1;
}

uint64_t ple_latency_bucket_edge(unsigned b)
{
    if (b < 4)
        return b;
    unsigned e = b / 4;
    return ((4ULL + b % 4 + 1) << (e - 2)) - 1;
}

uint64_t ple_latency_quantile(const uint64_t *hist, uint64_t total, double q)
{
    if (total == 0)
        return 0;
    uint64_t want = (uint64_t)(q * (double)total), seen = 0;
    for (unsigned b = 0; b < PLE_READ_HIST_BUCKETS; b++) {
        seen += hist[b];
        if (seen > want)
            return ple_latency_bucket_edge(b);
    }
    return ple_latency_bucket_edge(PLE_READ_HIST_BUCKETS - 1);
}
