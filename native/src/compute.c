/*
 * compute.c: the compute share. Every kernel or graph launch (hooks_launch.c)
 * draws on one budget of GPU time shared by all processes of the container
 * (struct gpunode_compute in the usage file), refilled at share x wall time
 * and capped at share x GPUNODE_COMPUTE_BURST_MS. A launch is charged an
 * estimate when it is submitted (so a container cannot queue far past its
 * budget), and the estimate is replaced by the GPU time the work really took
 * once it is done: an event is recorded before and after each launch on the
 * launch's stream, and a watcher thread reads them as they complete. Where
 * the budget is in debt, the next launch sleeps in short steps until the
 * refill has paid it; the share and mode are read on every refill, so a
 * change by the agent applies within a tick.
 *
 * GPU time of a launch is the part of [start, end] outside the latest block
 * of time already charged (work on several streams, or several threads'
 * launches on one stream, overlaps or finishes out of ticket order).
 *
 * Modes: hard (never above the share), work-conserving (refilled at the
 * whole GPU's rate while no process of the container has seen a neighbour's
 * work delay its own for GN_CONTENDED_HOLD_NS; at the share otherwise), off
 * (measure only).
 *
 * Must not: take a lock or make a system call when no throttling is due;
 * hold a launch for longer than one sleep step without re-reading the share.
 */
#define _GNU_SOURCE
#include "preload.h"

#include <pthread.h>
#include <signal.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#define GN_PAIRS 1024
#define GN_UNLIMITED_NS (INT64_C(1) << 60)
#define GN_INITIAL_ESTIMATE_NS 50000
#define GN_FIRST_IN_FLIGHT 4
#define GN_SLEEP_MIN_NS 20000
#define GN_SLEEP_MAX_NS 2000000
#define GN_TICK_BUSY_NS 500000
#define GN_TICK_IDLE_NS 2000000
#define GN_TICK_SLEEPY_NS 20000000
#define GN_IDLE_AFTER_NS 200000000ULL
#define GN_CONTENDED_HOLD_NS 1000000000LL
#define GN_CONTENDED_WAIT_NS 100000 /* a delay this long behind our own previous work means a neighbour ran */

/* One launch between its submission and the watcher's reading. */
struct gn_pair {
    _Atomic uint64_t ready; /* index + 1 once filled */
    CUevent start, end;
    CUcontext ctx;        /* the context the work went to */
    CUcontext events_ctx; /* the context start and end were created in */
    int64_t estimate_ns;  /* charged at submission */
    uint64_t submit_ns;   /* host clock just before the start event was recorded */
    int measured;         /* both events recorded */
};

static struct gn_pair gn_pairs[GN_PAIRS];
static _Atomic uint64_t gn_pairs_tail; /* next index to hand out */
static _Atomic uint64_t gn_pairs_head; /* next index the watcher reads */
static _Atomic uint64_t gn_completed;  /* pairs read so far */
_Atomic int64_t gn_estimate_ns = GN_INITIAL_ESTIMATE_NS;
_Atomic int gn_compute_on;
static _Atomic int gn_watcher_state; /* 0: not started, 1: starting, 2: running, 3: could not start */
static pthread_t gn_watcher;
static _Atomic uint32_t gn_last_share, gn_last_mode; /* the last well-formed control word */

static uint64_t gn_mono_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ULL + (uint64_t)ts.tv_nsec;
}

static void gn_sleep_ns(uint64_t ns)
{
    struct timespec ts = {(time_t)(ns / 1000000000ULL), (long)(ns % 1000000000ULL)};
    nanosleep(&ts, NULL);
}

/* The share and mode the agent wrote; a word that is not well formed (a
 * tenant scribbled on it) keeps the last good values. */
static void gn_read_control(struct gpunode_compute *c, uint32_t *share, uint32_t *mode)
{
    uint32_t s, m, g;
    if (gpunode_compute_unpack(atomic_load_explicit(&c->control, memory_order_relaxed), &s, &m, &g)) {
        atomic_store_explicit(&gn_last_share, s, memory_order_relaxed);
        atomic_store_explicit(&gn_last_mode, m, memory_order_relaxed);
        *share = s;
        *mode = m;
        return;
    }
    *share = atomic_load_explicit(&gn_last_share, memory_order_relaxed);
    *mode = atomic_load_explicit(&gn_last_mode, memory_order_relaxed);
}

static int gn_enforced(uint32_t share, uint32_t mode)
{
    return mode != GPUNODE_COMPUTE_MODE_OFF && share > 0;
}

