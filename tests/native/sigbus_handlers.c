/* Two SIGBUS handlers that chain to the one they replaced, each the way a
 * real one does, for tests/test_native_errors.py: installed over and under
 * pleserver's guard in every order, each must run exactly once before the
 * process ends.
 *
 *   restorer: a crash reporter's way (Breakpad, Crashpad): it restores the
 *             handler it replaced and returns, so a fault's access runs
 *             again and meets that handler; a sent signal is raised again.
 *   caller:   it calls the handler it replaced directly, as a function (the
 *             guard's own way); over the default action it restores that.
 *
 * Each writes its name to stderr when it runs (write(2): async-signal-safe). */
#include <signal.h>
#include <string.h>
#include <unistd.h>

static struct sigaction restorer_prev, caller_prev;

static void say(const char *what)
{
    ssize_t rc = write(2, what, strlen(what));
    (void)rc;
}

static void restorer(int sig, siginfo_t *info, void *uctx)
{
    (void)uctx;
    say("handler ran: restorer\n");
    sigaction(SIGBUS, &restorer_prev, NULL);
    if (info->si_code <= 0)
        raise(sig);
}

static void caller(int sig, siginfo_t *info, void *uctx)
{
    say("handler ran: caller\n");
    if (caller_prev.sa_flags & SA_SIGINFO) {
        caller_prev.sa_sigaction(sig, info, uctx);
    } else if (caller_prev.sa_handler != SIG_DFL && caller_prev.sa_handler != SIG_IGN) {
        caller_prev.sa_handler(sig);
    } else {
        sigaction(SIGBUS, &caller_prev, NULL);
        if (info->si_code <= 0)
            raise(sig);
    }
}

static int install(void (*fn)(int, siginfo_t *, void *), struct sigaction *prev)
{
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_sigaction = fn;
    sa.sa_flags = SA_SIGINFO;
    sigemptyset(&sa.sa_mask);
    return sigaction(SIGBUS, &sa, prev);
}

int install_restorer(void) { return install(restorer, &restorer_prev); }
int install_caller(void) { return install(caller, &caller_prev); }
