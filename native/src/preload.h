/*
 * preload.h: what the parts of libgpunode-preload.so share: the hook table,
 * the hot state read on every allocation, the lock-free pointer table, the
 * inline accounting fast path, and the allocation and free bodies every
 * hook shares.
 *
 * Must not: be included by anything outside native/src (the region header is
 * the only public contract); declare anything exported except the hooks.
 */
#ifndef GPUNODE_PRELOAD_H
#define GPUNODE_PRELOAD_H

#include "cuda_types.h"
#include "gpunode_memcap.h"

#include <dlfcn.h>
#include <link.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>

#define GN_EXPORT __attribute__((visibility("default")))
#define GN_LIKELY(x) __builtin_expect(!!(x), 1)
#define GN_UNLIKELY(x) __builtin_expect(!!(x), 0)
#define GN_COLD __attribute__((cold, noinline))

/* ---- the hook table (expanded from hooks.def) ---- */

enum gn_library { GN_LIB_CUDA, GN_LIB_NVML };
enum gn_stream { GN_STREAM_ANY, GN_STREAM_LEGACY, GN_STREAM_PTSZ };

enum gn_hook_id {
#define GN_HOOK(name, library, base, since, stream) GN_ID_##name,
#define GN_CALL(name, library, base, since, stream) GN_ID_##name,
#include "hooks.def"
#undef GN_HOOK
#undef GN_CALL
    GN_ID_COUNT
};

struct gn_hook_info {
    const char *name;
    const char *base;
    void *hook; /* NULL for entry points we only call */
    int library;
    int since;
    int stream;
};

extern const struct gn_hook_info gn_hooks[GN_ID_COUNT];
extern _Atomic(void *) gn_real[GN_ID_COUNT];

void *gn_resolve_real(int id);
int gn_find_hook(const char *name);
int gn_is_hook_address(const void *p);

/* The driver's function for a hook id, resolved once. */
static inline void *gn_real_fn(int id)
{
    void *p = atomic_load_explicit(&gn_real[id], memory_order_acquire);
    if (GN_UNLIKELY(!p))
        p = gn_resolve_real(id);
    return p;
}

#define GN_REAL(name) ((__typeof__(&name))gn_real_fn(GN_ID_##name))

/* ---- logging ---- */

enum { GN_LOG_OFF = 0, GN_LOG_ERROR = 1, GN_LOG_WARN = 2, GN_LOG_INFO = 3, GN_LOG_DEBUG = 4 };
extern int gn_log_level;
void gn_log_setup(void);
void gn_log(int level, const char *fmt, ...) __attribute__((format(printf, 2, 3), cold));
const char *gn_format_bytes(char *buf, size_t len, uint64_t bytes);
#define GN_LOG(level, ...)                                                                                         \
    do {                                                                                                           \
        if (GN_UNLIKELY((level) <= gn_log_level))                                                                  \
            gn_log((level), __VA_ARGS__);                                                                          \
    } while (0)

/* ---- the hot state ---- */

enum gn_phase {
    GN_PHASE_UNINIT = 0,       /* nothing looked at yet */
    GN_PHASE_READY = 1,        /* region loaded, this process holds a slot */
    GN_PHASE_UNREGISTERED = 2, /* region loaded, no slot yet (first use, or after fork) */
    GN_PHASE_OPEN = 3,         /* fail-open: pass everything through uncounted */
    GN_PHASE_CLOSED = 4,       /* fail-closed: refuse every allocation */
};

/* What an accounting step decided. */
enum gn_verdict {
    GN_TRACK = 0, /* reserved: call the driver, then track or roll back */
    GN_PASS = 1,  /* call the driver without accounting */
    GN_DENY = 2,  /* return CUDA_ERROR_OUT_OF_MEMORY without calling the driver */
    GN_FAIL = 3,  /* return the CUresult the step produced */
};

struct gn_hot {
    _Atomic int phase;
    uint32_t device_count;
    struct gpunode_memcap_usage *usage;
    struct gpunode_memcap_slot *slot;
    uint64_t limit_bytes[GPUNODE_MEMCAP_MAX_DEVICES];
};

