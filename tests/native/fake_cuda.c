/*
 * fake_cuda.c: a stand-in for libcuda.so.1 where no GPU exists, built by the
 * tests and the benchmark. It behaves like the driver where the interposer
 * can tell: cuInit and a current context are required, device memory is a
 * fixed size per device and allocations past it fail with
 * CUDA_ERROR_OUT_OF_MEMORY, legacy entry points take 32-bit values,
 * cuGetProcAddress maps base names to versioned and per-thread-stream
 * variants by cudaVersion and flags and returns the driver's own addresses.
 * Memory is host memory (never touched, so large sizes are cheap).
 *
 * The device timeline (kernels, streams, events) is fake_timeline.c.
 *
 * Environment:
 *   FAKE_CUDA_TOTAL_BYTES  memory per device (default 16 GiB)
 *   FAKE_CUDA_DEVICES      device count (default 1, at most 8)
 *   FAKE_CUDA_UUIDS        comma-separated "GPU-xxxxxxxx-xxxx-..." per device
 *   FAKE_CUDA_PITCH_ALIGN  pitch alignment of cuMemAllocPitch (default 512)
 *   FAKE_CUDA_STATE        a file shared by all processes using the fake, so
 *                          device usage is node-wide as on a real GPU
 *
 * Test helpers (not in the real driver): fake_cuda_calls(name),
 * fake_cuda_used(dev), fake_cuda_peak(dev), fake_cuda_uuid(dev).
 */
#define _GNU_SOURCE
#include <fcntl.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#define API __attribute__((visibility("default")))

typedef int CUresult;
typedef unsigned long long CUdeviceptr;
typedef unsigned int CUdeviceptr_v1;
typedef int CUdevice;
typedef struct CUctx_st *CUcontext;
typedef struct CUstream_st *CUstream;
typedef struct CUmemPoolHandle_st *CUmemoryPool;
typedef struct CUarray_st *CUarray;
typedef struct CUmipmappedArray_st *CUmipmappedArray;
typedef unsigned long long CUmemGenericAllocationHandle;
typedef struct {
    char bytes[16];
} CUuuid;
typedef struct {
    unsigned int Width, Height;
    int Format;
    unsigned int NumChannels;
} DESC_v1;
typedef struct {
    size_t Width, Height;
    int Format;
    unsigned int NumChannels;
} DESC_v2;
typedef struct {
    unsigned int Width, Height, Depth;
    int Format;
    unsigned int NumChannels, Flags;
} DESC3D_v1;
typedef struct {
    size_t Width, Height, Depth;
    int Format;
    unsigned int NumChannels, Flags;
} DESC3D_v2;
typedef struct {
    int type, requestedHandleTypes;
    struct {
        int type, id;
    } location;
    void *win32HandleMetaData;
    unsigned char allocFlags[8];
} PROP;

enum {
    OK = 0,
    E_INVALID_VALUE = 1,
    E_OOM = 2,
    E_NOT_INITIALIZED = 3,
    E_INVALID_DEVICE = 101,
    E_INVALID_CONTEXT = 201,
    E_INVALID_HANDLE = 400,
    E_NOT_FOUND = 500,
};

#include "fake_common.h"

static struct fake_state local_state;
static struct fake_state *state = &local_state;
static pthread_once_t setup_once = PTHREAD_ONCE_INIT;
static int initialized;
static int device_count = 1;
static uint64_t total_bytes = 16ULL << 30;
static uint64_t pitch_align = 512;
static unsigned char uuids[MAX_DEVICES][16];
static char uuid_strings[MAX_DEVICES][48];
static struct CUctx_st {
    int dev;
} contexts[MAX_DEVICES];
static struct CUmemPoolHandle_st {
    int dev;
} pools[MAX_DEVICES];
static __thread struct CUctx_st *current __attribute__((tls_model("initial-exec")));

static void setup(void)
{
    const char *v;
    total_bytes = read_total_bytes();
    device_count = read_device_count();
    if ((v = getenv("FAKE_CUDA_PITCH_ALIGN")) && strtoull(v, NULL, 0))
        pitch_align = strtoull(v, NULL, 0);
    read_uuids(uuids, uuid_strings);
    for (int d = 0; d < MAX_DEVICES; d++) {
        contexts[d].dev = d;
        pools[d].dev = d;
    }
    state = map_state(&local_state);
}

