/*
 * gpunode_memcap.h: the memory-cap region, the one contract between the agent
 * (Python, through the CFFI module gpunode._memcap) and the preload library
 * (libgpunode-preload.so) running inside a container.
 *
 * A region is a directory with two files:
 *
 *   limit  written once by the agent, mounted read-only into the container:
 *          magic, layout version, generation, flags and, per device, the GPU
 *          UUID, the cap and the device's total memory, sealed by a checksum.
 *   usage  shared read-write by every process of the container (mmap):
 *          magic, version, the same generation, per-device usage counters and
 *          a table of per-process slots. Counters are C11 atomics; usage is
 *          reserved with compare-and-swap against the cap before the driver
 *          is called, so racing processes can never pass the cap together.
 *
 * A process owns a slot while it holds an open-file-description lock on the
 * slot's byte of the usage file; the kernel drops the lock when the process
 * dies (even by SIGKILL) or execs, which is how dead processes are found and
 * their usage reclaimed, across pid namespaces and without trusting pids.
 *
 * The block between the two "cffi" markers is also read verbatim by
 * native/build_ffi.py as the CFFI declarations, so it must stay plain C:
 * integer #defines, enums, plain structs, prototypes; no _Atomic, no macros
 * with arguments, no conditionals. Everything below the closing marker is
 * for C only.
 */
#ifndef GPUNODE_MEMCAP_H
#define GPUNODE_MEMCAP_H

#include <stddef.h>
#include <stdint.h>

/* >>> cffi */

/* "GPNLIMIT" and "GPNUSAGE" read as little-endian 64-bit words. */
#define GPUNODE_MEMCAP_LIMIT_MAGIC 0x54494d494c4e5047
#define GPUNODE_MEMCAP_USAGE_MAGIC 0x45474153554e5047
#define GPUNODE_MEMCAP_LAYOUT_VERSION 2
#define GPUNODE_MEMCAP_MAX_DEVICES 8
#define GPUNODE_MEMCAP_MAX_PROCS 256
#define GPUNODE_MEMCAP_UUID_BYTES 96
#define GPUNODE_MEMCAP_FLAG_FAIL_OPEN 1
#define GPUNODE_MEMCAP_KNOWN_FLAGS 1
/* Compute share (layout version 2): thousandths of the GPU, and the mode. */
#define GPUNODE_COMPUTE_MILLI_PER_GPU 1000
#define GPUNODE_COMPUTE_MODE_OFF 0             /* account only; never throttle */
#define GPUNODE_COMPUTE_MODE_HARD 1            /* never above the share */
#define GPUNODE_COMPUTE_MODE_WORK_CONSERVING 2 /* above the share while the GPU is idle */
#define GPUNODE_COMPUTE_BURST_MS 50            /* the budget holds at most share x this much time */

enum gpunode_memcap_status {
    GPUNODE_MEMCAP_OK = 0,
    GPUNODE_MEMCAP_ERR_NO_REGION = 1,   /* the limit file does not exist */
    GPUNODE_MEMCAP_ERR_IO = 2,          /* open/read/mmap/fcntl failed; see the region's errno */
    GPUNODE_MEMCAP_ERR_SIZE = 3,        /* a file has the wrong size */
    GPUNODE_MEMCAP_ERR_MAGIC = 4,
    GPUNODE_MEMCAP_ERR_VERSION = 5,
    GPUNODE_MEMCAP_ERR_CHECKSUM = 6,
    GPUNODE_MEMCAP_ERR_DEVICES = 7,     /* device count out of range, or a bad UUID */
    GPUNODE_MEMCAP_ERR_LIMIT = 8,       /* a cap of 0, or a cap above the device's total */
    GPUNODE_MEMCAP_ERR_GENERATION = 9,  /* the usage file does not belong to the limit file */
    GPUNODE_MEMCAP_ERR_NO_SLOT = 10,    /* every process slot is held by a live process */
    GPUNODE_MEMCAP_ERR_OVER_LIMIT = 11, /* the reservation would pass the cap */
    GPUNODE_MEMCAP_ERR_ARGUMENT = 12,
    GPUNODE_MEMCAP_ERR_FLAGS = 13,      /* unknown flag bits in the limit file */
    GPUNODE_MEMCAP_ERR_FAULT = 14       /* the usage file shrank under a guarded call (guard.h) */
};

