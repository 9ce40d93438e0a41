/*
 * region.c: the one implementation of the memory-cap region (see
 * gpunode_memcap.h), compiled into both the preload library and the CFFI
 * module gpunode._memcap, so the agent and the container never disagree on
 * the layout, the checks or the reclaim protocol.
 *
 * Must not: call the CUDA driver, log (callers decide what to say), allocate
 * memory outside gpunode_memcap_region_new, or hold any lock of its own.
 */
#define _GNU_SOURCE
#include "gpunode_memcap.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

static const char *const status_text[] = {
    [GPUNODE_MEMCAP_OK] = "ok",
    [GPUNODE_MEMCAP_ERR_NO_REGION] = "no region (the limit file does not exist)",
    [GPUNODE_MEMCAP_ERR_IO] = "input/output error",
    [GPUNODE_MEMCAP_ERR_SIZE] = "a region file has the wrong size",
    [GPUNODE_MEMCAP_ERR_MAGIC] = "bad magic number",
    [GPUNODE_MEMCAP_ERR_VERSION] = "unsupported layout version",
    [GPUNODE_MEMCAP_ERR_CHECKSUM] = "checksum mismatch (the limit file is corrupt)",
    [GPUNODE_MEMCAP_ERR_DEVICES] = "bad device table",
    [GPUNODE_MEMCAP_ERR_LIMIT] = "bad limit (zero, or above the device's memory)",
    [GPUNODE_MEMCAP_ERR_GENERATION] = "the usage file does not belong to the limit file",
    [GPUNODE_MEMCAP_ERR_NO_SLOT] = "every process slot is held by a live process",
    [GPUNODE_MEMCAP_ERR_OVER_LIMIT] = "over the limit",
    [GPUNODE_MEMCAP_ERR_ARGUMENT] = "invalid argument",
    [GPUNODE_MEMCAP_ERR_FLAGS] = "unknown flags in the limit file",
    [GPUNODE_MEMCAP_ERR_FAULT] = "the usage file shrank while it was being read",
};

const char *gpunode_memcap_strerror(int status)
{
    if (status < 0 || (size_t)status >= sizeof(status_text) / sizeof(status_text[0]) || !status_text[status])
        return "unknown status";
    return status_text[status];
}

const char *gpunode_memcap_default_region_dir(void)
{
    return GPUNODE_MEMCAP_DEFAULT_DIR;
}

uint64_t gpunode_memcap_checksum(const void *data, size_t len)
{
    const unsigned char *p = data;
    uint64_t h = 0xcbf29ce484222325ULL;
    for (size_t i = 0; i < len; i++) {
        h ^= p[i];
        h *= 0x100000001b3ULL;
    }
    return h;
}

static int is_zero(const void *data, size_t len)
{
    const unsigned char *p = data;
    for (size_t i = 0; i < len; i++)
        if (p[i])
            return 0;
    return 1;
}

static int check_uuid(const char *uuid)
{
    const char *end = memchr(uuid, '\0', GPUNODE_MEMCAP_UUID_BYTES);
    if (!end || end == uuid)
        return 0;
    for (const char *c = uuid; c < end; c++)
        if (*c <= ' ' || *c > '~')
            return 0;
    return is_zero(end, (size_t)(uuid + GPUNODE_MEMCAP_UUID_BYTES - end));
}

