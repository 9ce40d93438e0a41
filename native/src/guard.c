/*
 * guard.c: SIGBUS-proof access to a usage file for the agent (see guard.h).
 *
 * Why a zero page and not siglongjmp: jumping out of region.c would leave
 * what the interrupted function holds (the mapping and descriptor that
 * map_usage has not yet stored in the region, a slot's lock in reclaim)
 * behind. Mapping a private zero page over the faulting page lets the
 * function finish on its own: zeros fail the header checks, read as free
 * slots and empty counters, and every cleanup path runs as usual.
 *
 * A fault is ours only when it is a BUS_ADRERR (an access past the end of a
 * file mapping), raised on a thread inside a guarded call, at an address in
 * the range that call maps (while opening, the mapping is not known yet, and
 * region_open touches no other file mapping). Everything else is passed to
 * the previous handler; if that returns from a fault the kernel raised, the
 * default action is restored so the fault is fatal, as it was without us.
 *
 * Must not: be compiled into the preload library (a tenant's process keeps
 * its own signal handling), allocate or lock in the handler.
 */
#define _GNU_SOURCE
#include "guard.h"

#include <errno.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdint.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

#define GUARD_THREADS 64

struct guard_thread {
    _Atomic long tid; /* 0: free */
    _Atomic uintptr_t lo;
    _Atomic uintptr_t hi;
    _Atomic int faulted;
};

static struct guard_thread guarded[GUARD_THREADS];
static struct sigaction previous; /* the handler ours replaced, chained to */
static pthread_mutex_t install_lock = PTHREAD_MUTEX_INITIALIZER;
static _Atomic uintptr_t page_mask;
static _Atomic uint64_t fault_count;

static long current_tid(void)
{
    return syscall(SYS_gettid);
}

static void default_action(int sig)
{
    struct sigaction dfl;
    memset(&dfl, 0, sizeof(dfl));
    dfl.sa_handler = SIG_DFL;
    sigemptyset(&dfl.sa_mask);
    sigaction(sig, &dfl, NULL);
}

static void chain(int sig, siginfo_t *info, void *context)
{
    struct sigaction prev = previous;
    if (prev.sa_flags & SA_SIGINFO) {
        if (prev.sa_sigaction)
            prev.sa_sigaction(sig, info, context);
    } else if (prev.sa_handler != SIG_DFL && prev.sa_handler != SIG_IGN && prev.sa_handler) {
        prev.sa_handler(sig);
    }
    /* Returning from a kernel-raised fault runs the faulting instruction
     * again: let the default action have it then, never loop. */
    if (info->si_code > 0)
        default_action(sig);
}

static void on_sigbus(int sig, siginfo_t *info, void *context)
{
    int saved_errno = errno;
    if (info->si_code == BUS_ADRERR) {
        long tid = current_tid();
        uintptr_t addr = (uintptr_t)info->si_addr;
        for (int i = 0; i < GUARD_THREADS; i++) {
            struct guard_thread *g = &guarded[i];
            if (atomic_load(&g->tid) != tid)
                continue;
            if (addr < atomic_load(&g->lo) || addr >= atomic_load(&g->hi))
                break;
            void *page = (void *)(addr & atomic_load(&page_mask));
            void *zero = mmap(page, (size_t)(~atomic_load(&page_mask) + 1), PROT_READ | PROT_WRITE,
                              MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED, -1, 0);
            if (zero == MAP_FAILED)
                break;
            atomic_store(&g->faulted, 1);
            atomic_fetch_add(&fault_count, 1);
            errno = saved_errno;
            return;
        }
    }
    errno = saved_errno;
    chain(sig, info, context);
}

static int is_ours(const struct sigaction *sa)
{
    return (sa->sa_flags & SA_SIGINFO) && sa->sa_sigaction == on_sigbus;
}

