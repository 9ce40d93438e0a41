/*
 * fake_timeline.c: the fake driver's device timeline, part of the fake
 * libcuda.so.1. Work submitted by every process that uses the fake goes
 * onto one modelled device, shared through a file (FAKE_CUDA_TIMELINE), so
 * several processes of several containers contend for it as they would for
 * a GPU:
 *
 *   - a kernel runs for a set duration of device time: the first kernel
 *     parameter points at its duration in nanoseconds (uint64_t); a graph
 *     launch's CUgraphExec points at the graph's duration the same way;
 *   - the device runs one context (process) at a time, round robin: a
 *     context keeps the device while its time slice (FAKE_CUDA_TIMESLICE_US,
 *     default 2000) lasts, and is switched out at the next kernel boundary
 *     once the slice is spent and another context has work. Streams of one
 *     process share its queue (work of one process runs in submission order);
 *   - time is the real clock (CLOCK_MONOTONIC): whoever calls in advances the
 *     model to now under a process-shared lock, so synchronisation blocks for
 *     real until the model says the work is done;
 *   - events carry the model's timestamps: the time the device reached them;
 *   - per process, the device time it received is recorded (busy_ns): the
 *     ground truth the tests read from the file (layout: fake_timeline.py);
 *   - cuStreamIsCapturing says "capturing" when FAKE_CUDA_CAPTURING=1 (the
 *     work still runs: only what the interposer is told changes).
 *
 * Without FAKE_CUDA_TIMELINE each process has a private timeline.
 *
 * Test infrastructure only; never part of gpunode.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#define API __attribute__((visibility("default")))

typedef int CUresult;
typedef struct CUstream_st *CUstream;
typedef struct CUfunc_st *CUfunction;
typedef struct CUgraphExec_st *CUgraphExec;
typedef struct CUevent_st *CUevent;
typedef struct {
    unsigned int gridDimX, gridDimY, gridDimZ, blockDimX, blockDimY, blockDimZ, sharedMemBytes;
    CUstream hStream;
    void *attrs;
    unsigned int numAttrs;
} CUlaunchConfig;

enum { TL_OK = 0, TL_E_INVALID_VALUE = 1, TL_E_INVALID_HANDLE = 400, TL_E_NOT_READY = 600 };

#define TL_MAGIC 0x454e494c454d4954ULL /* "TIMELINE" */
#define TL_PROCS 64
#define TL_ITEMS 4096
#define TL_EVENTS 2048
#define TL_KERNEL 0
#define TL_EVENT 1

struct tl_item {
    uint64_t remaining_ns;
    uint32_t kind;
    uint32_t event; /* TL_EVENT: index in the process's event table */
    uint64_t seq;   /* TL_EVENT: the record it completes */
    uint64_t duration_ns;
};

/* One process (one context). The header is read by tests/native/fake_timeline.py. */
struct tl_proc {
    int32_t pid;
    int32_t reserved;
    uint64_t busy_ns;  /* device time this process received */
    uint64_t launches; /* kernels and graphs submitted */
    uint64_t head, tail;
    uint64_t event_ns[TL_EVENTS]; /* when the device reached the event's latest record; 0: not yet */
    uint64_t event_seq[TL_EVENTS];
    struct tl_item items[TL_ITEMS];
};

struct tl_shared {
    uint64_t magic;
    uint64_t now_ns;   /* the model has been advanced to this time */
    uint64_t busy_ns;  /* device time used by anyone */
    int32_t running;   /* index of the process holding the device, -1: none */
    int32_t reserved;
    uint64_t slice_used_ns;
    uint64_t timeslice_ns;
    pthread_mutex_t lock; /* process-shared, robust */
    uint8_t pad[64];
    struct tl_proc procs[TL_PROCS];
};

/* The layout tests/native/fake_timeline.py reads. */
_Static_assert(sizeof(struct tl_item) == 32, "item layout");
_Static_assert(offsetof(struct tl_shared, procs) == 152, "timeline header layout");
_Static_assert(sizeof(struct tl_proc) == 40 + 16 * TL_EVENTS + 32 * TL_ITEMS, "process layout");

static struct tl_shared *tl;
static int tl_self = -1;
static pid_t tl_self_pid;
static pthread_once_t tl_once = PTHREAD_ONCE_INIT;
static pthread_mutex_t tl_events_lock = PTHREAD_MUTEX_INITIALIZER;
static uint8_t tl_event_used[TL_EVENTS];

struct CUevent_st {
    uint32_t index;
    int32_t owner_pid;
};

static uint64_t tl_clock(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ULL + (uint64_t)ts.tv_nsec;
}