__attribute__((constructor)) static void setup_at_load(void)
{
    pthread_once(&setup_once, setup);
}

static inline void count(enum fake_fn fn)
{
    atomic_fetch_add_explicit(&state->calls[fn], 1, memory_order_relaxed);
}

static int current_device(int *dev)
{
    if (!initialized)
        return E_NOT_INITIALIZED;
    if (!current)
        return E_INVALID_CONTEXT;
    *dev = current->dev;
    return OK;
}

/* Take bytes from the device, as the driver's allocator would. */
static int take_device_memory(int dev, uint64_t bytes)
{
    _Atomic uint64_t *used = &state->used[dev];
    uint64_t cur = atomic_load_explicit(used, memory_order_relaxed), next;
    do {
        if (bytes > total_bytes || cur > total_bytes - bytes)
            return 0;
        next = cur + bytes;
    } while (!atomic_compare_exchange_weak_explicit(used, &cur, next, memory_order_relaxed, memory_order_relaxed));
    uint64_t peak = atomic_load_explicit(&state->peak[dev], memory_order_relaxed);
    while (next > peak &&
           !atomic_compare_exchange_weak_explicit(&state->peak[dev], &peak, next, memory_order_relaxed,
                                                  memory_order_relaxed)) {
    }
    return 1;
}

static void give_device_memory(int dev, uint64_t bytes)
{
    atomic_fetch_sub_explicit(&state->used[dev], bytes, memory_order_relaxed);
}

/* Every object the fake hands out has this header just below the address it
 * returns. Addresses are 256-byte aligned, as the driver's are. */
struct block {
    void *base; /* what malloc or mmap returned */
    uint64_t bytes;
    uint64_t magic;
    int dev;
    int mapped; /* 1: mmap'd (large or 32-bit), 0: malloc'd */
    size_t length;
};
#define BLOCK_MAGIC 0xfacecafe0b10c000ULL
#define SMALL_LIMIT (1u << 20)
#define ALIGN 256

static void *new_block(uint64_t bytes, int dev, int low32)
{
    if (!take_device_memory(dev, bytes))
        return NULL;
    int mapped = low32 || bytes > SMALL_LIMIT;
    size_t length = (size_t)bytes + ALIGN + sizeof(struct block);
    void *base;
    if (mapped) {
        base = mmap(NULL, length, PROT_READ | PROT_WRITE,
                    MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | (low32 ? MAP_32BIT : 0), -1, 0);
        if (base == MAP_FAILED)
            base = NULL;
    } else {
        base = malloc(length);
    }
    if (!base) {
        give_device_memory(dev, bytes);
        return NULL;
    }
    uintptr_t p = ((uintptr_t)base + sizeof(struct block) + ALIGN - 1) & ~(uintptr_t)(ALIGN - 1);
    struct block *b = (struct block *)p - 1;
    b->base = base;
    b->bytes = bytes;
    b->magic = BLOCK_MAGIC;
    b->dev = dev;
    b->mapped = mapped;
    b->length = length;
    return (void *)p;
}

static int free_block(void *p)
{
    if (!p || ((uintptr_t)p & (ALIGN - 1)))
        return E_INVALID_VALUE;
    struct block *b = (struct block *)p - 1;
    if (b->magic != BLOCK_MAGIC)
        return E_INVALID_VALUE;
    b->magic = 0;
    give_device_memory(b->dev, b->bytes);
    if (b->mapped)
        munmap(b->base, b->length);
    else
        free(b->base);
    return OK;
}

static CUresult alloc_linear(CUdeviceptr *dptr, uint64_t bytes, int dev_or_current)
{
    int dev = dev_or_current, rc;
    if (dev < 0 && (rc = current_device(&dev)) != OK)
        return rc;
    if (!dptr || bytes == 0)
        return E_INVALID_VALUE;
    void *p = new_block(bytes, dev, 0);
    if (!p)
        return E_OOM;
    *dptr = (CUdeviceptr)(uintptr_t)p;
    return OK;
}

API CUresult cuInit(unsigned int flags)
{
    pthread_once(&setup_once, setup);
    if (flags != 0)
        return E_INVALID_VALUE;
    initialized = 1;
    return OK;
}