static int check_contents(const struct gpunode_memcap_limit *limit)
{
    if (limit->flags & ~(uint32_t)GPUNODE_MEMCAP_KNOWN_FLAGS)
        return GPUNODE_MEMCAP_ERR_FLAGS;
    if (limit->generation == 0)
        return GPUNODE_MEMCAP_ERR_GENERATION;
    if (limit->device_count == 0 || limit->device_count > GPUNODE_MEMCAP_MAX_DEVICES)
        return GPUNODE_MEMCAP_ERR_DEVICES;
    for (uint32_t d = 0; d < GPUNODE_MEMCAP_MAX_DEVICES; d++) {
        const struct gpunode_memcap_limit_device *dev = &limit->devices[d];
        if (d >= limit->device_count) {
            if (!is_zero(dev, sizeof(*dev)))
                return GPUNODE_MEMCAP_ERR_DEVICES;
            continue;
        }
        if (!check_uuid(dev->uuid))
            return GPUNODE_MEMCAP_ERR_DEVICES;
        for (uint32_t e = 0; e < d; e++)
            if (strcmp(limit->devices[e].uuid, dev->uuid) == 0)
                return GPUNODE_MEMCAP_ERR_DEVICES;
        if (dev->limit_bytes == 0 || dev->total_bytes == 0 || dev->limit_bytes > dev->total_bytes)
            return GPUNODE_MEMCAP_ERR_LIMIT;
    }
    return GPUNODE_MEMCAP_OK;
}

int gpunode_memcap_limit_seal(struct gpunode_memcap_limit *limit)
{
    if (!limit)
        return GPUNODE_MEMCAP_ERR_ARGUMENT;
    limit->magic = GPUNODE_MEMCAP_LIMIT_MAGIC;
    limit->version = GPUNODE_MEMCAP_LAYOUT_VERSION;
    limit->size = (uint32_t)sizeof(*limit);
    int rc = check_contents(limit);
    if (rc != GPUNODE_MEMCAP_OK)
        return rc;
    limit->checksum = gpunode_memcap_checksum(limit, offsetof(struct gpunode_memcap_limit, checksum));
    return GPUNODE_MEMCAP_OK;
}

int gpunode_memcap_limit_check(const struct gpunode_memcap_limit *limit)
{
    if (!limit)
        return GPUNODE_MEMCAP_ERR_ARGUMENT;
    if (limit->magic != GPUNODE_MEMCAP_LIMIT_MAGIC)
        return GPUNODE_MEMCAP_ERR_MAGIC;
    if (limit->version != GPUNODE_MEMCAP_LAYOUT_VERSION)
        return GPUNODE_MEMCAP_ERR_VERSION;
    if (limit->size != sizeof(*limit))
        return GPUNODE_MEMCAP_ERR_SIZE;
    if (limit->checksum != gpunode_memcap_checksum(limit, offsetof(struct gpunode_memcap_limit, checksum)))
        return GPUNODE_MEMCAP_ERR_CHECKSUM;
    return check_contents(limit);
}

size_t gpunode_memcap_usage_size(void)
{
    return sizeof(struct gpunode_memcap_usage);
}

int gpunode_memcap_usage_format(void *buf, size_t len, const struct gpunode_memcap_limit *limit)
{
    if (!buf || len != sizeof(struct gpunode_memcap_usage))
        return GPUNODE_MEMCAP_ERR_ARGUMENT;
    int rc = gpunode_memcap_limit_check(limit);
    if (rc != GPUNODE_MEMCAP_OK)
        return rc;
    struct gpunode_memcap_usage *u = buf;
    memset(u, 0, sizeof(*u));
    u->magic = GPUNODE_MEMCAP_USAGE_MAGIC;
    u->version = GPUNODE_MEMCAP_LAYOUT_VERSION;
    u->size = (uint32_t)sizeof(*u);
    u->generation = limit->generation;
    u->device_count = limit->device_count;
    u->slot_count = GPUNODE_MEMCAP_MAX_PROCS;
    atomic_store(&u->compute.control, gpunode_compute_pack(0, GPUNODE_COMPUTE_MODE_OFF, 0));
    return GPUNODE_MEMCAP_OK;
}

struct gpunode_memcap_region *gpunode_memcap_region_new(void)
{
    struct gpunode_memcap_region *r = calloc(1, sizeof(*r));
    if (r)
        r->usage_fd = -1;
    return r;
}

