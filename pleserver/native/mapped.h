/* Copies out of file mappings that survive an unreadable page.
 *
 * Touching a page of a file mapping that the kernel cannot read (an I/O
 * error of the disk, or a file truncated under its mapping) raises SIGBUS in
 * the thread that touched it, which would kill the process. The copies below
 * run under a per-thread guard: a SIGBUS whose address lies in the source of
 * the copy under way ends that copy, and the caller gets the index of the
 * copy that failed and where, to fail its request with a read error. Any
 * other SIGBUS goes on to the handlers installed before ours and over ours
 * (CPython's faulthandler in the server, ASan's under the sanitizers), each
 * once, then the default action, as if ours were not there (mapped.c: the
 * chain rule). */
#ifndef PLE_MAPPED_H
#define PLE_MAPPED_H

#include <stddef.h>

typedef struct ple_copy {
    void *dst;
    const void *src;  /* in a file mapping */
    size_t len;
} ple_copy;

/* Install the SIGBUS handler (once per process; again when another handler
 * replaced ours since, chaining to that one). 0, or -1 with errno set
 * (EOVERFLOW: more handlers were installed over ours than it chains to). */
int ple_mapped_guard_install(void);

/* Do the n copies in order. Returns n when all were done; else the index of
 * the copy whose source could not be read (those before it are done, that
 * one is partly done) and *fault the address that could not be read. Needs
 * ple_mapped_guard_install first. Not reentrant within a thread: a copy must
 * not call it again (it is only ever called by the gather). */
size_t ple_mapped_copies(const ple_copy *copies, size_t n, const void **fault);

#endif