/* Refill the budget for the time since the last refill at `rate` thousandths
 * of the GPU, and hold it at most `cap`. Lock-free: of racing refillers, the
 * one that moves refill_ns adds the time. Values a tenant wrote are brought
 * back in range: a budget above the cap is cut to it, a refill time in the
 * future is reset. */
static void gn_refill(struct gpunode_compute *c, uint64_t rate, int64_t cap)
{
    uint64_t now = gn_mono_ns();
    uint64_t last = atomic_load_explicit(&c->refill_ns, memory_order_relaxed);
    if (now > last && atomic_compare_exchange_strong(&c->refill_ns, &last, now)) {
        uint64_t dt = now - last;
        int64_t add = dt > (uint64_t)cap * 1000 / (rate ? rate : 1) ? cap : (int64_t)(dt * rate / 1000);
        atomic_fetch_add_explicit(&c->budget_ns, add, memory_order_relaxed);
    } else if (last > now + 1000000000ULL) {
        atomic_compare_exchange_strong(&c->refill_ns, &last, now);
    }
    int64_t b = atomic_load_explicit(&c->budget_ns, memory_order_relaxed);
    while (b > cap && !atomic_compare_exchange_weak(&c->budget_ns, &b, cap)) {
    }
}

/* The rate and cap for the share and mode now. */
static void gn_rate(struct gpunode_compute *c, uint32_t share, uint32_t mode, uint64_t *rate, int64_t *cap)
{
    *rate = share;
    if (mode == GPUNODE_COMPUTE_MODE_WORK_CONSERVING) {
        uint64_t seen = atomic_load_explicit(&c->contended_ns, memory_order_relaxed);
        uint64_t now = gn_mono_ns();
        if (seen > now || now - seen > (uint64_t)GN_CONTENDED_HOLD_NS)
            *rate = GPUNODE_COMPUTE_MILLI_PER_GPU;
    }
    *cap = (int64_t)(*rate * GPUNODE_COMPUTE_BURST_MS * 1000ULL);
}

/* One refill step as the watcher and the throttle do it: 1 if a share is
 * enforced (and the budget was refilled), 0 if not (the budget is opened). */
static int gn_refill_now(struct gpunode_compute *c, uint64_t *rate_out)
{
    uint32_t share, mode;
    gn_read_control(c, &share, &mode);
    if (!gn_enforced(share, mode)) {
        atomic_store_explicit(&c->budget_ns, GN_UNLIMITED_NS, memory_order_relaxed);
        return 0;
    }
    uint64_t rate;
    int64_t cap;
    gn_rate(c, share, mode, &rate, &cap);
    gn_refill(c, rate, cap);
    if (rate_out)
        *rate_out = rate;
    return 1;
}

static void gn_add_throttled(uint64_t ns)
{
    atomic_fetch_add_explicit(&gn_hot.usage->compute.throttled_ns, ns, memory_order_relaxed);
    atomic_fetch_add_explicit(&gn_hot.slot->throttled_ns, ns, memory_order_relaxed);
}

/* Pay the container's debt: sleep in short steps, refilling (and re-reading
 * the share) after each, until the budget is back at zero or above. */
GN_COLD void gn_compute_throttle(void)
{
    struct gpunode_compute *c = &gn_hot.usage->compute;
    uint64_t began = gn_mono_ns();
    int slept = 0;
    for (;;) {
        uint64_t rate = 0;
        if (!gn_refill_now(c, &rate))
            break;
        int64_t b = atomic_load_explicit(&c->budget_ns, memory_order_relaxed);
        if (b >= 0)
            break;
        uint64_t ns = (uint64_t)(-b) * 1000 / (rate ? rate : 1);
        gn_sleep_ns(ns < GN_SLEEP_MIN_NS ? GN_SLEEP_MIN_NS : ns > GN_SLEEP_MAX_NS ? GN_SLEEP_MAX_NS : ns);
        slept = 1;
    }
    if (slept)
        gn_add_throttled(gn_mono_ns() - began);
}

/* ---- the watcher: reading the events of finished launches ---- */

static double gn_elapsed_ns(CUevent a, CUevent b, int *ok)
{
    float ms = 0;
    __typeof__(&cuEventElapsedTime) elapsed = GN_REAL(cuEventElapsedTime);
    *ok = elapsed && elapsed(&ms, a, b) == CUDA_SUCCESS;
    return *ok ? (double)ms * 1e6 : 0;
}

/* The watcher's view of the previous launch read, and how late (device
 * start against host submission, up to a constant offset between the two
 * clocks) launches have been lately: the least lateness seen is taken as
 * "the device was free", anything well above it as waiting for a neighbour. */
