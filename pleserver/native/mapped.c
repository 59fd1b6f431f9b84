/* Copies out of file mappings that survive an unreadable page (see mapped.h).
 *
 * Why a signal handler, and not pread or mincore: the mapping is the fast
 * path of mmap mode (a hit costs a memcpy), a page can leave the page cache
 * between any check and the copy, and the kernel reports a page it cannot
 * read only by SIGBUS. So the copy runs as is, and a thread that copies
 * arms a guard first:
 *
 *   - a guard lives on the copying thread's stack: a sigjmp_buf and the
 *     source range being copied. The thread's pointer to it is thread-local
 *     (initial-exec: reading it in the handler is one load from the thread
 *     pointer, no allocation, async-signal-safe);
 *   - SIGBUS is synchronous: it is delivered to the thread whose access
 *     faulted, on that access. The handler looks at that thread's guard only;
 *     when the fault came from the kernel (si_code > 0) at an address inside
 *     the range being copied, it disarms the guard and siglongjmps back to
 *     the copy's start, which reports the failure. Nothing is held across
 *     the copy (no lock, no allocation), so leaving it in the middle is safe;
 *   - anything else (another address, another thread without a guard, a
 *     SIGBUS sent by kill) goes to the handler installed before ours, as it
 *     would without us: CPython's faulthandler (which prints every thread's
 *     traceback, then restores the default and raises it again), ASan's, a
 *     plain handler, or the default action (the handler restores it and
 *     returns: the access runs again and the process ends as it would have).
 *
 * The handler is installed with SA_NODEFER and an empty mask, so a jump out
 * of it leaves the thread's signal mask as it was: sigsetjmp need not save
 * the mask (a system call per guard). SA_ONSTACK: a thread with an alternate
 * signal stack (faulthandler gives the main thread one) runs it there.
 *
 * Ordering: the guard's fields are written by the thread the handler
 * interrupts, so a signal fence (a compiler barrier) is all they need: the
 * range is stored before the copy can touch it. */
#include <pthread.h>
#include <setjmp.h>
#include <signal.h>
#include <stdatomic.h>
#include <string.h>

#include "mapped.h"

typedef struct guard {
    sigjmp_buf env;
    const char *volatile lo, *volatile hi;  /* the source of the copy under way */
    const void *volatile fault;             /* set by the handler */
} guard;

static _Thread_local guard *volatile current_guard __attribute__((tls_model("initial-exec")));

static pthread_mutex_t install_lock = PTHREAD_MUTEX_INITIALIZER;
/* The handler ours replaced; written under install_lock while ours is not
 * installed, read by the handler. */
static struct sigaction previous;

static void pass_on(int sig, siginfo_t *info, void *uctx)
{
    if (previous.sa_flags & SA_SIGINFO) {
        previous.sa_sigaction(sig, info, uctx);
        return;
    }
    if (previous.sa_handler != SIG_DFL && previous.sa_handler != SIG_IGN) {
        previous.sa_handler(sig);
        return;
    }
    if (previous.sa_handler == SIG_IGN && info->si_code <= 0)
        return;  /* sent by a process, ignored before we came */
    /* The default action, as without us: restore it; a fault runs its access
     * again on return and ends the process, a sent signal is raised again
     * (delivered once we return). */
    struct sigaction dfl;
    memset(&dfl, 0, sizeof dfl);
    dfl.sa_handler = SIG_DFL;
    sigemptyset(&dfl.sa_mask);
    sigaction(SIGBUS, &dfl, NULL);
    if (info->si_code <= 0)
        raise(SIGBUS);
}

static void on_sigbus(int sig, siginfo_t *info, void *uctx)
{
    guard *g = current_guard;
    const char *at = info->si_addr;
    if (g && info->si_code > 0 && at >= g->lo && at < g->hi) {
        g->fault = at;
        current_guard = NULL;
        siglongjmp(g->env, 1);
    }
    pass_on(sig, info, uctx);
}

int ple_mapped_guard_install(void)
{
    int rc = 0;
    pthread_mutex_lock(&install_lock);
    struct sigaction now;
    if (sigaction(SIGBUS, NULL, &now) != 0) {
        rc = -1;
    } else if (!((now.sa_flags & SA_SIGINFO) && now.sa_sigaction == on_sigbus)) {
        previous = now;
        struct sigaction ours;
        memset(&ours, 0, sizeof ours);
        ours.sa_sigaction = on_sigbus;
        ours.sa_flags = SA_SIGINFO | SA_NODEFER | SA_ONSTACK;
        sigemptyset(&ours.sa_mask);
        rc = sigaction(SIGBUS, &ours, NULL);
    }
    pthread_mutex_unlock(&install_lock);
    return rc;
}

size_t ple_mapped_copies(const ple_copy *copies, size_t n, const void **fault)
{
    guard g;
    volatile size_t i = 0;  /* read after a jump back: volatile (C11 7.13.2.1) */
    g.lo = g.hi = NULL;
    g.fault = NULL;
    if (sigsetjmp(g.env, 0) != 0) {  /* from on_sigbus: copy i hit an unreadable page */
        *fault = g.fault;
        return i;
    }
    current_guard = &g;
    for (; i < n; i++) {
        g.lo = copies[i].src;
        g.hi = (const char *)copies[i].src + copies[i].len;
        atomic_signal_fence(memory_order_seq_cst);  /* the range, before the copy */
        memcpy(copies[i].dst, copies[i].src, copies[i].len);
    }
    atomic_signal_fence(memory_order_seq_cst);  /* the copies, before disarming */
    current_guard = NULL;
    return n;
}