API CUresult cuDriverGetVersion(int *version)
{
    *version = 12040;
    return OK;
}

API CUresult cuDeviceGetCount(int *n)
{
    if (!initialized)
        return E_NOT_INITIALIZED;
    *n = device_count;
    return OK;
}

API CUresult cuDeviceGet(CUdevice *dev, int ordinal)
{
    if (!initialized)
        return E_NOT_INITIALIZED;
    if (ordinal < 0 || ordinal >= device_count)
        return E_INVALID_DEVICE;
    *dev = ordinal;
    return OK;
}

API CUresult cuDeviceGetName(char *name, int len, CUdevice dev)
{
    if (dev < 0 || dev >= device_count)
        return E_INVALID_DEVICE;
    snprintf(name, (size_t)len, "gpunode fake GPU %d", dev);
    return OK;
}

static CUresult get_uuid(CUuuid *uuid, CUdevice dev)
{
    if (!initialized)
        return E_NOT_INITIALIZED;
    if (dev < 0 || dev >= device_count)
        return E_INVALID_DEVICE;
    memcpy(uuid->bytes, uuids[dev], 16);
    return OK;
}

API CUresult cuDeviceGetUuid(CUuuid *uuid, CUdevice dev)
{
    count(FN_cuDeviceGetUuid);
    return get_uuid(uuid, dev);
}

API CUresult cuDeviceGetUuid_v2(CUuuid *uuid, CUdevice dev)
{
    count(FN_cuDeviceGetUuid_v2);
    return get_uuid(uuid, dev);
}

API CUresult cuDeviceTotalMem_v2(size_t *bytes, CUdevice dev)
{
    count(FN_cuDeviceTotalMem_v2);
    if (!initialized)
        return E_NOT_INITIALIZED;
    if (dev < 0 || dev >= device_count)
        return E_INVALID_DEVICE;
    *bytes = total_bytes;
    return OK;
}

API CUresult cuDeviceTotalMem(unsigned int *bytes, CUdevice dev)
{
    count(FN_cuDeviceTotalMem);
    if (!initialized)
        return E_NOT_INITIALIZED;
    if (dev < 0 || dev >= device_count)
        return E_INVALID_DEVICE;
    *bytes = total_bytes > 0xffffffffULL ? 0xffffffffU : (unsigned int)total_bytes;
    return OK;
}

API CUresult cuDevicePrimaryCtxRetain(CUcontext *ctx, CUdevice dev)
{
    if (!initialized)
        return E_NOT_INITIALIZED;
    if (dev < 0 || dev >= device_count)
        return E_INVALID_DEVICE;
    *ctx = &contexts[dev];
    return OK;
}

API CUresult cuDevicePrimaryCtxRelease(CUdevice dev)
{
    return dev < 0 || dev >= device_count ? E_INVALID_DEVICE : OK;
}

API CUresult cuDevicePrimaryCtxRelease_v2(CUdevice dev)
{
    return cuDevicePrimaryCtxRelease(dev);
}

API CUresult cuCtxSetCurrent(CUcontext ctx)
{
    if (!initialized)
        return E_NOT_INITIALIZED;
    if (ctx && (ctx < &contexts[0] || ctx >= &contexts[device_count]))
        return E_INVALID_CONTEXT;
    current = ctx;
    return OK;
}

API CUresult cuCtxGetCurrent(CUcontext *ctx)
{
    if (!initialized)
        return E_NOT_INITIALIZED;
    *ctx = current;
    return OK;
}

API CUresult cuCtxGetDevice(CUdevice *dev)
{
    count(FN_cuCtxGetDevice);
    int d, rc = current_device(&d);
    if (rc == OK)
        *dev = d;
    return rc;
}

static CUresult mem_info(uint64_t *free_bytes, uint64_t *total)
{
    int dev, rc = current_device(&dev);
    if (rc != OK)
        return rc;
    uint64_t used = atomic_load(&state->used[dev]);
    *total = total_bytes;
    *free_bytes = used >= total_bytes ? 0 : total_bytes - used;
    return OK;
}