void gpunode_memcap_region_close(struct gpunode_memcap_region *r)
{
    if (!r)
        return;
    if (r->usage)
        munmap(r->usage, sizeof(*r->usage));
    if (r->usage_fd >= 0)
        close(r->usage_fd);
    r->usage = NULL;
    r->usage_fd = -1;
    r->limit_valid = 0;
}

void gpunode_memcap_region_free(struct gpunode_memcap_region *r)
{
    gpunode_memcap_region_close(r);
    free(r);
}

int gpunode_memcap_region_errno(const struct gpunode_memcap_region *r)
{
    return r ? r->last_errno : EINVAL;
}

int gpunode_memcap_region_copy_limit(const struct gpunode_memcap_region *r, struct gpunode_memcap_limit *out)
{
    if (!r || !out || !r->limit_valid)
        return GPUNODE_MEMCAP_ERR_ARGUMENT;
    *out = r->limit;
    return GPUNODE_MEMCAP_OK;
}

static int join_path(char *out, const char *dir, const char *name)
{
    int n = snprintf(out, PATH_MAX, "%s/%s", dir, name);
    return n > 0 && n < PATH_MAX;
}

static int load_limit(struct gpunode_memcap_region *r)
{
    char path[PATH_MAX];
    if (!join_path(path, r->dir, GPUNODE_MEMCAP_LIMIT_FILE))
        return GPUNODE_MEMCAP_ERR_ARGUMENT;
    int fd = open(path, O_RDONLY | O_NONBLOCK | O_CLOEXEC | O_NOCTTY);
    if (fd < 0) {
        r->last_errno = errno;
        return errno == ENOENT ? GPUNODE_MEMCAP_ERR_NO_REGION : GPUNODE_MEMCAP_ERR_IO;
    }
    struct stat st;
    int rc = GPUNODE_MEMCAP_OK;
    if (fstat(fd, &st) != 0) {
        r->last_errno = errno;
        rc = GPUNODE_MEMCAP_ERR_IO;
    } else if (!S_ISREG(st.st_mode) || st.st_size != (off_t)sizeof(r->limit)) {
        rc = GPUNODE_MEMCAP_ERR_SIZE;
    } else {
        size_t done = 0;
        while (done < sizeof(r->limit)) {
            ssize_t n = read(fd, (char *)&r->limit + done, sizeof(r->limit) - done);
            if (n < 0 && errno == EINTR)
                continue;
            if (n <= 0) {
                r->last_errno = n < 0 ? errno : EIO;
                rc = GPUNODE_MEMCAP_ERR_IO;
                break;
            }
            done += (size_t)n;
        }
    }
    close(fd);
    if (rc == GPUNODE_MEMCAP_OK)
        rc = gpunode_memcap_limit_check(&r->limit);
    return rc;
}

static int check_usage(const struct gpunode_memcap_usage *u, const struct gpunode_memcap_limit *limit)
{
    if (u->magic != GPUNODE_MEMCAP_USAGE_MAGIC)
        return GPUNODE_MEMCAP_ERR_MAGIC;
    if (u->version != GPUNODE_MEMCAP_LAYOUT_VERSION)
        return GPUNODE_MEMCAP_ERR_VERSION;
    if (u->size != sizeof(*u) || u->slot_count != GPUNODE_MEMCAP_MAX_PROCS)
        return GPUNODE_MEMCAP_ERR_SIZE;
    if (u->generation != limit->generation)
        return GPUNODE_MEMCAP_ERR_GENERATION;
    if (u->device_count != limit->device_count)
        return GPUNODE_MEMCAP_ERR_DEVICES;
    return GPUNODE_MEMCAP_OK;
}

