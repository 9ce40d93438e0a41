/*
 * state.c: the interposer's process state and every slow path: loading the
 * region once, claiming this process's slot, fail-open/fail-closed
 * decisions, fork handling, mapping CUDA devices to the region's devices,
 * and the retry that reclaims dead processes' usage before refusing.
 *
 * Must not: hold gn_lock across a driver call, or run on the fast path
 * (the inline gn_reserve in preload.h only enters here when it must).
 */
#define _GNU_SOURCE
#include "preload.h"

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

struct gn_hot gn_hot __attribute__((aligned(64)));
struct gn_entry gn_table[GN_TABLE_SIZE] __attribute__((aligned(4096)));

/* usage_fd starts at -1: a zeroed struct would name fd 0, and the first open (which closes the
 * region first) would close the program's stdin. */
static struct gpunode_memcap_region gn_region = {.usage_fd = -1};
static pthread_mutex_t gn_lock = PTHREAD_MUTEX_INITIALIZER;
static int gn_slot_index = -1;
static int gn_fail_open_flag; /* the limit file's fail-open flag */
static _Atomic uint64_t gn_refusals;
static _Atomic int64_t gn_last_reclaim_ns;

#define GN_MAX_ORDINALS 64
#define GN_ORDINAL_UNKNOWN (-2)
#define GN_ORDINAL_OUTSIDE (-1)
static _Atomic int gn_ordinal_map[GN_MAX_ORDINALS];

static int64_t gn_now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC_COARSE, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