static void tl_init_shared(struct tl_shared *s)
{
    memset(s, 0, sizeof(*s));
    pthread_mutexattr_t a;
    pthread_mutexattr_init(&a);
    pthread_mutexattr_setpshared(&a, PTHREAD_PROCESS_SHARED);
    pthread_mutexattr_setrobust(&a, PTHREAD_MUTEX_ROBUST);
    pthread_mutex_init(&s->lock, &a);
    pthread_mutexattr_destroy(&a);
    s->running = -1;
    s->now_ns = tl_clock();
    const char *v = getenv("FAKE_CUDA_TIMESLICE_US");
    uint64_t us = v && strtoull(v, NULL, 10) ? strtoull(v, NULL, 10) : 2000;
    s->timeslice_ns = us * 1000;
    atomic_thread_fence(memory_order_release);
    s->magic = TL_MAGIC;
}

static void tl_map(void)
{
    const char *path = getenv("FAKE_CUDA_TIMELINE");
    if (path && *path) {
        int fd = open(path, O_RDWR | O_CREAT | O_CLOEXEC, 0600);
        if (fd >= 0 && flock(fd, LOCK_EX) == 0) {
            struct stat st;
            int fresh = fstat(fd, &st) == 0 && st.st_size < (off_t)sizeof(struct tl_shared);
            if (!fresh || ftruncate(fd, sizeof(struct tl_shared)) == 0) {
                void *p = mmap(NULL, sizeof(struct tl_shared), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
                if (p != MAP_FAILED) {
                    tl = p;
                    if (fresh || tl->magic != TL_MAGIC)
                        tl_init_shared(tl);
                }
            }
            flock(fd, LOCK_UN);
        }
        if (fd >= 0)
            close(fd);
        if (!tl) {
            fprintf(stderr, "fake libcuda: cannot map the timeline %s\n", path);
            abort();
        }
        return;
    }
    tl = mmap(NULL, sizeof(struct tl_shared), PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (tl == MAP_FAILED)
        abort();
    tl_init_shared(tl);
}

static void tl_lock(void)
{
    if (pthread_mutex_lock(&tl->lock) == EOWNERDEAD)
        pthread_mutex_consistent(&tl->lock);
}

static void tl_unlock(void)
{
    pthread_mutex_unlock(&tl->lock);
}

static int tl_has_work(int i)
{
    return tl->procs[i].head != tl->procs[i].tail;
}

static int tl_next_runner(int after)
{
    for (int k = 1; k <= TL_PROCS; k++) {
        int i = (after + k + TL_PROCS) % TL_PROCS;
        if (tl_has_work(i))
            return i;
    }
    return -1;
}

/* The running context's time slice is spent and another context has work. */
static int tl_switch_due(int r)
{
    if (tl->slice_used_ns < tl->timeslice_ns)
        return 0;
    int next = tl_next_runner(r);
    return next >= 0 && next != r;
}

/* Run the model up to `now`. Caller holds the lock. Events are commands in
 * their context's queue: the device reaches them while that context runs,
 * so an event recorded just before a kernel reads the time the kernel
 * started, and one just after it the time it ended. */
static void tl_advance(uint64_t now)
{
    while (tl->now_ns <= now) {
        int r = tl->running;
        if (r < 0 || !tl_has_work(r)) {
            r = tl_next_runner(r < 0 ? -1 : r);
            tl->running = r;
            tl->slice_used_ns = 0;
            if (r < 0) {
                tl->now_ns = now;
                return;
            }
        }
        struct tl_proc *p = &tl->procs[r];
        struct tl_item *it = &p->items[p->head % TL_ITEMS];
        if (it->kind == TL_EVENT) {
            int before_kernel = p->head + 1 != p->tail && p->items[(p->head + 1) % TL_ITEMS].kind == TL_KERNEL;
            if (before_kernel && tl_switch_due(r)) {
                tl->running = tl_next_runner(r);
                tl->slice_used_ns = 0;
                continue;
            }
            if (p->event_seq[it->event] == it->seq)
                p->event_ns[it->event] = tl->now_ns ? tl->now_ns : 1;
            p->head++;
            continue;
        }
        if (it->remaining_ns == it->duration_ns && tl_switch_due(r)) {
            tl->running = tl_next_runner(r);
            tl->slice_used_ns = 0;
            continue;
        }
        if (tl->now_ns == now)
            return;
        uint64_t run = it->remaining_ns;
        if (run > now - tl->now_ns)
            run = now - tl->now_ns;
        it->remaining_ns -= run;
        tl->now_ns += run;
        p->busy_ns += run;
        tl->busy_ns += run;
        tl->slice_used_ns += run;
        if (it->remaining_ns == 0)
            p->head++;
    }
}

/* This process's entry, claimed on first use (a dead process's entry is
 * taken over once its queue has drained). Caller holds the lock. */
static int tl_claim(void)
{
    pid_t me = getpid();
    if (tl_self >= 0 && tl_self_pid == me)
        return tl_self;
    int free_slot = -1;
    for (int i = 0; i < TL_PROCS; i++) {
        struct tl_proc *p = &tl->procs[i];
        if (p->pid == me) {
            free_slot = i;
            break;
        }
        if (free_slot < 0 && (p->pid == 0 || (!tl_has_work(i) && kill(p->pid, 0) != 0 && errno == ESRCH)))
            free_slot = i;
    }
    if (free_slot < 0) {
        fprintf(stderr, "fake libcuda: more than %d processes on the timeline\n", TL_PROCS);
        abort();
    }
    struct tl_proc *p = &tl->procs[free_slot];
    if (p->pid != me) {
        memset(p, 0, offsetof(struct tl_proc, items));
        p->pid = me;
    }
    tl_self = free_slot;
    tl_self_pid = me;
    return free_slot;
}

static void tl_setup(void)
{
    tl_map();
}

__attribute__((constructor)) static void tl_setup_at_load(void)
{
    pthread_once(&tl_once, tl_setup);
}

static int tl_enter(void)
{
    pthread_once(&tl_once, tl_setup);
    tl_lock();
    tl_advance(tl_clock());
    return tl_claim();
}

static void tl_wait_tick(uint64_t hint_ns)
{
    uint64_t ns = hint_ns < 20000 ? 20000 : hint_ns > 500000 ? 500000 : hint_ns;
    struct timespec ts = {0, (long)ns};
    nanosleep(&ts, NULL);
}

/* Put an item on this process's queue, waiting while the queue is full. */
static void tl_push(struct tl_item item)
{
    for (;;) {
        int i = tl_enter();
        struct tl_proc *p = &tl->procs[i];
        if (p->tail - p->head < TL_ITEMS) {
            p->items[p->tail % TL_ITEMS] = item;
            p->tail++;
            if (item.kind == TL_KERNEL)
                p->launches++;
            tl_advance(tl->now_ns); /* an event on an idle device is reached at once */
            tl_unlock();
            return;
        }
        tl_unlock();
        tl_wait_tick(0);
    }
}

static CUresult tl_launch(uint64_t ns)
{
    if (ns == 0)
        return TL_OK;
    tl_push((struct tl_item){.remaining_ns = ns, .duration_ns = ns, .kind = TL_KERNEL});
    return TL_OK;
}

static uint64_t tl_kernel_ns(void **params)
{
    return params && params[0] ? *(const uint64_t *)params[0] : 0;
}

API CUresult cuLaunchKernel(CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,
                            unsigned shmem, CUstream stream, void **params, void **extra)
{
    (void)f, (void)gx, (void)gy, (void)gz, (void)bx, (void)by, (void)bz, (void)shmem, (void)stream, (void)extra;
    return tl_launch(tl_kernel_ns(params));
}

API CUresult cuLaunchKernel_ptsz(CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,
                                 unsigned bz, unsigned shmem, CUstream stream, void **params, void **extra)
{
    return cuLaunchKernel(f, gx, gy, gz, bx, by, bz, shmem, stream, params, extra);
}

API CUresult cuLaunchCooperativeKernel(CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,
                                       unsigned bz, unsigned shmem, CUstream stream, void **params)
{
    return cuLaunchKernel(f, gx, gy, gz, bx, by, bz, shmem, stream, params, NULL);
}

API CUresult cuLaunchCooperativeKernel_ptsz(CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx,
                                            unsigned by, unsigned bz, unsigned shmem, CUstream stream, void **params)
{
    return cuLaunchKernel(f, gx, gy, gz, bx, by, bz, shmem, stream, params, NULL);
}

API CUresult cuLaunchKernelEx(const CUlaunchConfig *config, CUfunction f, void **params, void **extra)
{
    (void)f, (void)extra;
    if (!config)
        return TL_E_INVALID_VALUE;
    return tl_launch(tl_kernel_ns(params));
}

API CUresult cuLaunchKernelEx_ptsz(const CUlaunchConfig *config, CUfunction f, void **params, void **extra)
{
    return cuLaunchKernelEx(config, f, params, extra);
}

API CUresult cuGraphLaunch(CUgraphExec graph, CUstream stream)
{
    (void)stream;
    if (!graph)
        return TL_E_INVALID_HANDLE;
    return tl_launch(*(const uint64_t *)graph);
}

API CUresult cuGraphLaunch_ptsz(CUgraphExec graph, CUstream stream)
{
    return cuGraphLaunch(graph, stream);
}

/* FAKE_CUDA_CAPTURING=1: every stream says it is being captured into a graph. */
static int tl_capture_status(int *status)
{
    if (!status)
        return TL_E_INVALID_VALUE;
    const char *v = getenv("FAKE_CUDA_CAPTURING");
    *status = v && *v == '1';
    return TL_OK;
}

API CUresult cuStreamIsCapturing(CUstream stream, int *status)
{
    (void)stream;
    return tl_capture_status(status);
}

API CUresult cuStreamIsCapturing_ptsz(CUstream stream, int *status)
{
    (void)stream;
    return tl_capture_status(status);
}

/* Wait until this process's queue holds no kernel. */
static CUresult tl_sync_all(void)
{
    for (;;) {
        int i = tl_enter();
        struct tl_proc *p = &tl->procs[i];
        uint64_t left = 0;
        for (uint64_t k = p->head; k != p->tail; k++)
            if (p->items[k % TL_ITEMS].kind == TL_KERNEL) {
                left = p->items[k % TL_ITEMS].remaining_ns;
                break;
            }
        int done = p->head == p->tail;
        tl_unlock();
        if (done)
            return TL_OK;
        tl_wait_tick(left);
    }
}

API CUresult cuCtxSynchronize(void)
{
    return tl_sync_all();
}

API CUresult cuStreamSynchronize(CUstream stream)
{
    (void)stream;
    return tl_sync_all();
}

API CUresult cuStreamSynchronize_ptsz(CUstream stream)
{
    (void)stream;
    return tl_sync_all();
}

API CUresult cuEventCreate(CUevent *event, unsigned int flags)
{
    (void)flags;
    if (!event)
        return TL_E_INVALID_VALUE;
    pthread_mutex_lock(&tl_events_lock);
    int found = -1;
    for (int i = 0; i < TL_EVENTS; i++)
        if (!tl_event_used[i]) {
            tl_event_used[i] = 1;
            found = i;
            break;
        }
    pthread_mutex_unlock(&tl_events_lock);
    if (found < 0)
        return 2; /* out of memory */
    struct CUevent_st *e = malloc(sizeof(*e));
    if (!e)
        return 2;
    e->index = (uint32_t)found;
    e->owner_pid = getpid();
    int i = tl_enter();
    tl->procs[i].event_ns[found] = 1; /* a never-recorded event counts as complete */
    tl->procs[i].event_seq[found]++;
    tl_unlock();
    *event = e;
    return TL_OK;
}

API CUresult cuEventDestroy_v2(CUevent event)
{
    if (!event)
        return TL_E_INVALID_HANDLE;
    pthread_mutex_lock(&tl_events_lock);
    tl_event_used[event->index] = 0;
    pthread_mutex_unlock(&tl_events_lock);
    free(event);
    return TL_OK;
}

API CUresult cuEventRecord(CUevent event, CUstream stream)
{
    (void)stream;
    if (!event)
        return TL_E_INVALID_HANDLE;
    int i = tl_enter();
    struct tl_proc *p = &tl->procs[i];
    uint64_t seq = ++p->event_seq[event->index];
    p->event_ns[event->index] = 0;
    tl_unlock();
    tl_push((struct tl_item){.kind = TL_EVENT, .event = event->index, .seq = seq});
    return TL_OK;
}

API CUresult cuEventRecord_ptsz(CUevent event, CUstream stream)
{
    return cuEventRecord(event, stream);
}

static uint64_t tl_event_time(CUevent event)
{
    int i = tl_enter();
    uint64_t t = tl->procs[i].event_ns[event->index];
    tl_unlock();
    return t;
}

API CUresult cuEventQuery(CUevent event)
{
    if (!event)
        return TL_E_INVALID_HANDLE;
    return tl_event_time(event) ? TL_OK : TL_E_NOT_READY;
}

API CUresult cuEventSynchronize(CUevent event)
{
    if (!event)
        return TL_E_INVALID_HANDLE;
    while (!tl_event_time(event))
        tl_wait_tick(0);
    return TL_OK;
}

API CUresult cuEventElapsedTime(float *ms, CUevent start, CUevent end)
{
    if (!ms || !start || !end)
        return TL_E_INVALID_HANDLE;
    uint64_t a = tl_event_time(start), b = tl_event_time(end);
    if (!a || !b)
        return TL_E_NOT_READY;
    *ms = (float)(((double)b - (double)a) / 1e6);
    return TL_OK;
}

/* ---- test helpers ---- */

/* Device time this process has received so far (ns). */
API unsigned long long fake_cuda_busy_ns(void)
{
    int i = tl_enter();
    uint64_t b = tl->procs[i].busy_ns;
    tl_unlock();
    return b;
}

/* Bring the shared model up to the present (readers of the file call this first). */
API void fake_cuda_timeline_advance(void)
{
    pthread_once(&tl_once, tl_setup);
    tl_lock();
    tl_advance(tl_clock());
    tl_unlock();
}