static int open_usage_fd(struct gpunode_memcap_region *r, int writable, struct stat *st)
{
    char path[PATH_MAX];
    if (!join_path(path, r->dir, GPUNODE_MEMCAP_USAGE_FILE)) {
        r->last_errno = ENAMETOOLONG;
        return -1;
    }
    int fd = open(path, (writable ? O_RDWR : O_RDONLY) | O_NONBLOCK | O_CLOEXEC | O_NOCTTY);
    if (fd < 0) {
        r->last_errno = errno;
        return -1;
    }
    if (fstat(fd, st) != 0) {
        r->last_errno = errno;
        close(fd);
        return -1;
    }
    if (fd <= STDERR_FILENO) {
        /* The program started with a standard stream closed: keep that number free for it (a later
         * open of /dev/null must land there, and a write to it must not reach the usage file). */
        int high = fcntl(fd, F_DUPFD_CLOEXEC, STDERR_FILENO + 1);
        int saved = errno;
        close(fd);
        if (high < 0) {
            r->last_errno = saved;
            return -1;
        }
        fd = high;
    }
    return fd;
}

static int map_usage(struct gpunode_memcap_region *r, int writable)
{
    struct stat st;
    int fd = open_usage_fd(r, writable, &st);
    if (fd < 0)
        return GPUNODE_MEMCAP_ERR_IO;
    if (!S_ISREG(st.st_mode) || st.st_size != (off_t)sizeof(struct gpunode_memcap_usage)) {
        close(fd);
        return GPUNODE_MEMCAP_ERR_SIZE;
    }
    void *p = mmap(NULL, sizeof(struct gpunode_memcap_usage), PROT_READ | (writable ? PROT_WRITE : 0), MAP_SHARED,
                   fd, 0);
    if (p == MAP_FAILED) {
        r->last_errno = errno;
        close(fd);
        return GPUNODE_MEMCAP_ERR_IO;
    }
    int rc = check_usage(p, &r->limit);
    if (rc != GPUNODE_MEMCAP_OK) {
        munmap(p, sizeof(struct gpunode_memcap_usage));
        close(fd);
        return rc;
    }
    r->usage = p;
    r->usage_fd = fd;
    r->writable = writable;
    r->usage_dev = st.st_dev;
    r->usage_ino = st.st_ino;
    return GPUNODE_MEMCAP_OK;
}

int gpunode_memcap_region_open(struct gpunode_memcap_region *r, const char *dir, int writable)
{
    if (!r || !dir)
        return GPUNODE_MEMCAP_ERR_ARGUMENT;
    gpunode_memcap_region_close(r);
    r->last_errno = 0;
    if (strlen(dir) + sizeof(GPUNODE_MEMCAP_LIMIT_FILE) + 2 > sizeof(r->dir)) {
        r->last_errno = ENAMETOOLONG;
        return GPUNODE_MEMCAP_ERR_ARGUMENT;
    }
    strcpy(r->dir, dir);
    int rc = load_limit(r);
    if (rc != GPUNODE_MEMCAP_OK)
        return rc;
    r->limit_valid = 1;
    return map_usage(r, writable);
}

int gpunode_memcap_region_reopen_fd(struct gpunode_memcap_region *r)
{
    if (!r || !r->usage)
        return GPUNODE_MEMCAP_ERR_ARGUMENT;
    struct stat st;
    int fd = open_usage_fd(r, r->writable, &st);
    if (fd < 0)
        return GPUNODE_MEMCAP_ERR_IO;
    if (st.st_dev != r->usage_dev || st.st_ino != r->usage_ino) {
        close(fd);
        return GPUNODE_MEMCAP_ERR_GENERATION;
    }
    if (r->usage_fd >= 0)
        close(r->usage_fd);
    r->usage_fd = fd;
    return GPUNODE_MEMCAP_OK;
}

/* Open-file-description locks on one byte per slot: they belong to our open
 * file description, vanish when the owner dies or execs, and are not
 * inherited as ownership across fork once the child reopens the file. */