API CUresult cuMemGetInfo_v2(size_t *free_bytes, size_t *total)
{
    count(FN_cuMemGetInfo_v2);
    uint64_t f, t;
    CUresult rc = mem_info(&f, &t);
    if (rc == OK) {
        *free_bytes = f;
        *total = t;
    }
    return rc;
}

API CUresult cuMemGetInfo(unsigned int *free_bytes, unsigned int *total)
{
    count(FN_cuMemGetInfo);
    uint64_t f, t;
    CUresult rc = mem_info(&f, &t);
    if (rc == OK) {
        *free_bytes = f > 0xffffffffULL ? 0xffffffffU : (unsigned int)f;
        *total = t > 0xffffffffULL ? 0xffffffffU : (unsigned int)t;
    }
    return rc;
}

API CUresult cuMemAlloc_v2(CUdeviceptr *dptr, size_t bytes)
{
    count(FN_cuMemAlloc_v2);
    return alloc_linear(dptr, bytes, -1);
}

API CUresult cuMemAlloc(CUdeviceptr_v1 *dptr, unsigned int bytes)
{
    count(FN_cuMemAlloc);
    int dev, rc = current_device(&dev);
    if (rc != OK)
        return rc;
    if (!dptr || bytes == 0)
        return E_INVALID_VALUE;
    void *p = new_block(bytes, dev, 1);
    if (!p)
        return E_OOM;
    if ((uintptr_t)p > 0xffffffffu) {
        free_block(p);
        return E_OOM;
    }
    *dptr = (CUdeviceptr_v1)(uintptr_t)p;
    return OK;
}

API CUresult cuMemFree_v2(CUdeviceptr dptr)
{
    count(FN_cuMemFree_v2);
    if (!initialized)
        return E_NOT_INITIALIZED;
    return free_block((void *)(uintptr_t)dptr);
}

API CUresult cuMemFree(CUdeviceptr_v1 dptr)
{
    count(FN_cuMemFree);
    if (!initialized)
        return E_NOT_INITIALIZED;
    return free_block((void *)(uintptr_t)dptr);
}

static uint64_t pitch_of(uint64_t width)
{
    return (width + pitch_align - 1) / pitch_align * pitch_align;
}

API CUresult cuMemAllocPitch_v2(CUdeviceptr *dptr, size_t *pitch, size_t width, size_t height, unsigned int elem)
{
    count(FN_cuMemAllocPitch_v2);
    if (elem != 4 && elem != 8 && elem != 16)
        return E_INVALID_VALUE;
    uint64_t p = pitch_of(width);
    CUresult rc = alloc_linear(dptr, p * height, -1);
    if (rc == OK)
        *pitch = p;
    return rc;
}

API CUresult cuMemAllocPitch(CUdeviceptr_v1 *dptr, unsigned int *pitch, unsigned int width, unsigned int height,
                             unsigned int elem)
{
    count(FN_cuMemAllocPitch);
    if (elem != 4 && elem != 8 && elem != 16)
        return E_INVALID_VALUE;
    int dev, rc = current_device(&dev);
    if (rc != OK)
        return rc;
    uint64_t p = pitch_of(width);
    void *mem = new_block(p * height, dev, 1);
    if (!mem)
        return E_OOM;
    *dptr = (CUdeviceptr_v1)(uintptr_t)mem;
    *pitch = (unsigned int)p;
    return OK;
}

API CUresult cuMemAllocManaged(CUdeviceptr *dptr, size_t bytes, unsigned int flags)
{
    count(FN_cuMemAllocManaged);
    if (flags != 1 && flags != 2)
        return E_INVALID_VALUE;
    return alloc_linear(dptr, bytes, -1);
}

API CUresult cuMemAllocAsync(CUdeviceptr *dptr, size_t bytes, CUstream stream)
{
    count(FN_cuMemAllocAsync);
    (void)stream;
    return alloc_linear(dptr, bytes, -1);
}

API CUresult cuMemAllocAsync_ptsz(CUdeviceptr *dptr, size_t bytes, CUstream stream)
{
    count(FN_cuMemAllocAsync_ptsz);
    (void)stream;
    return alloc_linear(dptr, bytes, -1);
}

