/*
 * fake_common.h: what the fake libcuda and the fake NVML share: the
 * environment they read, the device UUIDs, and the state file that makes
 * device memory node-wide across the processes that use the fakes.
 *
 * Test infrastructure only; never part of gpunode.
 */
#ifndef GPUNODE_FAKE_COMMON_H
#define GPUNODE_FAKE_COMMON_H

#include <fcntl.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#define MAX_DEVICES 8
#define FAKE_FUNCS(X)                                                                                              \
    X(cuMemAlloc) X(cuMemAlloc_v2) X(cuMemAllocPitch) X(cuMemAllocPitch_v2) X(cuMemAllocManaged)                   \
    X(cuMemAllocAsync) X(cuMemAllocAsync_ptsz) X(cuMemAllocFromPoolAsync) X(cuMemAllocFromPoolAsync_ptsz)          \
    X(cuMemFree) X(cuMemFree_v2) X(cuMemFreeAsync) X(cuMemFreeAsync_ptsz) X(cuMemCreate) X(cuMemRelease)           \
    X(cuArrayCreate) X(cuArrayCreate_v2) X(cuArray3DCreate) X(cuArray3DCreate_v2) X(cuArrayDestroy)                \
    X(cuMipmappedArrayCreate) X(cuMipmappedArrayDestroy) X(cuMemGetInfo) X(cuMemGetInfo_v2)                        \
    X(cuDeviceTotalMem) X(cuDeviceTotalMem_v2) X(cuGetProcAddress) X(cuGetProcAddress_v2) X(cuCtxGetDevice)        \
    X(cuDeviceGetUuid) X(cuDeviceGetUuid_v2)

enum fake_fn {
#define X(name) FN_##name,
    FAKE_FUNCS(X)
#undef X
        FN_COUNT
};

static const char *const fn_names[] = {
#define X(name) #name,
    FAKE_FUNCS(X)
#undef X
};

struct fake_state {
    _Atomic uint64_t used[MAX_DEVICES];
    _Atomic uint64_t peak[MAX_DEVICES];
    _Atomic uint64_t calls[FN_COUNT];
    _Atomic uint64_t next_handle;
};

static int parse_uuid(const char *s, unsigned char out[16])
{
    if (strncmp(s, "GPU-", 4) == 0 || strncmp(s, "MIG-", 4) == 0)
        s += 4;
    int n = 0;
    for (; *s && *s != ',' && n < 32; s++) {
        if (*s == '-')
            continue;
        int c = *s | 32;
        int v = (*s >= '0' && *s <= '9') ? *s - '0' : (c >= 'a' && c <= 'f') ? c - 'a' + 10 : -1;
        if (v < 0)
            return 0;
        out[n / 2] = (unsigned char)(n % 2 ? out[n / 2] | v : v << 4);
        n++;
    }
    return n == 32;
}

/* Fill uuids[d] and uuid_strings[d] from FAKE_CUDA_UUIDS or the defaults
 * (fa ce 00 .. 00 d). */
static void read_uuids(unsigned char uuids[MAX_DEVICES][16], char uuid_strings[MAX_DEVICES][48])
{
    const char *list = getenv("FAKE_CUDA_UUIDS");
    for (int d = 0; d < MAX_DEVICES; d++) {
        memset(uuids[d], 0, 16);
        uuids[d][0] = 0xfa;
        uuids[d][1] = 0xce;
        uuids[d][15] = (unsigned char)d;
        if (list && *list) {
            if (!parse_uuid(list, uuids[d]))
                fprintf(stderr, "fake: bad FAKE_CUDA_UUIDS entry near '%s'\n", list);
            list = strchr(list, ',');
            list = list ? list + 1 : NULL;
        }
        const unsigned char *b = uuids[d];
        snprintf(uuid_strings[d], 48, "GPU-%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x", b[0],
                 b[1], b[2], b[3], b[4], b[5], b[6], b[7], b[8], b[9], b[10], b[11], b[12], b[13], b[14], b[15]);
    }
}

static uint64_t read_total_bytes(void)
{
    const char *v = getenv("FAKE_CUDA_TOTAL_BYTES");
    return v ? strtoull(v, NULL, 0) : 16ULL << 30;
}

static int read_device_count(void)
{
    const char *v = getenv("FAKE_CUDA_DEVICES");
    int n = v ? atoi(v) : 1;
    return n < 1 ? 1 : n > MAX_DEVICES ? MAX_DEVICES : n;
}

/* The shared state named by FAKE_CUDA_STATE, or `fallback`. */
static struct fake_state *map_state(struct fake_state *fallback)
{
    const char *path = getenv("FAKE_CUDA_STATE");
    if (!path || !*path)
        return fallback;
    struct fake_state *s = fallback;
    int fd = open(path, O_RDWR | O_CREAT | O_CLOEXEC, 0666);
    if (fd >= 0 && ftruncate(fd, sizeof(struct fake_state)) == 0) {
        void *p = mmap(NULL, sizeof(struct fake_state), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
        if (p != MAP_FAILED)
            s = p;
    }
    if (fd >= 0)
        close(fd);
    if (s == fallback)
        fprintf(stderr, "fake: cannot map FAKE_CUDA_STATE=%s; using process-local state\n", path);
    return s;
}

#endif /* GPUNODE_FAKE_COMMON_H */