static int slot_lock(int fd, int slot, short type)
{
    struct flock fl;
    memset(&fl, 0, sizeof(fl));
    fl.l_type = type;
    fl.l_whence = SEEK_SET;
    fl.l_start = gpunode_memcap_slot_lock_offset(slot);
    fl.l_len = 1;
    return fcntl(fd, F_OFD_SETLK, &fl);
}

static int slot_probe(int fd, int slot)
{
    struct flock fl;
    memset(&fl, 0, sizeof(fl));
    fl.l_type = F_WRLCK;
    fl.l_whence = SEEK_SET;
    fl.l_start = gpunode_memcap_slot_lock_offset(slot);
    fl.l_len = 1;
    if (fcntl(fd, F_OFD_GETLK, &fl) != 0)
        return -1;
    return fl.l_type != F_UNLCK;
}

static int writable_region(const struct gpunode_memcap_region *r)
{
    return r && r->usage && r->usage_fd >= 0 && r->writable;
}

static int valid_slot(const struct gpunode_memcap_region *r, int slot, uint32_t device)
{
    return slot >= 0 && slot < GPUNODE_MEMCAP_MAX_PROCS && device < r->limit.device_count;
}

int gpunode_memcap_slot_claim(struct gpunode_memcap_region *r, int32_t pid, uint64_t start_ticks, int *slot_out)
{
    if (!writable_region(r) || !slot_out)
        return GPUNODE_MEMCAP_ERR_ARGUMENT;
    struct gpunode_memcap_usage *u = r->usage;
    uint64_t reclaimed_bytes;
    uint32_t reclaimed_slots;
    gpunode_memcap_reclaim_dead(r, -1, &reclaimed_bytes, &reclaimed_slots);
    for (int i = 0; i < GPUNODE_MEMCAP_MAX_PROCS; i++) {
        struct gpunode_memcap_slot *s = &u->slots[i];
        if (atomic_load_explicit(&s->token, memory_order_relaxed) != 0)
            continue;
        uint64_t token = atomic_fetch_add(&u->next_token, 1) + 1;
        uint64_t expected = 0;
        if (!atomic_compare_exchange_strong(&s->token, &expected, token))
            continue;
        if (slot_lock(r->usage_fd, i, F_WRLCK) != 0) {
            int e = errno;
            expected = token;
            atomic_compare_exchange_strong(&s->token, &expected, 0);
            if (e == EAGAIN || e == EACCES)
                continue; /* a reclaimer holds the byte this instant */
            r->last_errno = e;
            return GPUNODE_MEMCAP_ERR_IO;
        }
        if (atomic_load(&s->token) != token) {
            /* A reclaimer freed our half-made claim before we locked it. */
            slot_lock(r->usage_fd, i, F_UNLCK);
            continue;
        }
        atomic_store(&s->pid, pid);
        atomic_store(&s->start_ticks, start_ticks);
        atomic_store(&s->busy_ns, 0);
        atomic_store(&s->throttled_ns, 0);
        atomic_store(&s->launches, 0);
        atomic_fetch_add(&u->registrations, 1);
        *slot_out = i;
        return GPUNODE_MEMCAP_OK;
    }
    return GPUNODE_MEMCAP_ERR_NO_SLOT;
}

static uint64_t drain_slot(struct gpunode_memcap_usage *u, struct gpunode_memcap_slot *s)
{
    uint64_t total = 0;
    for (uint32_t d = 0; d < u->device_count && d < GPUNODE_MEMCAP_MAX_DEVICES; d++) {
        uint64_t bytes = atomic_exchange(&s->used_bytes[d], 0);
        if (bytes) {
            atomic_fetch_sub(&u->used_bytes[d], bytes);
            total += bytes;
        }
    }
    atomic_store(&s->pid, 0);
    atomic_store(&s->start_ticks, 0);
    return total;
}