API CUresult cuDeviceGetDefaultMemPool(CUmemoryPool *pool, CUdevice dev)
{
    if (!initialized)
        return E_NOT_INITIALIZED;
    if (dev < 0 || dev >= device_count)
        return E_INVALID_DEVICE;
    *pool = &pools[dev];
    return OK;
}

static int pool_device(CUmemoryPool pool)
{
    if (pool < &pools[0] || pool >= &pools[device_count])
        return -2;
    return pool->dev;
}

API CUresult cuMemAllocFromPoolAsync(CUdeviceptr *dptr, size_t bytes, CUmemoryPool pool, CUstream stream)
{
    count(FN_cuMemAllocFromPoolAsync);
    (void)stream;
    int dev = pool_device(pool);
    return dev < 0 ? E_INVALID_VALUE : alloc_linear(dptr, bytes, dev);
}

API CUresult cuMemAllocFromPoolAsync_ptsz(CUdeviceptr *dptr, size_t bytes, CUmemoryPool pool, CUstream stream)
{
    count(FN_cuMemAllocFromPoolAsync_ptsz);
    (void)stream;
    int dev = pool_device(pool);
    return dev < 0 ? E_INVALID_VALUE : alloc_linear(dptr, bytes, dev);
}

API CUresult cuMemFreeAsync(CUdeviceptr dptr, CUstream stream)
{
    count(FN_cuMemFreeAsync);
    (void)stream;
    return free_block((void *)(uintptr_t)dptr);
}

API CUresult cuMemFreeAsync_ptsz(CUdeviceptr dptr, CUstream stream)
{
    count(FN_cuMemFreeAsync_ptsz);
    (void)stream;
    return free_block((void *)(uintptr_t)dptr);
}

/* VMM handles are small integers, not pointers, as with the real driver;
 * the block pointer is kept in a table indexed by handle. */
#define MAX_HANDLES 4096
static void *_Atomic handles[MAX_HANDLES];

API CUresult cuMemCreate(CUmemGenericAllocationHandle *handle, size_t size, const PROP *prop,
                         unsigned long long flags)
{
    count(FN_cuMemCreate);
    if (!initialized)
        return E_NOT_INITIALIZED;
    if (!handle || !prop || flags != 0 || size == 0 || prop->location.type != 1)
        return E_INVALID_VALUE;
    if (prop->location.id < 0 || prop->location.id >= device_count)
        return E_INVALID_DEVICE;
    void *p = new_block(size, prop->location.id, 0);
    if (!p)
        return E_OOM;
    for (int tries = 0; tries < MAX_HANDLES; tries++) {
        uint64_t h = atomic_fetch_add(&state->next_handle, 1) % (MAX_HANDLES - 1) + 1;
        void *expected = NULL;
        if (atomic_compare_exchange_strong(&handles[h], &expected, p)) {
            *handle = h;
            return OK;
        }
    }
    free_block(p);
    return E_OOM;
}

API CUresult cuMemRelease(CUmemGenericAllocationHandle handle)
{
    count(FN_cuMemRelease);
    if (handle == 0 || handle >= MAX_HANDLES)
        return E_INVALID_HANDLE;
    void *p = atomic_exchange(&handles[handle], NULL);
    return p ? free_block(p) : E_INVALID_HANDLE;
}

static uint64_t texel_bytes(int format)
{
    switch (format) {
    case 0x01:
    case 0x08:
        return 1;
    case 0x02:
    case 0x09:
    case 0x10:
        return 2;
    case 0x03:
    case 0x0a:
    case 0x20:
        return 4;
    default:
        return 16;
    }
}

static uint64_t array_bytes(uint64_t w, uint64_t h, uint64_t d, int format, unsigned channels, unsigned levels,
                            int layered)
{
    uint64_t total = 0;
    w = w ? w : 1, h = h ? h : 1, d = d ? d : 1;
    for (unsigned l = 0; l < (levels ? levels : 1); l++) {
        total += w * h * d * (channels ? channels : 1) * texel_bytes(format);
        w = w > 1 ? w / 2 : 1;
        h = h > 1 ? h / 2 : 1;
        if (!layered)
            d = d > 1 ? d / 2 : 1;
    }
    return total;
}

static CUresult new_array(void **out, uint64_t bytes)
{
    int dev, rc = current_device(&dev);
    if (rc != OK)
        return rc;
    if (!out)
        return E_INVALID_VALUE;
    void *p = new_block(bytes, dev, 0);
    if (!p)
        return E_OOM;
    *out = p;
    return OK;
}