extern struct gn_hot gn_hot;

/* Where the region is (locate.c): the fixed, mounted path unless nothing is
 * there; *fixed says which. The fixed path's limit file must be read-only. */
const char *gn_region_dir(int *fixed);
int gn_read_only_limit(const char *dir, struct gpunode_memcap_limit *copy, char *why, size_t len);

int gn_enter_slow(void);
int gn_device_index(int ordinal, unsigned *dev, CUresult *err);
int gn_reserve_cold(unsigned dev, uint64_t bytes);
int gn_query_device(int ordinal, unsigned *dev);
int gn_query_nvml_device(nvmlDevice_t device, unsigned *dev);
CUresult gn_missing(int id);

/* Reserve bytes for an allocation on the device with CUDA ordinal `ordinal`
 * (-1: the current context's device). No syscall, no lock. */
static inline int gn_reserve(uint64_t bytes, int ordinal, unsigned *dev_out, CUresult *err)
{
    if (GN_UNLIKELY(atomic_load_explicit(&gn_hot.phase, memory_order_acquire) != GN_PHASE_READY)) {
        int verdict = gn_enter_slow();
        if (verdict != GN_TRACK)
            return verdict;
    }
    unsigned dev = 0;
    if (GN_UNLIKELY(gn_hot.device_count != 1)) {
        int verdict = gn_device_index(ordinal, &dev, err);
        if (verdict != GN_TRACK)
            return verdict;
    }
    *dev_out = dev;
    if (GN_LIKELY(gpunode_memcap_try_add(&gn_hot.usage->used_bytes[dev], bytes, gn_hot.limit_bytes[dev]))) {
        atomic_fetch_add_explicit(&gn_hot.slot->used_bytes[dev], bytes, memory_order_relaxed);
        return GN_TRACK;
    }
    return gn_reserve_cold(dev, bytes);
}

static inline void gn_unreserve(unsigned dev, uint64_t bytes)
{
    atomic_fetch_sub_explicit(&gn_hot.usage->used_bytes[dev], bytes, memory_order_relaxed);
    atomic_fetch_sub_explicit(&gn_hot.slot->used_bytes[dev], bytes, memory_order_relaxed);
}

/* ---- the pointer table: allocation key -> (bytes, device, kind) ---- */

#define GN_TABLE_BITS 18
#define GN_TABLE_SIZE (1u << GN_TABLE_BITS)
#define GN_TABLE_PROBES 64
#define GN_KEY_EMPTY 0ULL
#define GN_KEY_TOMB (~0ULL)
#define GN_KEY_BUSY (~0ULL - 1)
#define GN_MAX_TRACKED_BYTES ((1ULL << 48) - 1)

enum gn_kind { GN_KIND_MEM = 1, GN_KIND_VMM = 2, GN_KIND_ARRAY = 3, GN_KIND_MIPMAP = 4 };

struct gn_entry {
    _Atomic uint64_t key;
    _Atomic uint64_t val;
};

extern struct gn_entry gn_table[GN_TABLE_SIZE];

static inline uint64_t gn_pack(uint64_t bytes, unsigned dev, unsigned kind)
{
    return bytes | (uint64_t)dev << 48 | (uint64_t)kind << 56;
}
static inline uint64_t gn_val_bytes(uint64_t val)
{
    return val & GN_MAX_TRACKED_BYTES;
}
static inline unsigned gn_val_dev(uint64_t val)
{
    return (unsigned)(val >> 48) & 0xff;
}
static inline unsigned gn_val_kind(uint64_t val)
{
    return (unsigned)(val >> 56);
}

static inline uint32_t gn_hash(uint64_t key)
{
    return (uint32_t)((key * 0x9E3779B97F4A7C15ULL) >> (64 - GN_TABLE_BITS));
}

/* Insert: claim an empty or deleted entry (BUSY while the value is written,
 * so no reader pairs the key with a stale value). Keys are unique while
 * live: the driver does not hand out a pointer or handle twice. */