int gpunode_memcap_slot_release(struct gpunode_memcap_region *r, int slot)
{
    if (!writable_region(r) || slot < 0 || slot >= GPUNODE_MEMCAP_MAX_PROCS)
        return GPUNODE_MEMCAP_ERR_ARGUMENT;
    struct gpunode_memcap_slot *s = &r->usage->slots[slot];
    drain_slot(r->usage, s);
    atomic_store(&s->token, 0);
    slot_lock(r->usage_fd, slot, F_UNLCK);
    return GPUNODE_MEMCAP_OK;
}

int gpunode_memcap_reserve(struct gpunode_memcap_region *r, int slot, uint32_t device, uint64_t bytes)
{
    if (!writable_region(r) || !valid_slot(r, slot, device))
        return GPUNODE_MEMCAP_ERR_ARGUMENT;
    if (!gpunode_memcap_try_add(&r->usage->used_bytes[device], bytes, r->limit.devices[device].limit_bytes))
        return GPUNODE_MEMCAP_ERR_OVER_LIMIT;
    atomic_fetch_add_explicit(&r->usage->slots[slot].used_bytes[device], bytes, memory_order_relaxed);
    return GPUNODE_MEMCAP_OK;
}

int gpunode_memcap_release(struct gpunode_memcap_region *r, int slot, uint32_t device, uint64_t bytes)
{
    if (!writable_region(r) || !valid_slot(r, slot, device))
        return GPUNODE_MEMCAP_ERR_ARGUMENT;
    _Atomic uint64_t *mine = &r->usage->slots[slot].used_bytes[device];
    uint64_t cur = atomic_load_explicit(mine, memory_order_relaxed);
    do {
        if (cur < bytes)
            return GPUNODE_MEMCAP_ERR_ARGUMENT;
    } while (!atomic_compare_exchange_weak_explicit(mine, &cur, cur - bytes, memory_order_relaxed,
                                                    memory_order_relaxed));
    atomic_fetch_sub_explicit(&r->usage->used_bytes[device], bytes, memory_order_relaxed);
    return GPUNODE_MEMCAP_OK;
}

int gpunode_memcap_reclaim_dead(struct gpunode_memcap_region *r, int self_slot, uint64_t *reclaimed_bytes,
                                uint32_t *reclaimed_slots)
{
    if (!writable_region(r) || !reclaimed_bytes || !reclaimed_slots)
        return GPUNODE_MEMCAP_ERR_ARGUMENT;
    struct gpunode_memcap_usage *u = r->usage;
    uint64_t bytes = 0;
    uint32_t slots = 0;
    int live = 0;
    int status = GPUNODE_MEMCAP_OK;
    uint64_t epoch = atomic_load(&u->registrations);
    for (int i = 0; i < GPUNODE_MEMCAP_MAX_PROCS; i++) {
        struct gpunode_memcap_slot *s = &u->slots[i];
        if (i == self_slot) {
            live++;
            continue;
        }
        if (atomic_load(&s->token) == 0)
            continue;
        if (slot_lock(r->usage_fd, i, F_WRLCK) != 0) {
            if (errno != EAGAIN && errno != EACCES) {
                r->last_errno = errno;
                status = GPUNODE_MEMCAP_ERR_IO;
            }
            live++;
            continue;
        }
        uint64_t token = atomic_load(&s->token);
        if (token != 0) {
            bytes += drain_slot(u, s);
            atomic_compare_exchange_strong(&s->token, &token, 0);
            slots++;
        }
        slot_lock(r->usage_fd, i, F_UNLCK);
    }
    if (self_slot < 0 && live == 0 && status == GPUNODE_MEMCAP_OK) {
        /* No process holds a slot: any usage left was reserved by a process
         * that died before it could record the bytes in its slot. A process
         * registering meanwhile bumps `registrations` before it allocates,
         * and the compare-and-swap fails if it allocated after we looked. */
        uint64_t seen[GPUNODE_MEMCAP_MAX_DEVICES];
        for (uint32_t d = 0; d < u->device_count && d < GPUNODE_MEMCAP_MAX_DEVICES; d++)
            seen[d] = atomic_load(&u->used_bytes[d]);
        if (atomic_load(&u->registrations) == epoch) {
            for (uint32_t d = 0; d < u->device_count && d < GPUNODE_MEMCAP_MAX_DEVICES; d++) {
                uint64_t expected = seen[d];
                if (expected && atomic_compare_exchange_strong(&u->used_bytes[d], &expected, 0))
                    bytes += seen[d];
            }
        }
    }
    *reclaimed_bytes = bytes;
    *reclaimed_slots = slots;
    return status;
}