API CUresult cuArrayCreate(CUarray *array, const DESC_v1 *d)
{
    count(FN_cuArrayCreate);
    return new_array((void **)array, array_bytes(d->Width, d->Height, 1, d->Format, d->NumChannels, 1, 0));
}

API CUresult cuArrayCreate_v2(CUarray *array, const DESC_v2 *d)
{
    count(FN_cuArrayCreate_v2);
    return new_array((void **)array, array_bytes(d->Width, d->Height, 1, d->Format, d->NumChannels, 1, 0));
}

API CUresult cuArray3DCreate(CUarray *array, const DESC3D_v1 *d)
{
    count(FN_cuArray3DCreate);
    return new_array((void **)array,
                     array_bytes(d->Width, d->Height, d->Depth, d->Format, d->NumChannels, 1, (d->Flags & 5) != 0));
}

API CUresult cuArray3DCreate_v2(CUarray *array, const DESC3D_v2 *d)
{
    count(FN_cuArray3DCreate_v2);
    return new_array((void **)array,
                     array_bytes(d->Width, d->Height, d->Depth, d->Format, d->NumChannels, 1, (d->Flags & 5) != 0));
}

API CUresult cuArrayDestroy(CUarray array)
{
    count(FN_cuArrayDestroy);
    return free_block(array);
}

API CUresult cuMipmappedArrayCreate(CUmipmappedArray *array, const DESC3D_v2 *d, unsigned int levels)
{
    count(FN_cuMipmappedArrayCreate);
    return new_array((void **)array, array_bytes(d->Width, d->Height, d->Depth, d->Format, d->NumChannels, levels,
                                                 (d->Flags & 5) != 0));
}

API CUresult cuMipmappedArrayDestroy(CUmipmappedArray array)
{
    count(FN_cuMipmappedArrayDestroy);
    return free_block(array);
}

API CUresult cuGetErrorString(CUresult error, const char **text)
{
    switch (error) {
    case OK:
        *text = "no error";
        return OK;
    case E_OOM:
        *text = "out of memory";
        return OK;
    default:
        *text = "fake error";
        return OK;
    }
}

/* The device timeline's entry points (fake_timeline.c). */
#define TIMELINE_FUNCS(X)                                                                                          \
    X(cuLaunchKernel) X(cuLaunchKernel_ptsz) X(cuLaunchKernelEx) X(cuLaunchKernelEx_ptsz)                           \
    X(cuLaunchCooperativeKernel) X(cuLaunchCooperativeKernel_ptsz) X(cuGraphLaunch) X(cuGraphLaunch_ptsz)           \
    X(cuCtxSynchronize) X(cuStreamSynchronize) X(cuStreamSynchronize_ptsz) X(cuEventCreate) X(cuEventDestroy_v2)    \
    X(cuEventRecord) X(cuEventRecord_ptsz) X(cuEventQuery) X(cuEventSynchronize) X(cuEventElapsedTime)            \
    X(cuStreamIsCapturing) X(cuStreamIsCapturing_ptsz)
#define X(name) void name(void);
TIMELINE_FUNCS(X)
#undef X