static inline int gn_table_put(uint64_t key, uint64_t val)
{
    if (GN_UNLIKELY(key == GN_KEY_EMPTY || key >= GN_KEY_BUSY))
        return 0;
    uint32_t i = gn_hash(key);
    for (unsigned n = 0; n < GN_TABLE_PROBES; n++, i = (i + 1) & (GN_TABLE_SIZE - 1)) {
        uint64_t k = atomic_load_explicit(&gn_table[i].key, memory_order_relaxed);
        if ((k == GN_KEY_EMPTY || k == GN_KEY_TOMB) &&
            atomic_compare_exchange_strong_explicit(&gn_table[i].key, &k, GN_KEY_BUSY, memory_order_acquire,
                                                    memory_order_relaxed)) {
            atomic_store_explicit(&gn_table[i].val, val, memory_order_relaxed);
            atomic_store_explicit(&gn_table[i].key, key, memory_order_release);
            return 1;
        }
    }
    return 0;
}

/* Remove and return the entry for key of the given kind; exactly one of two
 * racing removers wins. */
static inline int gn_table_take(uint64_t key, unsigned kind, uint64_t *val)
{
    uint32_t i = gn_hash(key);
    for (unsigned n = 0; n < GN_TABLE_PROBES; n++, i = (i + 1) & (GN_TABLE_SIZE - 1)) {
        uint64_t k = atomic_load_explicit(&gn_table[i].key, memory_order_acquire);
        if (k == GN_KEY_EMPTY)
            return 0;
        if (k == key) {
            uint64_t v = atomic_load_explicit(&gn_table[i].val, memory_order_relaxed);
            if (gn_val_kind(v) == kind) {
                if (!atomic_compare_exchange_strong_explicit(&gn_table[i].key, &k, GN_KEY_TOMB,
                                                             memory_order_relaxed, memory_order_relaxed))
                    return 0;
                *val = v;
                return 1;
            }
        }
    }
    return 0;
}

void gn_table_reset(void);
void gn_lost_tracking(const char *what, uint64_t key, uint64_t bytes);
CUresult gn_denied(int verdict, CUresult err, const char *what, uint64_t bytes);

/* ---- the one allocation body and the one free body ----
 *
 * Every allocation hook is
 *
 *     struct gn_alloc a;
 *     if (!gn_alloc_begin(&a, kind, bytes, ordinal, __func__))
 *         return a.refused;
 *     return gn_alloc_end(&a, real(...), out, sizeof *out);
 *
 * and every free hook is
 *
 *     uint64_t val = gn_free_begin(key, kind);
 *     return gn_free_end(real(...), key, val);
 *
 * (pitched allocations also move their estimate to the driver's real size
 * with gn_alloc_resize before gn_alloc_end). The driver is called in exactly
 * one place per hook. `a` never leaves these inline helpers (the cold paths
 * get the packed table value), so the compiler keeps it in registers and
 * the hot path costs what a hand-written body would. */

/* An allocation between its reservation and the driver's answer. */
struct gn_alloc {
    uint64_t bytes;   /* reserved, and recorded on success */
    unsigned dev;     /* region device index */
    unsigned kind;    /* enum gn_kind: how to free it again */
    int counted;      /* 0: passed through uncounted (fail-open) */
    CUresult refused; /* what the hook returns when gn_alloc_begin says no */
    const char *what; /* the hook's name, for log lines */
};

/* The pointer-table value that records the allocation. */
static inline uint64_t gn_alloc_val(const struct gn_alloc *a)
{
    return gn_pack(a->bytes, a->dev, a->kind);
}

/* Cold: free what the driver just allocated (`val` says how much, where,
 * and of which kind), return the reservation, refuse the allocation. */
CUresult gn_alloc_undo(uint64_t key, uint64_t val);
CUresult gn_alloc_lost(const char *what, uint64_t key, uint64_t val);

/* Reserve bytes (on the device with CUDA ordinal `ordinal`, -1: the current
 * context's). 1: call the driver, then gn_alloc_end; 0: refused, return
 * a->refused without calling it. */