static struct {
    CUevent start;
    CUcontext ctx;
    uint64_t submit_ns;
    double first, last; /* the latest block of GPU time charged, in ns after start */
    int valid;
} gn_prev;
static struct {
    double lateness, min_now, min_before;
    uint64_t window_start_ns;
    int valid;
} gn_late;

#define GN_LATE_WINDOW_NS 1000000000ULL

/* A neighbour's work kept this container's launch from starting. */
static void gn_contended(void)
{
    atomic_store_explicit(&gn_hot.usage->compute.contended_ns, gn_mono_ns(), memory_order_relaxed);
}

/* Follow the lateness of pair p, started `since_prev_start` ns (device)
 * after the previous one began and `since_prev_end` after the latest end of
 * the container's own earlier work. A start
 * later than both its submission and the end of the container's own
 * previous work waited for someone else's. */
static void gn_track_lateness(const struct gn_pair *p, double since_prev_start, double since_prev_end)
{
    double host = (double)p->submit_ns - (double)gn_prev.submit_ns;
    uint64_t now = gn_mono_ns();
    gn_late.lateness += since_prev_start - host;
    if (!gn_late.valid) {
        gn_late.lateness = 0;
        gn_late.min_now = gn_late.min_before = 0;
        gn_late.window_start_ns = now;
        gn_late.valid = 1;
    }
    if (gn_late.lateness < gn_late.min_now)
        gn_late.min_now = gn_late.lateness;
    if (now - gn_late.window_start_ns > GN_LATE_WINDOW_NS) {
        gn_late.min_before = gn_late.min_now;
        gn_late.min_now = gn_late.lateness;
        gn_late.window_start_ns = now;
    }
    double floor = gn_late.min_now < gn_late.min_before ? gn_late.min_now : gn_late.min_before;
    double wait = gn_late.lateness - floor;
    if (since_prev_end < wait)
        wait = since_prev_end;
    if (wait > GN_CONTENDED_WAIT_NS)
        gn_contended();
}
static CUcontext gn_watcher_ctx;

/* Read pair `i` if its work is done: 1 when read (charged), 0 if not yet. */
static int gn_read_pair(uint64_t i)
{
    struct gn_pair *p = &gn_pairs[i % GN_PAIRS];
    if (atomic_load_explicit(&p->ready, memory_order_acquire) != i + 1)
        return 0;
    int64_t charge = p->estimate_ns;
    if (p->measured) {
        if (p->ctx != gn_watcher_ctx) {
            __typeof__(&cuCtxSetCurrent) set = GN_REAL(cuCtxSetCurrent);
            if (set && set(p->ctx) == CUDA_SUCCESS)
                gn_watcher_ctx = p->ctx;
        }
        __typeof__(&cuEventQuery) query = GN_REAL(cuEventQuery);
        CUresult q = query ? query(p->end) : CUDA_ERROR_NOT_INITIALIZED;
        if (q == CUDA_ERROR_NOT_READY)
            return 0;
        int ok = 0;
        double dur = q == CUDA_SUCCESS ? gn_elapsed_ns(p->start, p->end, &ok) : 0;
        if (ok) {
            charge = dur > 0 ? (int64_t)dur : 0;
            /* The latest block of GPU time charged so far, [first, last], kept
             * relative to the previous pair's start (whose entry is still
             * intact), moved here to be relative to this pair's start (time 0;
             * its end is dur). This pair is charged what lies outside it. */
            double first = 1e18, last = -1e18;
            int ok4 = 0;
            double since_prev_start = 0;
            if (gn_prev.valid && gn_prev.ctx == p->ctx)
                since_prev_start = gn_elapsed_ns(gn_prev.start, p->start, &ok4);
            if (ok4) {
                first = gn_prev.first - since_prev_start;
                last = gn_prev.last - since_prev_start;
                double lo = first > 0 ? first : 0, hi = last < dur ? last : dur;
                if (hi > lo)
                    charge = (int64_t)(dur - (hi - lo));
                gn_track_lateness(p, since_prev_start, -last);
            } else {
                gn_late.valid = 0;
            }
            if (last >= 0 && first <= dur) { /* overlaps or touches the block: grow it */
                gn_prev.first = first < 0 ? first : 0;
                gn_prev.last = last > dur ? last : dur;
            } else if (dur > last) { /* later than the block: the new block */
                gn_prev.first = 0;
                gn_prev.last = dur;
            } else { /* wholly earlier (threads' launches out of ticket order): keep the block */
                gn_prev.first = first;
                gn_prev.last = last;
            }
            /* Keep this pair's events as the reference: the ring does not
             * hand this entry out again before the next pair is read. */
            gn_prev.start = p->start;
            gn_prev.ctx = p->ctx;
            gn_prev.submit_ns = p->submit_ns;
            gn_prev.valid = 1;
        } else {
            gn_prev.valid = 0;
            gn_late.valid = 0;
        }
    }
    struct gpunode_compute *c = &gn_hot.usage->compute;
    atomic_fetch_add_explicit(&c->budget_ns, p->estimate_ns - charge, memory_order_relaxed);
    atomic_fetch_add_explicit(&c->busy_ns, (uint64_t)charge, memory_order_relaxed);
    atomic_fetch_add_explicit(&c->launches, 1, memory_order_relaxed);
    atomic_fetch_add_explicit(&gn_hot.slot->busy_ns, (uint64_t)charge, memory_order_relaxed);
    atomic_fetch_add_explicit(&gn_hot.slot->launches, 1, memory_order_relaxed);
    int64_t est = atomic_load_explicit(&gn_estimate_ns, memory_order_relaxed);
    est += (charge - est) / 8;
    atomic_store_explicit(&gn_estimate_ns, est > 1000 ? est : 1000, memory_order_relaxed);
    atomic_fetch_add_explicit(&gn_completed, 1, memory_order_relaxed);
    atomic_store_explicit(&gn_pairs_head, i + 1, memory_order_release);
    return 1;
}