struct gpunode_memcap_limit_device {
    char uuid[GPUNODE_MEMCAP_UUID_BYTES]; /* "GPU-..." or "MIG-...", NUL-terminated */
    uint64_t limit_bytes;                 /* the cap: 0 < limit_bytes <= total_bytes */
    uint64_t total_bytes;                 /* the device's memory as the agent saw it */
};

/* The limit file: exactly sizeof(struct gpunode_memcap_limit) bytes. */
struct gpunode_memcap_limit {
    uint64_t magic;
    uint32_t version;
    uint32_t size;
    uint64_t generation; /* random, nonzero; the usage file carries the same value */
    uint32_t flags;
    uint32_t device_count;
    struct gpunode_memcap_limit_device devices[GPUNODE_MEMCAP_MAX_DEVICES];
    uint64_t checksum; /* FNV-1a 64 of every byte before this field */
};

/* A consistent-enough snapshot of the usage file, for readers. */
struct gpunode_memcap_process_report {
    uint64_t token;     /* the slot's claim token; unique for the region's life */
    int32_t pid;        /* as the process saw itself (its own pid namespace) */
    int32_t alive;      /* 1: lock held, 0: owner gone, -1: could not tell */
    uint64_t start_ticks; /* the process's start time in clock ticks since boot */
    uint64_t used_bytes[GPUNODE_MEMCAP_MAX_DEVICES];
    uint64_t busy_ns;      /* GPU time this process's work took, as the interposer measured it */
    uint64_t throttled_ns; /* time its launches were held back */
    uint64_t launches;
};

/* The compute part of the usage file, as read (every field is written by
 * whoever can write the usage file, the container included). */
struct gpunode_compute_report {
    uint32_t share_milli; /* 0: no share set */
    uint32_t mode;
    uint32_t generation;  /* bumped by the agent on every change */
    uint32_t reserved;
    int64_t budget_ns;
    uint64_t busy_ns;
    uint64_t throttled_ns;
    uint64_t launches;
};

struct gpunode_memcap_report {
    uint32_t device_count;
    uint32_t process_count;
    uint64_t registrations;
    uint64_t used_bytes[GPUNODE_MEMCAP_MAX_DEVICES];
    struct gpunode_memcap_process_report processes[GPUNODE_MEMCAP_MAX_PROCS];
    struct gpunode_compute_report compute;
};

struct gpunode_memcap_region;

const char *gpunode_memcap_strerror(int status);
const char *gpunode_memcap_default_region_dir(void);
uint64_t gpunode_memcap_checksum(const void *data, size_t len);

/* Limit file: fill generation, flags, device_count and devices, then seal. */
int gpunode_memcap_limit_seal(struct gpunode_memcap_limit *limit);
int gpunode_memcap_limit_check(const struct gpunode_memcap_limit *limit);

/* Usage file: the byte size and the initial contents for a sealed limit. */
size_t gpunode_memcap_usage_size(void);
int gpunode_memcap_usage_format(void *buf, size_t len, const struct gpunode_memcap_limit *limit);

/* Opening a region directory (the agent's view, or the library's). */
struct gpunode_memcap_region *gpunode_memcap_region_new(void);
void gpunode_memcap_region_free(struct gpunode_memcap_region *region);
int gpunode_memcap_region_open(struct gpunode_memcap_region *region, const char *dir, int writable);
void gpunode_memcap_region_close(struct gpunode_memcap_region *region);
int gpunode_memcap_region_errno(const struct gpunode_memcap_region *region);
int gpunode_memcap_region_copy_limit(const struct gpunode_memcap_region *region,
                                     struct gpunode_memcap_limit *out);

