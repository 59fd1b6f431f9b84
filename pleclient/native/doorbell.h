/* The doorbell scan of a GPU-driven channel: which of its slots a stream rang
 * (pleclient/protocol.py, "GPU-driven channels"). */
#ifndef PLECLIENT_DOORBELL_H
#define PLECLIENT_DOORBELL_H

#include <stddef.h>
#include <stdint.h>

#define PLE_DOORBELL_SCAN_MAX 64 /* one bit of the answer per word */

/* Bit i of the result is set where the 32-bit word at first + i·stride equals
 * value, for i < count (≤ PLE_DOORBELL_SCAN_MAX). Each word is read once,
 * with acquire ordering. The caller has checked that every word is 4-byte
 * aligned and inside its buffer. */
uint64_t ple_doorbell_scan(char *first, size_t stride, unsigned count, uint32_t value);

#endif