static inline int gn_alloc_begin(struct gn_alloc *a, unsigned kind, uint64_t bytes, int ordinal, const char *what)
{
    unsigned dev = 0;
    CUresult err = CUDA_SUCCESS;
    int verdict = gn_reserve(bytes, ordinal, &dev, &err);
    a->bytes = bytes;
    a->dev = dev;
    a->kind = kind;
    a->counted = verdict == GN_TRACK;
    a->what = what;
    if (GN_LIKELY(verdict == GN_TRACK || verdict == GN_PASS))
        return 1;
    a->refused = gn_denied(verdict, err, what, bytes);
    return 0;
}

/* The key the driver wrote through the hook's output parameter: a 32-bit
 * legacy device pointer, a 64-bit pointer or handle, or an opaque pointer. */
static inline uint64_t gn_out_key(const void *out, size_t size)
{
    if (size == sizeof(uint32_t)) {
        uint32_t k;
        __builtin_memcpy(&k, out, sizeof(k));
        return k;
    }
    uint64_t k;
    __builtin_memcpy(&k, out, sizeof(k));
    return k;
}

/* After the driver's call `r`: roll the reservation back if it failed,
 * else record the key read from `out` so the matching free returns the
 * bytes. If the pointer table is full the allocation is undone and refused,
 * never left uncounted. */
static inline CUresult gn_alloc_end(const struct gn_alloc *a, CUresult r, const void *out, size_t out_size)
{
    if (GN_UNLIKELY(!a->counted))
        return r;
    if (GN_UNLIKELY(r != CUDA_SUCCESS)) {
        gn_unreserve(a->dev, a->bytes);
        return r;
    }
    uint64_t key = gn_out_key(out, out_size), val = gn_alloc_val(a);
    if (GN_UNLIKELY(!gn_table_put(key, val)))
        return gn_alloc_lost(a->what, key, val);
    return r;
}

/* Before the driver frees `key`: take its entry. 0: not one of ours (or
 * not of this kind), the free passes through. */
static inline uint64_t gn_free_begin(uint64_t key, unsigned kind)
{
    uint64_t val;
    return gn_table_take(key, kind, &val) ? val : 0;
}

/* After the driver's free `r`: return the bytes, or put the entry back if
 * the driver refused to free it. */
static inline CUresult gn_free_end(CUresult r, uint64_t key, uint64_t val)
{
    if (!val)
        return r;
    if (GN_LIKELY(r == CUDA_SUCCESS))
        gn_unreserve(gn_val_dev(val), gn_val_bytes(val));
    else if (GN_UNLIKELY(!gn_table_put(key, val)))
        gn_lost_tracking("restore after a failed free", key, gn_val_bytes(val));
    return r;
}

/* ---- the compute share (compute.c, hooks_launch.c) ---- */

extern _Atomic int64_t gn_estimate_ns; /* GPU time charged per launch at submission */
extern _Atomic int gn_compute_on;      /* the watcher runs: launches are measured */
int gn_compute_start(void);
void gn_compute_throttle(void);
uint64_t gn_pair_open(CUstream stream, int ptsz, int64_t estimate);
void gn_pair_close(uint64_t ticket, CUstream stream, int ptsz);
void gn_compute_after_fork(void);

/* ---- the dynamic loader (dlhooks.c, relink.c) ---- */

/* glibc's own functions, called from here (this library is the caller). */
void *gn_real_dlsym(void *handle, const char *name);
void *gn_real_dlopen(const char *file, int flags);
void *gn_real_dlmopen(Lmid_t lmid, const char *file, int flags);
int gn_is_dl_hook(const void *p);
uintptr_t gn_dyn_ptr(const struct link_map *lm, ElfW(Addr) p);
/* dlopen/dlmopen done here on the caller's behalf (RTLD_DEEPBIND, or a
 * namespace other than the base one). */
void *gn_load_on_behalf(Lmid_t lmid, int explicit_ns, const char *file, int flags, void *caller);

/* ---- arrays ---- */

uint64_t gn_array_bytes(uint64_t width, uint64_t height, uint64_t depth, int format, unsigned channels,
                        unsigned flags, unsigned levels);

#endif /* GPUNODE_PRELOAD_H */