/* cuGetProcAddress: base name -> variant, like the driver's own table. */
enum { ANY, LEGACY, PTSZ };
static const struct proc {
    const char *base;
    int since;
    int stream;
    void *fn;
} procs[] = {
    {"cuInit", 2000, ANY, (void *)cuInit},
    {"cuDriverGetVersion", 2020, ANY, (void *)cuDriverGetVersion},
    {"cuDeviceGet", 2000, ANY, (void *)cuDeviceGet},
    {"cuDeviceGetCount", 2000, ANY, (void *)cuDeviceGetCount},
    {"cuDeviceGetName", 2000, ANY, (void *)cuDeviceGetName},
    {"cuDeviceGetUuid", 9020, ANY, (void *)cuDeviceGetUuid},
    {"cuDeviceGetUuid", 11040, ANY, (void *)cuDeviceGetUuid_v2},
    {"cuDeviceTotalMem", 2000, ANY, (void *)cuDeviceTotalMem},
    {"cuDeviceTotalMem", 3020, ANY, (void *)cuDeviceTotalMem_v2},
    {"cuDevicePrimaryCtxRetain", 7000, ANY, (void *)cuDevicePrimaryCtxRetain},
    {"cuDevicePrimaryCtxRelease", 7000, ANY, (void *)cuDevicePrimaryCtxRelease},
    {"cuDevicePrimaryCtxRelease", 11000, ANY, (void *)cuDevicePrimaryCtxRelease_v2},
    {"cuDeviceGetDefaultMemPool", 11020, ANY, (void *)cuDeviceGetDefaultMemPool},
    {"cuCtxSetCurrent", 4000, ANY, (void *)cuCtxSetCurrent},
    {"cuCtxGetCurrent", 4000, ANY, (void *)cuCtxGetCurrent},
    {"cuCtxGetDevice", 2000, ANY, (void *)cuCtxGetDevice},
    {"cuMemGetInfo", 2000, ANY, (void *)cuMemGetInfo},
    {"cuMemGetInfo", 3020, ANY, (void *)cuMemGetInfo_v2},
    {"cuMemAlloc", 2000, ANY, (void *)cuMemAlloc},
    {"cuMemAlloc", 3020, ANY, (void *)cuMemAlloc_v2},
    {"cuMemAllocPitch", 2000, ANY, (void *)cuMemAllocPitch},
    {"cuMemAllocPitch", 3020, ANY, (void *)cuMemAllocPitch_v2},
    {"cuMemFree", 2000, ANY, (void *)cuMemFree},
    {"cuMemFree", 3020, ANY, (void *)cuMemFree_v2},
    {"cuMemAllocManaged", 6000, ANY, (void *)cuMemAllocManaged},
    {"cuMemAllocAsync", 11020, LEGACY, (void *)cuMemAllocAsync},
    {"cuMemAllocAsync", 11020, PTSZ, (void *)cuMemAllocAsync_ptsz},
    {"cuMemAllocFromPoolAsync", 11020, LEGACY, (void *)cuMemAllocFromPoolAsync},
    {"cuMemAllocFromPoolAsync", 11020, PTSZ, (void *)cuMemAllocFromPoolAsync_ptsz},
    {"cuMemFreeAsync", 11020, LEGACY, (void *)cuMemFreeAsync},
    {"cuMemFreeAsync", 11020, PTSZ, (void *)cuMemFreeAsync_ptsz},
    {"cuMemCreate", 10020, ANY, (void *)cuMemCreate},
    {"cuMemRelease", 10020, ANY, (void *)cuMemRelease},
    {"cuArrayCreate", 2000, ANY, (void *)cuArrayCreate},
    {"cuArrayCreate", 3020, ANY, (void *)cuArrayCreate_v2},
    {"cuArray3DCreate", 2000, ANY, (void *)cuArray3DCreate},
    {"cuArray3DCreate", 3020, ANY, (void *)cuArray3DCreate_v2},
    {"cuArrayDestroy", 2000, ANY, (void *)cuArrayDestroy},
    {"cuMipmappedArrayCreate", 5000, ANY, (void *)cuMipmappedArrayCreate},
    {"cuMipmappedArrayDestroy", 5000, ANY, (void *)cuMipmappedArrayDestroy},
    {"cuGetErrorString", 6000, ANY, (void *)cuGetErrorString},
    {"cuLaunchKernel", 4000, LEGACY, (void *)cuLaunchKernel},
    {"cuLaunchKernel", 7000, PTSZ, (void *)cuLaunchKernel_ptsz},
    {"cuLaunchKernelEx", 11060, LEGACY, (void *)cuLaunchKernelEx},
    {"cuLaunchKernelEx", 11060, PTSZ, (void *)cuLaunchKernelEx_ptsz},
    {"cuLaunchCooperativeKernel", 9000, LEGACY, (void *)cuLaunchCooperativeKernel},
    {"cuLaunchCooperativeKernel", 9000, PTSZ, (void *)cuLaunchCooperativeKernel_ptsz},
    {"cuGraphLaunch", 10000, LEGACY, (void *)cuGraphLaunch},
    {"cuGraphLaunch", 10000, PTSZ, (void *)cuGraphLaunch_ptsz},
    {"cuCtxSynchronize", 2000, ANY, (void *)cuCtxSynchronize},
    {"cuStreamSynchronize", 2000, LEGACY, (void *)cuStreamSynchronize},
    {"cuStreamSynchronize", 7000, PTSZ, (void *)cuStreamSynchronize_ptsz},
    {"cuEventCreate", 2000, ANY, (void *)cuEventCreate},
    {"cuEventDestroy", 4000, ANY, (void *)cuEventDestroy_v2},
    {"cuEventRecord", 2000, LEGACY, (void *)cuEventRecord},
    {"cuEventRecord", 7000, PTSZ, (void *)cuEventRecord_ptsz},
    {"cuEventQuery", 2000, ANY, (void *)cuEventQuery},
    {"cuEventSynchronize", 2000, ANY, (void *)cuEventSynchronize},
    {"cuEventElapsedTime", 2000, ANY, (void *)cuEventElapsedTime},
    {"cuStreamIsCapturing", 10000, LEGACY, (void *)cuStreamIsCapturing},
    {"cuStreamIsCapturing", 10000, PTSZ, (void *)cuStreamIsCapturing_ptsz},
    {"cuGetProcAddress", 11030, ANY, NULL}, /* both resolved in lookup_proc */
    {"cuGetProcAddress", 12000, ANY, NULL},
};

