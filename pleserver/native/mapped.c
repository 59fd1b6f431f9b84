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
 *     SIGBUS sent by kill) goes on down the chain of handlers, as it would
 *     without us: CPython's faulthandler (which prints every thread's
 *     traceback, then restores the handler it replaced and raises again),
 *     ASan's, a crash reporter's, a plain handler, or the default action
 *     (restored, then the access runs again and the process ends as it
 *     would have).
 *
 * The chain, and the rule that keeps it from being a cycle. Ours is
 * installed once per process, and again whenever another handler has been
 * installed over it since (faulthandler enabled after the first table was
 * opened, say): the guarded copies must be ours again. That other handler
 * remembers ours as its predecessor and chains back to it when it passes a
 * signal on, either by calling it, by restoring it and raising again, or by
 * restoring it and returning so that the faulting access runs again. If ours
 * then passed on to that same handler, the signal would go round for ever
 * (the process spins, printing tracebacks). So ours keeps every handler it
 * found, in the order found (`chain`: [0] the one it first replaced, then
 * each one found over it later; each kept once), and a signal passed on goes
 * down that list once, newest first: when it comes back to us from the
 * handler at one level, ours passes it to the next level below, and past the
 * last one it takes the default action. "Comes back" is known per thread: a
 * call into ours while this thread is inside a handler ours called (a direct
 * call, or a raise), or a kernel fault at the same address as the fault this
 * thread last passed on (the access run again). So every handler in the
 * chain runs once and the process ends as it would without the guard, in
 * any order of installation. The limit: a handler that repairs a fault and
 * returns is skipped for a later fault at the very same address.
 *
 * The handler is installed with SA_NODEFER and an empty mask, so a jump out
 * of it leaves the thread's signal mask as it was: sigsetjmp need not save
 * the mask (a system call per guard). SA_ONSTACK: a thread with an alternate
 * signal stack (faulthandler gives the main thread one) runs it there.
 *
 * Ordering: the guard's fields are written by the thread the handler
 * interrupts, so a signal fence (a compiler barrier) is all they need: the
 * range is stored before the copy can touch it. */
#include <errno.h>
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

/* The handlers ours found installed, oldest first (see the chain rule
 * above). Entries are appended under install_lock and never changed after;
 * an entry is published by the release store of chain_len (I1), and the
 * handler reads only entries below the count it loaded with acquire (H1,
 * pairs with I1), so a handler running on another thread during an install
 * sees whole entries. */
#define CHAIN_MAX 8
static struct sigaction chain[CHAIN_MAX];
static atomic_int chain_len;

/* Where this thread's last passed-on signal went (see the chain rule). */
static _Thread_local int pass_depth __attribute__((tls_model("initial-exec")));  /* inside a chained handler */
static _Thread_local int pass_level __attribute__((tls_model("initial-exec")));  /* the chain level it went to */
static _Thread_local int pass_fault_valid __attribute__((tls_model("initial-exec")));
static _Thread_local const void *pass_fault __attribute__((tls_model("initial-exec")));  /* its address, for a kernel fault */

static int same_handler(const struct sigaction *a, const struct sigaction *b)
{
    if ((a->sa_flags & SA_SIGINFO) != (b->sa_flags & SA_SIGINFO))
        return 0;
    return (a->sa_flags & SA_SIGINFO) ? a->sa_sigaction == b->sa_sigaction : a->sa_handler == b->sa_handler;
}

/* The default action, as without us: restore it; a fault runs its access
 * again on return and ends the process, a sent signal is raised again
 * (delivered at once: ours runs with SA_NODEFER). */
static void default_action(const siginfo_t *info)
{
    struct sigaction dfl;
    memset(&dfl, 0, sizeof dfl);
    dfl.sa_handler = SIG_DFL;
    sigemptyset(&dfl.sa_mask);
    sigaction(SIGBUS, &dfl, NULL);
    if (info->si_code <= 0)
        raise(SIGBUS);
}

static void pass_on(int sig, siginfo_t *info, void *uctx)
{
    int back = pass_depth > 0 || (info->si_code > 0 && pass_fault_valid && info->si_addr == pass_fault);
    int level = back ? pass_level + 1 : 0;
    int n = atomic_load_explicit(&chain_len, memory_order_acquire);  /* H1: pairs with I1 */
    if (level >= n) {  /* every handler below ours has had it */
        pass_fault_valid = 0;
        default_action(info);
        return;
    }
    const struct sigaction *next = &chain[n - 1 - level];
    pass_level = level;
    pass_fault_valid = info->si_code > 0;
    pass_fault = info->si_addr;
    if (next->sa_flags & SA_SIGINFO) {
        pass_depth++;
        next->sa_sigaction(sig, info, uctx);
        pass_depth--;
        return;
    }
    if (next->sa_handler != SIG_DFL && next->sa_handler != SIG_IGN) {
        pass_depth++;
        next->sa_handler(sig);
        pass_depth--;
        return;
    }
    if (next->sa_handler == SIG_IGN && info->si_code <= 0)
        return;  /* sent by a process, ignored before we came */
    pass_fault_valid = 0;
    default_action(info);
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
        int n = atomic_load_explicit(&chain_len, memory_order_relaxed);  /* written under install_lock only */
        int known = 0;
        for (int k = 0; k < n; k++)
            known |= same_handler(&chain[k], &now);
        if (!known) {
            if (n == CHAIN_MAX) {
                pthread_mutex_unlock(&install_lock);
                errno = EOVERFLOW;  /* more handlers installed over ours than it can chain to */
                return -1;
            }
            chain[n] = now;
            atomic_store_explicit(&chain_len, n + 1, memory_order_release);  /* I1: the entry, then the count */
        }
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