/* Process slots and accounting. slot is the caller's own slot index. */
int gpunode_memcap_slot_claim(struct gpunode_memcap_region *region, int32_t pid, uint64_t start_ticks,
                              int *slot_out);
int gpunode_memcap_slot_release(struct gpunode_memcap_region *region, int slot);
int gpunode_memcap_reserve(struct gpunode_memcap_region *region, int slot, uint32_t device, uint64_t bytes);
int gpunode_memcap_release(struct gpunode_memcap_region *region, int slot, uint32_t device, uint64_t bytes);

/* Reclaim the usage of every slot whose owner is gone (never self_slot; -1
 * for none). With self_slot == -1 and no live process left, also zeroes
 * usage that no slot accounts for (a process killed between the two atomic
 * steps of a reservation). */
int gpunode_memcap_reclaim_dead(struct gpunode_memcap_region *region, int self_slot,
                                uint64_t *reclaimed_bytes, uint32_t *reclaimed_slots);
int gpunode_memcap_report(const struct gpunode_memcap_region *region, struct gpunode_memcap_report *out);

/* The agent's side of the compute share: set the share (1..1000 thousandths)
 * and mode, bumping the generation; the interposer reads them on every
 * refill. GPUNODE_MEMCAP_ERR_ARGUMENT for a share or mode out of range. */
int gpunode_compute_set(struct gpunode_memcap_region *region, uint32_t share_milli, uint32_t mode);

/* <<< cffi */

#include <limits.h>
#include <stdatomic.h>
#include <sys/types.h>

#define GPUNODE_MEMCAP_ENV_REGION "GPUNODE_MEMCAP_REGION"
#define GPUNODE_MEMCAP_ENV_LOG_LEVEL "GPUNODE_MEMCAP_LOG_LEVEL"
#define GPUNODE_MEMCAP_DEFAULT_DIR "/var/run/gpunode/memcap"
#define GPUNODE_MEMCAP_LIMIT_FILE "limit"
#define GPUNODE_MEMCAP_USAGE_FILE "usage"

/* One process's slot: 128 bytes, so two processes never share a cache line. */
struct gpunode_memcap_slot {
    _Atomic uint64_t token; /* 0: free; otherwise the owner's claim token */
    _Atomic int32_t pid;
    uint32_t reserved0;
    _Atomic uint64_t start_ticks;
    _Atomic uint64_t used_bytes[GPUNODE_MEMCAP_MAX_DEVICES];
    _Atomic uint64_t busy_ns; /* compute accounting (layout version 2) */
    _Atomic uint64_t throttled_ns;
    _Atomic uint64_t launches;
    uint8_t reserved1[16];
};

/* The compute share, one per container (all its processes draw on it).
 * control is written by the agent; the rest by the interposer. */
struct gpunode_compute {
    _Atomic uint64_t control;   /* gpunode_compute_pack(share, mode, generation) */
    _Atomic int64_t budget_ns;  /* GPU time the container may still use; below 0: debt */
    _Atomic uint64_t refill_ns; /* CLOCK_MONOTONIC time of the last refill */
    _Atomic uint64_t busy_ns;
    _Atomic uint64_t throttled_ns;
    _Atomic uint64_t launches;
    _Atomic uint64_t contended_ns; /* when a process last saw a neighbour's work delay its own */
    uint8_t reserved[8];
};

struct gpunode_memcap_usage {
    /* Written once when the file is formatted. */
    uint64_t magic;
    uint32_t version;
    uint32_t size;
    uint64_t generation;
    uint32_t device_count;
    uint32_t slot_count;
    _Atomic uint64_t next_token;    /* claim tokens are taken from here */
    _Atomic uint64_t registrations; /* bumped after every successful claim */
    uint8_t reserved0[16];
    /* The counters every reservation goes through: one cache line. */
    _Atomic uint64_t used_bytes[GPUNODE_MEMCAP_MAX_DEVICES];
    struct gpunode_memcap_slot slots[GPUNODE_MEMCAP_MAX_PROCS];
    struct gpunode_compute compute;
};