/* Start time in clock ticks since boot (field 22 of /proc/self/stat). */
static uint64_t gn_start_ticks(void)
{
    char buf[1024];
    int fd = open("/proc/self/stat", O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return 0;
    ssize_t n = read(fd, buf, sizeof(buf) - 1);
    close(fd);
    if (n <= 0)
        return 0;
    buf[n] = '\0';
    char *p = strrchr(buf, ')');
    if (!p)
        return 0;
    p++;
    for (int field = 2; field < 22 && p; field++) {
        p = strchr(p, ' ');
        if (p)
            p++;
    }
    return p ? strtoull(p, NULL, 10) : 0;
}

void gn_table_reset(void)
{
    /* Fresh zero pages, whatever the parent had in them. */
    void *p = mmap(gn_table, sizeof(gn_table), PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED, -1,
                   0);
    if (p == MAP_FAILED)
        memset(gn_table, 0, sizeof(gn_table));
}

static void gn_prefork(void)
{
    pthread_mutex_lock(&gn_lock);
}

static void gn_postfork_parent(void)
{
    pthread_mutex_unlock(&gn_lock);
}

/* The child is a new process: it must not use the parent's slot, lock,
 * allocations or launch events; it claims its own slot on its first
 * allocation or launch. */
static void gn_postfork_child(void)
{
    pthread_mutex_init(&gn_lock, NULL);
    int phase = atomic_load(&gn_hot.phase);
    if (phase == GN_PHASE_READY || phase == GN_PHASE_UNREGISTERED) {
        if (gn_region.usage_fd >= 0) {
            close(gn_region.usage_fd);
            gn_region.usage_fd = -1;
        }
        gn_hot.slot = NULL;
        gn_slot_index = -1;
        gn_table_reset();
        atomic_store(&gn_hot.phase, GN_PHASE_UNREGISTERED);
    }
    gn_compute_after_fork();
}

__attribute__((constructor)) static void gn_constructor(void)
{
    gn_log_setup();
    for (int i = 0; i < GN_MAX_ORDINALS; i++)
        atomic_init(&gn_ordinal_map[i], GN_ORDINAL_UNKNOWN);
    pthread_atfork(gn_prefork, gn_postfork_parent, gn_postfork_child);
}

static void gn_describe_region(const char *dir)
{
    if (gn_log_level < GN_LOG_INFO)
        return;
    for (uint32_t d = 0; d < gn_region.limit.device_count; d++) {
        char cap[64], total[64];
        gn_log(GN_LOG_INFO, "region %s: device %u %s capped at %s of %s%s", dir, d, gn_region.limit.devices[d].uuid,
               gn_format_bytes(cap, sizeof(cap), gn_region.limit.devices[d].limit_bytes),
               gn_format_bytes(total, sizeof(total), gn_region.limit.devices[d].total_bytes),
               gn_fail_open_flag ? " (fail-open)" : "");
    }
}

/* The region at the fixed path must be the agent's: its limit file on a
 * read-only mount, and the bytes loaded the bytes of that file. */
static int gn_refuse_untrusted(const char *dir, const char *why)
{
    gn_log(GN_LOG_ERROR, "memory-cap region %s is refused: %s; refusing every GPU allocation (fail-closed)", dir,
           why);
    gpunode_memcap_region_close(&gn_region);
    return GN_PHASE_CLOSED;
}

static int gn_load_region_locked(void)
{
    int fixed = 0;
    const char *dir = gn_region_dir(&fixed);
    static struct gpunode_memcap_limit mounted;
    char reason[PATH_MAX + 128];
    if (fixed && !gn_read_only_limit(dir, &mounted, reason, sizeof(reason)))
        return gn_refuse_untrusted(dir, reason);
    int rc = gpunode_memcap_region_open(&gn_region, dir, 1);
    if (fixed && gn_region.limit_valid && memcmp(&mounted, &gn_region.limit, sizeof(mounted)) != 0)
        return gn_refuse_untrusted(dir, "the limit file changed while it was read");
    if (rc == GPUNODE_MEMCAP_OK) {
        gn_fail_open_flag = (gn_region.limit.flags & GPUNODE_MEMCAP_FLAG_FAIL_OPEN) != 0;
        gn_hot.device_count = gn_region.limit.device_count;
        gn_hot.usage = gn_region.usage;
        for (uint32_t d = 0; d < gn_region.limit.device_count; d++) {
            uint64_t limit = gn_region.limit.devices[d].limit_bytes;
            gn_hot.limit_bytes[d] = limit > GN_MAX_TRACKED_BYTES ? GN_MAX_TRACKED_BYTES : limit;
        }
        gn_describe_region(dir);
        return GN_PHASE_UNREGISTERED;
    }
    int err = gpunode_memcap_region_errno(&gn_region);
    const char *why = gpunode_memcap_strerror(rc);
    if (rc == GPUNODE_MEMCAP_ERR_NO_REGION) {
        gn_log(GN_LOG_ERROR, "no memory-cap region at %s (set %s); refusing every GPU allocation (fail-closed)", dir,
               GPUNODE_MEMCAP_ENV_REGION);
        return GN_PHASE_CLOSED;
    }
    if (gn_region.limit_valid && (gn_region.limit.flags & GPUNODE_MEMCAP_FLAG_FAIL_OPEN)) {
        gn_log(GN_LOG_WARN, "memory-cap region %s is unusable: %s%s%s; the limit file says fail-open, so allocations"
               " pass through uncapped", dir, why, err ? ": " : "", err ? strerror(err) : "");
        gpunode_memcap_region_close(&gn_region);
        return GN_PHASE_OPEN;
    }
    gn_log(GN_LOG_ERROR, "memory-cap region %s is unusable: %s%s%s; refusing every GPU allocation (fail-closed)", dir,
           why, err ? ": " : "", err ? strerror(err) : "");
    gpunode_memcap_region_close(&gn_region);
    return GN_PHASE_CLOSED;
}

static int gn_register_locked(void)
{
    int rc = GPUNODE_MEMCAP_OK;
    if (gn_region.usage_fd < 0)
        rc = gpunode_memcap_region_reopen_fd(&gn_region);
    int slot = -1;
    if (rc == GPUNODE_MEMCAP_OK)
        rc = gpunode_memcap_slot_claim(&gn_region, (int32_t)getpid(), gn_start_ticks(), &slot);
    if (rc != GPUNODE_MEMCAP_OK) {
        int err = gpunode_memcap_region_errno(&gn_region);
        gn_log(GN_LOG_ERROR, "cannot register this process in region %s: %s%s%s; %s", gn_region.dir,
               gpunode_memcap_strerror(rc), err ? ": " : "", err ? strerror(err) : "",
               gn_fail_open_flag ? "passing the allocation through (fail-open)" : "refusing the allocation");
        return gn_fail_open_flag ? GN_PASS : GN_DENY;
    }
    gn_slot_index = slot;
    gn_hot.slot = &gn_region.usage->slots[slot];
    atomic_store_explicit(&gn_hot.phase, GN_PHASE_READY, memory_order_release);
    GN_LOG(GN_LOG_INFO, "registered in region %s as slot %d", gn_region.dir, slot);
    return GN_TRACK;
}

static int gn_verdict_of(int phase)
{
    switch (phase) {
    case GN_PHASE_READY:
        return GN_TRACK;
    case GN_PHASE_OPEN:
        return GN_PASS;
    default:
        return GN_DENY;
    }
}

static int gn_load_locked(void)
{
    int phase = atomic_load(&gn_hot.phase);
    if (phase == GN_PHASE_UNINIT) {
        phase = gn_load_region_locked();
        atomic_store_explicit(&gn_hot.phase, phase, memory_order_release);
    }
    return phase;
}

int gn_enter_slow(void)
{
    pthread_mutex_lock(&gn_lock);
    int phase = gn_load_locked();
    int verdict = phase == GN_PHASE_UNREGISTERED ? gn_register_locked() : gn_verdict_of(phase);
    pthread_mutex_unlock(&gn_lock);
    return verdict;
}

static int gn_ensure_loaded(void)
{
    int phase = atomic_load_explicit(&gn_hot.phase, memory_order_acquire);
    if (GN_LIKELY(phase != GN_PHASE_UNINIT))
        return phase;
    pthread_mutex_lock(&gn_lock);
    phase = gn_load_locked();
    pthread_mutex_unlock(&gn_lock);
    return phase;
}

/* Reclaim dead processes' usage, at most every 50 ms per process. */
static int gn_try_reclaim(void)
{
    int64_t now = gn_now_ns();
    int64_t last = atomic_load(&gn_last_reclaim_ns);
    if (last && now - last < 50 * 1000000LL)
        return 0;
    atomic_store(&gn_last_reclaim_ns, now);
    uint64_t bytes = 0;
    uint32_t slots = 0;
    pthread_mutex_lock(&gn_lock);
    if (atomic_load(&gn_hot.phase) == GN_PHASE_READY)
        gpunode_memcap_reclaim_dead(&gn_region, gn_slot_index, &bytes, &slots);
    pthread_mutex_unlock(&gn_lock);
    if (slots)
        GN_LOG(GN_LOG_INFO, "reclaimed %llu bytes from %u exited process(es)", (unsigned long long)bytes, slots);
    return bytes > 0;
}

GN_COLD int gn_reserve_cold(unsigned dev, uint64_t bytes)
{
    if (gn_try_reclaim() &&
        gpunode_memcap_try_add(&gn_hot.usage->used_bytes[dev], bytes, gn_hot.limit_bytes[dev])) {
        atomic_fetch_add_explicit(&gn_hot.slot->used_bytes[dev], bytes, memory_order_relaxed);
        return GN_TRACK;
    }
    uint64_t n = atomic_fetch_add(&gn_refusals, 1);
    int level = n < 8 ? GN_LOG_WARN : GN_LOG_DEBUG;
    if (level <= gn_log_level) {
        char want[64], used[64], cap[64];
        gn_log(level, "refused %s on device %u (%s): %s in use of a %s cap%s",
               gn_format_bytes(want, sizeof(want), bytes), dev, gn_region.limit.devices[dev].uuid,
               gn_format_bytes(used, sizeof(used), atomic_load(&gn_hot.usage->used_bytes[dev])),
               gn_format_bytes(cap, sizeof(cap), gn_hot.limit_bytes[dev]),
               n == 7 ? "; further refusals are logged at debug level" : "");
    }
    return GN_DENY;
}

CUresult gn_denied(int verdict, CUresult err, const char *what, uint64_t bytes)
{
    if (verdict == GN_FAIL)
        return err;
    GN_LOG(GN_LOG_DEBUG, "%s of %llu bytes refused", what, (unsigned long long)bytes);
    return CUDA_ERROR_OUT_OF_MEMORY;
}

void gn_lost_tracking(const char *what, uint64_t key, uint64_t bytes)
{
    gn_log(GN_LOG_ERROR, "%s: cannot track allocation 0x%llx (%llu bytes): the pointer table is full", what,
           (unsigned long long)key, (unsigned long long)bytes);
}

CUresult gn_missing(int id)
{
    gn_log(GN_LOG_ERROR, "%s called but the driver's %s cannot be found (is %s loaded?)", gn_hooks[id].name,
           gn_hooks[id].name, gn_hooks[id].library == GN_LIB_CUDA ? "libcuda.so.1" : "libnvidia-ml.so.1");
    return gn_hooks[id].library == GN_LIB_CUDA ? CUDA_ERROR_NOT_INITIALIZED : NVML_ERROR_FUNCTION_NOT_FOUND;
}

/* ---- which region device a CUDA device is ---- */

static const char *gn_uuid_body(const char *uuid)
{
    if (strncmp(uuid, "GPU-", 4) == 0 || strncmp(uuid, "MIG-", 4) == 0)
        return uuid + 4;
    return uuid;
}

static int gn_map_ordinal(int ordinal)
{
    CUuuid raw;
    CUresult r = CUDA_ERROR_NOT_FOUND;
    __typeof__(&cuDeviceGetUuid_v2) get_v2 = GN_REAL(cuDeviceGetUuid_v2);
    if (get_v2)
        r = get_v2(&raw, ordinal);
    if (r != CUDA_SUCCESS) {
        __typeof__(&cuDeviceGetUuid) get = GN_REAL(cuDeviceGetUuid);
        if (get)
            r = get(&raw, ordinal);
    }
    if (r == CUDA_SUCCESS) {
        const unsigned char *b = (const unsigned char *)raw.bytes;
        char hex[40];
        snprintf(hex, sizeof(hex), "%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x", b[0], b[1],
                 b[2], b[3], b[4], b[5], b[6], b[7], b[8], b[9], b[10], b[11], b[12], b[13], b[14], b[15]);
        for (uint32_t d = 0; d < gn_hot.device_count; d++)
            if (strcasecmp(gn_uuid_body(gn_region.limit.devices[d].uuid), hex) == 0)
                return (int)d;
        GN_LOG(GN_LOG_WARN, "CUDA device %d (%s) is not one of this region's devices", ordinal, hex);
        return GN_ORDINAL_OUTSIDE;
    }
    if (ordinal >= 0 && (uint32_t)ordinal < gn_hot.device_count) {
        GN_LOG(GN_LOG_INFO, "cannot read the UUID of CUDA device %d; assuming region device %d", ordinal, ordinal);
        return ordinal;
    }
    return GN_ORDINAL_OUTSIDE;
}

static int gn_ordinal_to_index(int ordinal)
{
    if (gn_hot.device_count == 1)
        return 0;
    if (ordinal < 0)
        return GN_ORDINAL_OUTSIDE;
    if (ordinal < GN_MAX_ORDINALS) {
        int m = atomic_load_explicit(&gn_ordinal_map[ordinal], memory_order_relaxed);
        if (m != GN_ORDINAL_UNKNOWN)
            return m;
    }
    int m = gn_map_ordinal(ordinal);
    if (ordinal < GN_MAX_ORDINALS)
        atomic_store_explicit(&gn_ordinal_map[ordinal], m, memory_order_relaxed);
    return m;
}

int gn_device_index(int ordinal, unsigned *dev, CUresult *err)
{
    if (ordinal < 0) {
        __typeof__(&cuCtxGetDevice) get = GN_REAL(cuCtxGetDevice);
        if (!get) {
            *err = gn_missing(GN_ID_cuCtxGetDevice);
            return GN_FAIL;
        }
        CUdevice current;
        CUresult r = get(&current);
        if (r != CUDA_SUCCESS) {
            *err = r;
            return GN_FAIL;
        }
        ordinal = current;
    }
    int m = gn_ordinal_to_index(ordinal);
    if (m >= 0) {
        *dev = (unsigned)m;
        return GN_TRACK;
    }
    return gn_fail_open_flag ? GN_PASS : GN_DENY;
}

int gn_query_device(int ordinal, unsigned *dev)
{
    int phase = gn_ensure_loaded();
    if (phase == GN_PHASE_OPEN)
        return GN_PASS;
    if (phase == GN_PHASE_CLOSED)
        return GN_DENY;
    if (gn_hot.device_count == 1) {
        *dev = 0;
        return GN_TRACK;
    }
    if (ordinal < 0) {
        __typeof__(&cuCtxGetDevice) get = GN_REAL(cuCtxGetDevice);
        CUdevice current;
        if (!get || get(&current) != CUDA_SUCCESS)
            return GN_PASS;
        ordinal = current;
    }
    int m = gn_ordinal_to_index(ordinal);
    if (m < 0)
        return GN_PASS;
    *dev = (unsigned)m;
    return GN_TRACK;
}

/* NVML names devices by handle; match its UUID string against the region. */
int gn_query_nvml_device(nvmlDevice_t device, unsigned *dev)
{
    int phase = gn_ensure_loaded();
    if (phase == GN_PHASE_OPEN)
        return GN_PASS;
    if (phase == GN_PHASE_CLOSED)
        return GN_DENY;
    char uuid[NVML_DEVICE_UUID_V2_BUFFER_SIZE];
    __typeof__(&nvmlDeviceGetUUID) get = GN_REAL(nvmlDeviceGetUUID);
    if (!get || get(device, uuid, sizeof(uuid)) != NVML_SUCCESS) {
        if (gn_hot.device_count != 1)
            return GN_PASS;
        *dev = 0;
        return GN_TRACK;
    }
    for (uint32_t d = 0; d < gn_hot.device_count; d++) {
        if (strcasecmp(gn_uuid_body(gn_region.limit.devices[d].uuid), gn_uuid_body(uuid)) == 0) {
            *dev = d;
            return GN_TRACK;
        }
    }
    return GN_PASS;
}