static void *gn_watch(void *arg)
{
    (void)arg;
    sigset_t all;
    sigfillset(&all);
    pthread_sigmask(SIG_BLOCK, &all, NULL);
    uint64_t idle_since = gn_mono_ns();
    for (;;) {
        gn_refill_now(&gn_hot.usage->compute, NULL);
        uint64_t head = atomic_load_explicit(&gn_pairs_head, memory_order_relaxed);
        while (head != atomic_load_explicit(&gn_pairs_tail, memory_order_acquire) && gn_read_pair(head))
            head++;
        int busy = head != atomic_load_explicit(&gn_pairs_tail, memory_order_relaxed);
        uint64_t now = gn_mono_ns();
        if (busy)
            idle_since = now;
        /* Long idle: tick slowly (a launch refills for itself when it must). */
        gn_sleep_ns(busy ? GN_TICK_BUSY_NS : now - idle_since > GN_IDLE_AFTER_NS ? GN_TICK_SLEEPY_NS : GN_TICK_IDLE_NS);
    }
    return NULL;
}

/* First launch of this process: start the watcher. 1 if launches are
 * measured from now on, 0 if they pass through unmeasured. */
GN_COLD int gn_compute_start(void)
{
    int state = 0;
    if (atomic_compare_exchange_strong(&gn_watcher_state, &state, 1)) {
        __typeof__(&cuEventCreate) create = GN_REAL(cuEventCreate);
        __typeof__(&cuEventRecord) record = GN_REAL(cuEventRecord);
        if (!create || !record || !GN_REAL(cuEventQuery) || !GN_REAL(cuEventElapsedTime) ||
            !GN_REAL(cuCtxGetCurrent)) {
            gn_log(GN_LOG_ERROR, "the driver lacks the event calls GPU time is measured with; launches are not"
                                 " counted against the compute share");
            atomic_store(&gn_watcher_state, 3);
        } else {
            pthread_attr_t attr;
            pthread_attr_init(&attr);
            pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
            int rc = pthread_create(&gn_watcher, &attr, gn_watch, NULL);
            pthread_attr_destroy(&attr);
            if (rc != 0) {
                gn_log(GN_LOG_ERROR, "cannot start the compute-share watcher thread: %s; launches are not counted"
                                     " against the compute share", strerror(rc));
                atomic_store(&gn_watcher_state, 3);
            } else {
                atomic_store(&gn_watcher_state, 2);
                atomic_store_explicit(&gn_compute_on, 1, memory_order_release);
            }
        }
    }
    while ((state = atomic_load(&gn_watcher_state)) == 1)
        gn_sleep_ns(GN_SLEEP_MIN_NS);
    return state == 2;
}

/* ---- submission ---- */

static int gn_record(CUevent event, CUstream stream, int ptsz)
{
    if (ptsz) {
        __typeof__(&cuEventRecord_ptsz) rec = GN_REAL(cuEventRecord_ptsz);
        if (rec)
            return rec(event, stream) == CUDA_SUCCESS;
    }
    __typeof__(&cuEventRecord) rec = GN_REAL(cuEventRecord);
    return rec && rec(event, stream) == CUDA_SUCCESS;
}