CUresult cuGetProcAddress_v2(const char *symbol, void **pfn, int version, unsigned long long flags, int *status);
CUresult cuGetProcAddress(const char *symbol, void **pfn, int version, unsigned long long flags);

static CUresult lookup_proc(const char *symbol, void **pfn, int version, unsigned long long flags, int *status)
{
    if (!symbol || !pfn)
        return E_INVALID_VALUE;
    int ptsz = (flags & 2) != 0, found_name = 0;
    const struct proc *best = NULL;
    for (size_t i = 0; i < sizeof(procs) / sizeof(procs[0]); i++) {
        const struct proc *p = &procs[i];
        if (strcmp(p->base, symbol) != 0)
            continue;
        found_name = 1;
        if (p->since > version || (p->stream == PTSZ && !ptsz) || (p->stream == LEGACY && ptsz))
            continue;
        if (!best || p->since > best->since)
            best = p;
    }
    *pfn = NULL;
    if (!best) {
        if (status)
            *status = found_name ? 2 : 1; /* VERSION_NOT_SUFFICIENT : SYMBOL_NOT_FOUND */
        return E_NOT_FOUND;
    }
    if (status)
        *status = 0;
    if (strcmp(best->base, "cuGetProcAddress") == 0)
        *pfn = best->since >= 12000 ? (void *)cuGetProcAddress_v2 : (void *)cuGetProcAddress;
    else
        *pfn = best->fn;
    return OK;
}

API CUresult cuGetProcAddress_v2(const char *symbol, void **pfn, int version, unsigned long long flags, int *status)
{
    count(FN_cuGetProcAddress_v2);
    return lookup_proc(symbol, pfn, version, flags, status);
}

API CUresult cuGetProcAddress(const char *symbol, void **pfn, int version, unsigned long long flags)
{
    count(FN_cuGetProcAddress);
    return lookup_proc(symbol, pfn, version, flags, NULL);
}

/* ---- test helpers ---- */

API unsigned long long fake_cuda_calls(const char *name)
{
    pthread_once(&setup_once, setup);
    for (int i = 0; i < FN_COUNT; i++)
        if (strcmp(fn_names[i], name) == 0)
            return atomic_load(&state->calls[i]);
    return ~0ULL;
}

API unsigned long long fake_cuda_used(int dev)
{
    pthread_once(&setup_once, setup);
    return dev >= 0 && dev < MAX_DEVICES ? atomic_load(&state->used[dev]) : 0;
}

API unsigned long long fake_cuda_peak(int dev)
{
    pthread_once(&setup_once, setup);
    return dev >= 0 && dev < MAX_DEVICES ? atomic_load(&state->peak[dev]) : 0;
}

API const char *fake_cuda_uuid(int dev)
{
    pthread_once(&setup_once, setup);
    return dev >= 0 && dev < MAX_DEVICES ? uuid_strings[dev] : "";
}