/* Install the handler, again if someone (Python's faulthandler, say) replaced it. */
static int ensure_installed(void)
{
    struct sigaction cur;
    if (sigaction(SIGBUS, NULL, &cur) != 0)
        return -1;
    if (is_ours(&cur))
        return 0;
    pthread_mutex_lock(&install_lock);
    int rc = 0;
    if (!atomic_load(&page_mask)) {
        long size = sysconf(_SC_PAGESIZE);
        atomic_store(&page_mask, ~(uintptr_t)((size > 0 ? size : 4096) - 1));
    }
    struct sigaction sa, old;
    memset(&sa, 0, sizeof(sa));
    sa.sa_sigaction = on_sigbus;
    sa.sa_flags = SA_SIGINFO | SA_ONSTACK;
    sigemptyset(&sa.sa_mask);
    if (sigaction(SIGBUS, &sa, &old) != 0)
        rc = -1;
    else if (!is_ours(&old))
        previous = old;
    pthread_mutex_unlock(&install_lock);
    return rc;
}

static struct guard_thread *enter(uintptr_t lo, uintptr_t hi)
{
    if (ensure_installed() != 0)
        return NULL;
    long tid = current_tid();
    for (int i = 0; i < GUARD_THREADS; i++) {
        long expected = 0;
        struct guard_thread *g = &guarded[i];
        if (atomic_load(&g->tid) == 0 && atomic_compare_exchange_strong(&g->tid, &expected, tid)) {
            atomic_store(&g->lo, lo);
            atomic_store(&g->hi, hi);
            atomic_store(&g->faulted, 0);
            return g;
        }
    }
    errno = EBUSY;
    return NULL;
}

static int leave(struct guard_thread *g)
{
    int faulted = atomic_load(&g->faulted);
    atomic_store(&g->hi, 0);
    atomic_store(&g->lo, 0);
    atomic_store(&g->tid, 0);
    return faulted;
}

static int not_entered(struct gpunode_memcap_region *r)
{
    if (r)
        r->last_errno = errno;
    return GPUNODE_MEMCAP_ERR_IO;
}

int gpunode_memcap_guarded_open(struct gpunode_memcap_region *r, const char *dir, int writable)
{
    if (!r || !dir)
        return GPUNODE_MEMCAP_ERR_ARGUMENT;
    struct guard_thread *g = enter(0, UINTPTR_MAX);
    if (!g)
        return not_entered(r);
    int rc = gpunode_memcap_region_open(r, dir, writable);
    return leave(g) ? GPUNODE_MEMCAP_ERR_FAULT : rc;
}

static uintptr_t usage_start(const struct gpunode_memcap_region *r)
{
    return (uintptr_t)r->usage;
}

static uintptr_t usage_end(const struct gpunode_memcap_region *r)
{
    return (uintptr_t)r->usage + sizeof(*r->usage);
}

int gpunode_memcap_guarded_report(const struct gpunode_memcap_region *r, struct gpunode_memcap_report *out)
{
    if (!r || !r->usage || !out)
        return GPUNODE_MEMCAP_ERR_ARGUMENT;
    struct guard_thread *g = enter(usage_start(r), usage_end(r));
    if (!g)
        return not_entered((struct gpunode_memcap_region *)r);
    int rc = gpunode_memcap_report(r, out);
    return leave(g) ? GPUNODE_MEMCAP_ERR_FAULT : rc;
}

int gpunode_memcap_guarded_reclaim_dead(struct gpunode_memcap_region *r, uint64_t *reclaimed_bytes,
                                        uint32_t *reclaimed_slots)
{
    if (!r || !r->usage || !reclaimed_bytes || !reclaimed_slots)
        return GPUNODE_MEMCAP_ERR_ARGUMENT;
    struct guard_thread *g = enter(usage_start(r), usage_end(r));
    if (!g)
        return not_entered(r);
    int rc = gpunode_memcap_reclaim_dead(r, -1, reclaimed_bytes, reclaimed_slots);
    return leave(g) ? GPUNODE_MEMCAP_ERR_FAULT : rc;
}

int gpunode_memcap_guarded_compute_set(struct gpunode_memcap_region *r, uint32_t share_milli, uint32_t mode)
{
    if (!r || !r->usage)
        return GPUNODE_MEMCAP_ERR_ARGUMENT;
    struct guard_thread *g = enter(usage_start(r), usage_end(r));
    if (!g)
        return not_entered(r);
    int rc = gpunode_compute_set(r, share_milli, mode);
    return leave(g) ? GPUNODE_MEMCAP_ERR_FAULT : rc;
}

uint64_t gpunode_memcap_guard_faults(void)
{
    return atomic_load(&fault_count);
}