int gpunode_memcap_report(const struct gpunode_memcap_region *r, struct gpunode_memcap_report *out)
{
    if (!r || !r->usage || !out)
        return GPUNODE_MEMCAP_ERR_ARGUMENT;
    const struct gpunode_memcap_usage *u = r->usage;
    memset(out, 0, sizeof(*out));
    out->device_count = u->device_count;
    out->registrations = atomic_load((_Atomic uint64_t *)&u->registrations);
    for (uint32_t d = 0; d < u->device_count && d < GPUNODE_MEMCAP_MAX_DEVICES; d++)
        out->used_bytes[d] = atomic_load((_Atomic uint64_t *)&u->used_bytes[d]);
    for (int i = 0; i < GPUNODE_MEMCAP_MAX_PROCS; i++) {
        struct gpunode_memcap_slot *s = (struct gpunode_memcap_slot *)&u->slots[i];
        uint64_t token = atomic_load(&s->token);
        if (token == 0)
            continue;
        struct gpunode_memcap_process_report *p = &out->processes[out->process_count++];
        p->token = token;
        p->pid = atomic_load(&s->pid);
        p->start_ticks = atomic_load(&s->start_ticks);
        for (uint32_t d = 0; d < u->device_count && d < GPUNODE_MEMCAP_MAX_DEVICES; d++)
            p->used_bytes[d] = atomic_load(&s->used_bytes[d]);
        p->busy_ns = atomic_load(&s->busy_ns);
        p->throttled_ns = atomic_load(&s->throttled_ns);
        p->launches = atomic_load(&s->launches);
        p->alive = r->usage_fd >= 0 ? slot_probe(r->usage_fd, i) : -1;
    }
    struct gpunode_compute *c = (struct gpunode_compute *)&u->compute;
    uint32_t share = 0, mode = 0, generation = 0;
    if (gpunode_compute_unpack(atomic_load(&c->control), &share, &mode, &generation)) {
        out->compute.share_milli = share;
        out->compute.mode = mode;
        out->compute.generation = generation;
    } else {
        out->compute.mode = UINT32_MAX; /* the control word is not one the agent wrote */
    }
    out->compute.budget_ns = atomic_load(&c->budget_ns);
    out->compute.busy_ns = atomic_load(&c->busy_ns);
    out->compute.throttled_ns = atomic_load(&c->throttled_ns);
    out->compute.launches = atomic_load(&c->launches);
    return GPUNODE_MEMCAP_OK;
}

int gpunode_compute_set(struct gpunode_memcap_region *r, uint32_t share_milli, uint32_t mode)
{
    if (!r || !r->usage || !r->writable || share_milli == 0 || share_milli > GPUNODE_COMPUTE_MILLI_PER_GPU ||
        mode > GPUNODE_COMPUTE_MODE_WORK_CONSERVING)
        return GPUNODE_MEMCAP_ERR_ARGUMENT;
    struct gpunode_compute *c = &r->usage->compute;
    uint32_t old_share, old_mode, generation = 0;
    if (!gpunode_compute_unpack(atomic_load(&c->control), &old_share, &old_mode, &generation))
        generation = 0;
    atomic_store(&c->control, gpunode_compute_pack(share_milli, mode, generation + 1));
    return GPUNODE_MEMCAP_OK;
}