static int gn_pair_events(struct gn_pair *p, CUcontext ctx)
{
    if (p->events_ctx == ctx && p->start && p->end)
        return 1;
    __typeof__(&cuEventDestroy_v2) destroy = GN_REAL(cuEventDestroy_v2);
    if (destroy && p->start)
        destroy(p->start);
    if (destroy && p->end)
        destroy(p->end);
    p->start = p->end = NULL;
    p->events_ctx = NULL;
    __typeof__(&cuEventCreate) create = GN_REAL(cuEventCreate);
    if (create(&p->start, CU_EVENT_DEFAULT) != CUDA_SUCCESS || create(&p->end, CU_EVENT_DEFAULT) != CUDA_SUCCESS)
        return 0;
    p->events_ctx = ctx;
    return 1;
}

/* Wait until the ring has room for index t (and, while a share is enforced
 * and no launch has been measured yet, so the estimate means nothing, until
 * few launches are in flight). */
static void gn_wait_room(uint64_t t)
{
    uint64_t began = 0;
    for (;;) {
        uint64_t head = atomic_load_explicit(&gn_pairs_head, memory_order_acquire);
        int unmeasured = !atomic_load_explicit(&gn_completed, memory_order_relaxed) &&
                         atomic_load_explicit(&gn_hot.usage->compute.budget_ns, memory_order_relaxed) <
                             GN_UNLIMITED_NS / 2;
        uint64_t limit = unmeasured ? GN_FIRST_IN_FLIGHT : GN_PAIRS - 1;
        if (t - head < limit)
            break;
        if (!began)
            began = gn_mono_ns();
        gn_sleep_ns(GN_SLEEP_MIN_NS);
    }
    if (began)
        gn_add_throttled(gn_mono_ns() - began);
}

/* Whether work on `stream` is being captured into a graph rather than run:
 * such launches are neither charged nor measured (the graph is, when it is
 * launched), and an event recorded there would become part of the graph. */
static int gn_capturing(CUstream stream, int ptsz)
{
    int status = CU_STREAM_CAPTURE_STATUS_NONE;
    __typeof__(&cuStreamIsCapturing) is = ptsz ? GN_REAL(cuStreamIsCapturing_ptsz) : GN_REAL(cuStreamIsCapturing);
    if (!is || is(stream, &status) != CUDA_SUCCESS)
        return 0;
    return status != CU_STREAM_CAPTURE_STATUS_NONE;
}

/* Before the driver's launch: charge the estimate and take a ring entry and
 * record the start event. Returns the entry's index + 1, or 0 if the launch
 * goes unmeasured (stream capture). */
uint64_t gn_pair_open(CUstream stream, int ptsz, int64_t estimate)
{
    if (GN_UNLIKELY(gn_capturing(stream, ptsz)))
        return 0;
    struct gpunode_compute *c = &gn_hot.usage->compute;
    if (GN_UNLIKELY(atomic_fetch_sub_explicit(&c->budget_ns, estimate, memory_order_relaxed) < estimate))
        gn_compute_throttle();
    uint64_t t = atomic_fetch_add_explicit(&gn_pairs_tail, 1, memory_order_relaxed);
    gn_wait_room(t);
    struct gn_pair *p = &gn_pairs[t % GN_PAIRS];
    p->estimate_ns = estimate;
    p->measured = 0;
    CUcontext ctx = NULL;
    __typeof__(&cuCtxGetCurrent) current = GN_REAL(cuCtxGetCurrent);
    if (current(&ctx) == CUDA_SUCCESS && ctx && gn_pair_events(p, ctx)) {
        p->ctx = ctx;
        p->submit_ns = gn_mono_ns();
        p->measured = gn_record(p->start, stream, ptsz);
        if (!p->measured)
            p->events_ctx = NULL; /* e.g. a context made again at the same address: new events next time */
    }
    return t + 1;
}

/* After the driver's launch: record the end event and hand the entry to the watcher. */
void gn_pair_close(uint64_t ticket, CUstream stream, int ptsz)
{
    uint64_t t = ticket - 1;
    struct gn_pair *p = &gn_pairs[t % GN_PAIRS];
    if (p->measured)
        p->measured = gn_record(p->end, stream, ptsz);
    atomic_store_explicit(&p->ready, t + 1, memory_order_release);
}

/* After fork: the watcher thread and the parent's events are gone. */
void gn_compute_after_fork(void)
{
    memset(gn_pairs, 0, sizeof(gn_pairs));
    atomic_store(&gn_pairs_tail, 0);
    atomic_store(&gn_pairs_head, 0);
    atomic_store(&gn_completed, 0);
    atomic_store(&gn_watcher_state, 0);
    atomic_store(&gn_compute_on, 0);
    gn_prev.valid = 0;
    gn_late.valid = 0;
    gn_watcher_ctx = NULL;
}