struct gpunode_memcap_region {
    struct gpunode_memcap_limit limit; /* a private, validated copy */
    struct gpunode_memcap_usage *usage;
    int usage_fd;
    int writable;
    int last_errno;
    int limit_valid; /* the limit part loaded even if the usage part did not */
    dev_t usage_dev; /* identity of the usage file, checked when it is reopened */
    ino_t usage_ino;
    char dir[PATH_MAX];
};

/* Open the usage file again (a new open file description, so new locks) after
 * fork; the mapping is kept. For the preload library only. */
int gpunode_memcap_region_reopen_fd(struct gpunode_memcap_region *region);

_Static_assert(sizeof(struct gpunode_memcap_slot) == 128, "slot layout");
_Static_assert(offsetof(struct gpunode_memcap_usage, used_bytes) == 64, "usage header layout");
_Static_assert(sizeof(struct gpunode_compute) == 64, "compute layout");
_Static_assert(sizeof(struct gpunode_memcap_usage) == 64 + 64 + 128 * GPUNODE_MEMCAP_MAX_PROCS + 64, "usage layout");
_Static_assert(sizeof(struct gpunode_memcap_limit) == 40 + (GPUNODE_MEMCAP_UUID_BYTES + 16) * GPUNODE_MEMCAP_MAX_DEVICES,
               "limit layout");
_Static_assert(ATOMIC_LLONG_LOCK_FREE == 2, "64-bit atomics must be lock-free to be shared between processes");

/* Byte of the usage file whose lock marks slot i as owned. */
static inline off_t gpunode_memcap_slot_lock_offset(int slot)
{
    return (off_t)(offsetof(struct gpunode_memcap_usage, slots) + (size_t)slot * sizeof(struct gpunode_memcap_slot));
}

/* Add bytes to *counter unless the result would pass limit. Relaxed order is
 * enough: the cap only needs the single modification order of one counter. */
static inline int gpunode_memcap_try_add(_Atomic uint64_t *counter, uint64_t bytes, uint64_t limit)
{
    uint64_t cur = atomic_load_explicit(counter, memory_order_relaxed);
    do {
        if (bytes > limit || cur > limit - bytes)
            return 0;
    } while (!atomic_compare_exchange_weak_explicit(counter, &cur, cur + bytes, memory_order_relaxed,
                                                    memory_order_relaxed));
    return 1;
}

/* The control word: share in bits 0-15, mode in 16-23, a check byte in
 * 24-31 (so a torn or scribbled word reads as invalid, not as a share), the
 * generation in 32-63. */
static inline uint8_t gpunode_compute_check(uint64_t share, uint64_t mode, uint64_t generation)
{
    uint64_t x = (share | mode << 16 | generation << 32) * 0x9E3779B97F4A7C15ULL;
    return (uint8_t)((x >> 56) ^ 0xa5);
}

static inline uint64_t gpunode_compute_pack(uint32_t share_milli, uint32_t mode, uint32_t generation)
{
    uint64_t s = share_milli & 0xffff, m = mode & 0xff, g = generation;
    return s | m << 16 | (uint64_t)gpunode_compute_check(s, m, g) << 24 | g << 32;
}

/* 1 and the fields if the word is well formed, else 0. */
static inline int gpunode_compute_unpack(uint64_t word, uint32_t *share_milli, uint32_t *mode, uint32_t *generation)
{
    uint64_t s = word & 0xffff, m = (word >> 16) & 0xff, g = word >> 32;
    if (((word >> 24) & 0xff) != gpunode_compute_check(s, m, g) || s > GPUNODE_COMPUTE_MILLI_PER_GPU ||
        m > GPUNODE_COMPUTE_MODE_WORK_CONSERVING)
        return 0;
    *share_milli = (uint32_t)s;
    *mode = (uint32_t)m;
    *generation = (uint32_t)g;
    return 1;
}

#endif /* GPUNODE_MEMCAP_H */
