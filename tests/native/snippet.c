/*
 * snippet.c: a CUDA driver client for the interposer tests. It reaches the
 * driver the way real programs do, chosen by argv[1]:
 *
 *   direct         functions linked from libcuda.so.1 (built with -DLINKED)
 *   dlopen         dlopen("libcuda.so.1") + dlsym, as the CUDA runtime does
 *   procaddr       everything through cuGetProcAddress_v2 (CUDA 12 style)
 *   procaddr-ptds  the same, asking for per-thread default stream variants
 *   procaddr-v1    through the CUDA 11.3 cuGetProcAddress (no status)
 *
 * and runs the scenario in argv[2] (see usage()). It prints "ok ..." and
 * exits 0, or prints "FAIL ..." and exits 1. The fake driver's call counters
 * (fake_cuda_calls) show whether a refused call reached the driver.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <pthread.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

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
    unsigned int Width, Height;
    int Format;
    unsigned int NumChannels;
} DESC_v1;
typedef struct {
    size_t Width, Height;
    int Format;
    unsigned int NumChannels;
} DESC;
typedef struct {
    unsigned int Width, Height, Depth;
    int Format;
    unsigned int NumChannels, Flags;
} DESC3D_v1;
typedef struct {
    size_t Width, Height, Depth;
    int Format;
    unsigned int NumChannels, Flags;
} DESC3D;
typedef struct {
    int type, requestedHandleTypes;
    struct {
        int type, id;
    } location;
    void *win32HandleMetaData;
    unsigned char allocFlags[8];
} PROP;

#define OOM 2
#define FMT_U32 0x03
#define FMT_HALF 0x10
#define FMT_FLOAT 0x20
#define LAYERED 0x01

/* The driver as this program sees it. */
struct api {
    CUresult (*init)(unsigned int);
    CUresult (*ctx_retain)(CUcontext *, CUdevice);
    CUresult (*ctx_set)(CUcontext);
    CUresult (*mem_info)(size_t *, size_t *);
    CUresult (*mem_info_v1)(unsigned int *, unsigned int *);
    CUresult (*total_mem)(size_t *, CUdevice);
    CUresult (*alloc)(CUdeviceptr *, size_t);
    CUresult (*free_)(CUdeviceptr);
    CUresult (*alloc_v1)(CUdeviceptr_v1 *, unsigned int);
    CUresult (*free_v1)(CUdeviceptr_v1);
    CUresult (*pitch)(CUdeviceptr *, size_t *, size_t, size_t, unsigned int);
    CUresult (*pitch_v1)(CUdeviceptr_v1 *, unsigned int *, unsigned int, unsigned int, unsigned int);
    CUresult (*managed)(CUdeviceptr *, size_t, unsigned int);
    CUresult (*alloc_async)(CUdeviceptr *, size_t, CUstream);
    CUresult (*free_async)(CUdeviceptr, CUstream);
    CUresult (*default_pool)(CUmemoryPool *, CUdevice);
    CUresult (*alloc_pool)(CUdeviceptr *, size_t, CUmemoryPool, CUstream);
    CUresult (*create)(CUmemGenericAllocationHandle *, size_t, const PROP *, unsigned long long);
    CUresult (*release)(CUmemGenericAllocationHandle);
    CUresult (*array)(CUarray *, const DESC *);
    CUresult (*array_v1)(CUarray *, const DESC_v1 *);
    CUresult (*array3d)(CUarray *, const DESC3D *);
    CUresult (*array3d_v1)(CUarray *, const DESC3D_v1 *);
    CUresult (*array_destroy)(CUarray);
    CUresult (*mipmap)(CUmipmappedArray *, const DESC3D *, unsigned int);
    CUresult (*mipmap_destroy)(CUmipmappedArray);
    unsigned long long (*calls)(const char *);
    unsigned long long (*used)(int);
    const char *async_name, *pool_name; /* which fake entry point the async calls reach */
};

static struct api A;
static const char *mode;

#define FAIL(...)                                                                                                  \
    do {                                                                                                           \
        printf("FAIL %s:%d: ", __FILE__, __LINE__);                                                                \
        printf(__VA_ARGS__);                                                                                       \
        printf("\n");                                                                                              \
        fflush(stdout);                                                                                            \
        exit(1);                                                                                                   \
    } while (0)
#define CHECK(rc, what)                                                                                            \
    do {                                                                                                           \
        CUresult _rc = (rc);                                                                                       \
        if (_rc != 0)                                                                                              \
            FAIL("%s returned %d", what, _rc);                                                                     \
    } while (0)
#define EXPECT_EQ(a, b, what)                                                                                      \
    do {                                                                                                           \
        unsigned long long _a = (unsigned long long)(a), _b = (unsigned long long)(b);                             \
        if (_a != _b)                                                                                              \
            FAIL("%s: %llu != %llu", what, _a, _b);                                                                \
    } while (0)

#ifdef LINKED
CUresult cuInit(unsigned int);
CUresult cuDevicePrimaryCtxRetain(CUcontext *, CUdevice);
CUresult cuCtxSetCurrent(CUcontext);
CUresult cuMemGetInfo_v2(size_t *, size_t *);
CUresult cuMemGetInfo(unsigned int *, unsigned int *);
CUresult cuDeviceTotalMem_v2(size_t *, CUdevice);
CUresult cuMemAlloc_v2(CUdeviceptr *, size_t);
CUresult cuMemFree_v2(CUdeviceptr);
CUresult cuMemAlloc(CUdeviceptr_v1 *, unsigned int);
CUresult cuMemFree(CUdeviceptr_v1);
CUresult cuMemAllocPitch_v2(CUdeviceptr *, size_t *, size_t, size_t, unsigned int);
CUresult cuMemAllocPitch(CUdeviceptr_v1 *, unsigned int *, unsigned int, unsigned int, unsigned int);
CUresult cuMemAllocManaged(CUdeviceptr *, size_t, unsigned int);
CUresult cuMemAllocAsync(CUdeviceptr *, size_t, CUstream);
CUresult cuMemFreeAsync(CUdeviceptr, CUstream);
CUresult cuDeviceGetDefaultMemPool(CUmemoryPool *, CUdevice);
CUresult cuMemAllocFromPoolAsync(CUdeviceptr *, size_t, CUmemoryPool, CUstream);
CUresult cuMemCreate(CUmemGenericAllocationHandle *, size_t, const PROP *, unsigned long long);
CUresult cuMemRelease(CUmemGenericAllocationHandle);
CUresult cuArrayCreate_v2(CUarray *, const DESC *);
CUresult cuArrayCreate(CUarray *, const DESC_v1 *);
CUresult cuArray3DCreate_v2(CUarray *, const DESC3D *);
CUresult cuArray3DCreate(CUarray *, const DESC3D_v1 *);
CUresult cuArrayDestroy(CUarray);
CUresult cuMipmappedArrayCreate(CUmipmappedArray *, const DESC3D *, unsigned int);
CUresult cuMipmappedArrayDestroy(CUmipmappedArray);
CUresult cuGetProcAddress_v2(const char *, void **, int, unsigned long long, int *);
CUresult cuGetProcAddress(const char *, void **, int, unsigned long long);
unsigned long long fake_cuda_calls(const char *);
unsigned long long fake_cuda_used(int);

static void bind_direct(void)
{
    A = (struct api){cuInit, cuDevicePrimaryCtxRetain, cuCtxSetCurrent, cuMemGetInfo_v2, cuMemGetInfo,
                     cuDeviceTotalMem_v2, cuMemAlloc_v2, cuMemFree_v2, cuMemAlloc, cuMemFree, cuMemAllocPitch_v2,
                     cuMemAllocPitch, cuMemAllocManaged, cuMemAllocAsync, cuMemFreeAsync, cuDeviceGetDefaultMemPool,
                     cuMemAllocFromPoolAsync, cuMemCreate, cuMemRelease, cuArrayCreate_v2, cuArrayCreate,
                     cuArray3DCreate_v2, cuArray3DCreate, cuArrayDestroy, cuMipmappedArrayCreate,
                     cuMipmappedArrayDestroy, fake_cuda_calls, fake_cuda_used, "cuMemAllocAsync",
                     "cuMemAllocFromPoolAsync"};
}
#endif

static void *must_dlsym(void *handle, const char *name)
{
    void *p = dlsym(handle, name);
    if (!p)
        FAIL("dlsym(%s): %s", name, dlerror());
    return p;
}

#define SYM(field, name) *(void **)&A.field = must_dlsym(handle, name)

static void bind_dlopen(void)
{
    void *handle = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (!handle)
        FAIL("dlopen libcuda.so.1: %s", dlerror());
    SYM(init, "cuInit");
    SYM(ctx_retain, "cuDevicePrimaryCtxRetain");
    SYM(ctx_set, "cuCtxSetCurrent");
    SYM(mem_info, "cuMemGetInfo_v2");
    SYM(mem_info_v1, "cuMemGetInfo");
    SYM(total_mem, "cuDeviceTotalMem_v2");
    SYM(alloc, "cuMemAlloc_v2");
    SYM(free_, "cuMemFree_v2");
    SYM(alloc_v1, "cuMemAlloc");
    SYM(free_v1, "cuMemFree");
    SYM(pitch, "cuMemAllocPitch_v2");
    SYM(pitch_v1, "cuMemAllocPitch");
    SYM(managed, "cuMemAllocManaged");
    SYM(alloc_async, "cuMemAllocAsync_ptsz");
    SYM(free_async, "cuMemFreeAsync_ptsz");
    SYM(default_pool, "cuDeviceGetDefaultMemPool");
    SYM(alloc_pool, "cuMemAllocFromPoolAsync_ptsz");
    SYM(create, "cuMemCreate");
    SYM(release, "cuMemRelease");
    SYM(array, "cuArrayCreate_v2");
    SYM(array_v1, "cuArrayCreate");
    SYM(array3d, "cuArray3DCreate_v2");
    SYM(array3d_v1, "cuArray3DCreate");
    SYM(array_destroy, "cuArrayDestroy");
    SYM(mipmap, "cuMipmappedArrayCreate");
    SYM(mipmap_destroy, "cuMipmappedArrayDestroy");
    SYM(calls, "fake_cuda_calls");
    SYM(used, "fake_cuda_used");
    A.async_name = "cuMemAllocAsync_ptsz";
    A.pool_name = "cuMemAllocFromPoolAsync_ptsz";
}

/* CUDA 12 style: get cuGetProcAddress once, then ask it for everything. */
static void bind_procaddr(int ptds, int legacy_entry)
{
    void *handle = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (!handle)
        FAIL("dlopen libcuda.so.1: %s", dlerror());
    CUresult (*gpa2)(const char *, void **, int, unsigned long long, int *) = NULL;
    CUresult (*gpa1)(const char *, void **, int, unsigned long long) = NULL;
    *(void **)&gpa2 = must_dlsym(handle, "cuGetProcAddress_v2");
    /* The driver hands out cuGetProcAddress itself, too. */
    void *self = NULL;
    int status = -1;
    CHECK(gpa2("cuGetProcAddress", &self, 12040, 0, &status), "cuGetProcAddress(cuGetProcAddress)");
    if (self != (void *)gpa2)
        FAIL("cuGetProcAddress(\"cuGetProcAddress\", 12040) is not the hooked cuGetProcAddress_v2");
    if (legacy_entry)
        CHECK(gpa2("cuGetProcAddress", (void **)&gpa1, 11030, 0, &status), "cuGetProcAddress v1");
    unsigned long long flags = ptds ? 2 : 0;
#define GET(field, name, version)                                                                                  \
    do {                                                                                                           \
        void *fn = NULL;                                                                                           \
        int st = -1;                                                                                               \
        CUresult rc = legacy_entry ? gpa1(name, &fn, version, flags) : gpa2(name, &fn, version, flags, &st);      \
        if (rc != 0 || !fn)                                                                                        \
            FAIL("cuGetProcAddress(%s, %d) = %d", name, version, rc);                                              \
        *(void **)&A.field = fn;                                                                                   \
    } while (0)
    GET(init, "cuInit", 12040);
    GET(ctx_retain, "cuDevicePrimaryCtxRetain", 12040);
    GET(ctx_set, "cuCtxSetCurrent", 12040);
    GET(mem_info, "cuMemGetInfo", 12040);
    GET(mem_info_v1, "cuMemGetInfo", 3010);
    GET(total_mem, "cuDeviceTotalMem", 12040);
    GET(alloc, "cuMemAlloc", 12040);
    GET(free_, "cuMemFree", 12040);
    GET(alloc_v1, "cuMemAlloc", 3010);
    GET(free_v1, "cuMemFree", 3010);
    GET(pitch, "cuMemAllocPitch", 12040);
    GET(pitch_v1, "cuMemAllocPitch", 3010);
    GET(managed, "cuMemAllocManaged", 12040);
    GET(alloc_async, "cuMemAllocAsync", 12040);
    GET(free_async, "cuMemFreeAsync", 12040);
    GET(default_pool, "cuDeviceGetDefaultMemPool", 12040);
    GET(alloc_pool, "cuMemAllocFromPoolAsync", 12040);
    GET(create, "cuMemCreate", 12040);
    GET(release, "cuMemRelease", 12040);
    GET(array, "cuArrayCreate", 12040);
    GET(array_v1, "cuArrayCreate", 3010);
    GET(array3d, "cuArray3DCreate", 12040);
    GET(array3d_v1, "cuArray3DCreate", 3010);
    GET(array_destroy, "cuArrayDestroy", 12040);
    GET(mipmap, "cuMipmappedArrayCreate", 12040);
    GET(mipmap_destroy, "cuMipmappedArrayDestroy", 12040);
#undef GET
    SYM(calls, "fake_cuda_calls");
    SYM(used, "fake_cuda_used");
    A.async_name = ptds ? "cuMemAllocAsync_ptsz" : "cuMemAllocAsync";
    A.pool_name = ptds ? "cuMemAllocFromPoolAsync_ptsz" : "cuMemAllocFromPoolAsync";
}

static void start(int device)
{
    CUcontext ctx;
    CHECK(A.init(0), "cuInit");
    CHECK(A.ctx_retain(&ctx, device), "cuDevicePrimaryCtxRetain");
    CHECK(A.ctx_set(ctx), "cuCtxSetCurrent");
}

static size_t free_now(void)
{
    size_t f = 0, t = 0;
    CHECK(A.mem_info(&f, &t), "cuMemGetInfo_v2");
    return f;
}

static size_t total_now(void)
{
    size_t f = 0, t = 0;
    CHECK(A.mem_info(&f, &t), "cuMemGetInfo_v2");
    return t;
}

/* Call `expr`, expect OUT_OF_MEMORY, and expect the driver's `fn` untouched. */
#define EXPECT_REFUSED(expr, fn)                                                                                   \
    do {                                                                                                           \
        unsigned long long _before = A.calls(fn);                                                                  \
        CUresult _rc = (expr);                                                                                     \
        if (_rc != OOM)                                                                                            \
            FAIL("%s: expected CUDA_ERROR_OUT_OF_MEMORY, got %d", #expr, _rc);                                     \
        if (A.calls(fn) != _before)                                                                                \
            FAIL("%s: the refused call reached the driver's %s", #expr, fn);                                       \
    } while (0)

static int scenario_cap(unsigned long long limit)
{
    start(0);
    EXPECT_EQ(total_now(), limit, "cuMemGetInfo total");
    size_t tm = 0;
    CHECK(A.total_mem(&tm, 0), "cuDeviceTotalMem_v2");
    EXPECT_EQ(tm, limit, "cuDeviceTotalMem");
    unsigned long long chunk = limit / 4;
    CUdeviceptr p[4];
    for (int i = 0; i < 4; i++) {
        CHECK(A.alloc(&p[i], chunk), "cuMemAlloc_v2");
        EXPECT_EQ(free_now(), limit - (i + 1) * chunk, "free after alloc");
    }
    EXPECT_REFUSED(A.alloc(&p[0] + 0, 1 + (limit - 4 * chunk)), "cuMemAlloc_v2");
    EXPECT_EQ(free_now(), limit - 4 * chunk, "free after refusal");
    CHECK(A.free_(p[3]), "cuMemFree_v2");
    EXPECT_EQ(free_now(), limit - 3 * chunk, "free after free");
    CUdeviceptr q;
    EXPECT_REFUSED(A.alloc(&q, chunk + (limit - 4 * chunk) + 1), "cuMemAlloc_v2");
    CHECK(A.alloc(&q, chunk + (limit - 4 * chunk)), "cuMemAlloc_v2 to exactly the cap");
    EXPECT_EQ(free_now(), 0, "free at the cap");
    unsigned int f1 = 0, t1 = 0;
    CHECK(A.mem_info_v1(&f1, &t1), "cuMemGetInfo (v1)");
    EXPECT_EQ(f1, 0, "v1 free at the cap");
    EXPECT_EQ(t1, limit > 0xffffffffULL ? 0xffffffffULL : limit, "v1 total");
    for (int i = 0; i < 3; i++)
        CHECK(A.free_(p[i]), "cuMemFree_v2");
    CHECK(A.free_(q), "cuMemFree_v2");
    EXPECT_EQ(free_now(), limit, "free after freeing everything");
    EXPECT_EQ(A.used(0), 0, "driver memory in use at the end");
    printf("ok cap %s\n", mode);
    return 0;
}

/* Allocate with one allocator: check the exact bytes accounted, a refusal
 * past the cap that never reaches the driver, and the return on free. */
typedef CUresult (*alloc_fn)(void *ctx, uint64_t *key);
typedef CUresult (*free_fn)(void *ctx, uint64_t key);

struct kind {
    const char *name;
    const char *driver_fn;
    unsigned long long bytes;
    CUresult (*make)(const struct kind *, uint64_t *, int huge);
    CUresult (*destroy)(const struct kind *, uint64_t);
};

static CUresult make_alloc(const struct kind *k, uint64_t *key, int huge)
{
    CUdeviceptr p = 0;
    CUresult rc = A.alloc(&p, huge ? (size_t)1 << 40 : k->bytes);
    *key = p;
    return rc;
}
static CUresult free_alloc(const struct kind *k, uint64_t key)
{
    (void)k;
    return A.free_(key);
}
static CUresult make_alloc_v1(const struct kind *k, uint64_t *key, int huge)
{
    CUdeviceptr_v1 p = 0;
    CUresult rc = A.alloc_v1(&p, huge ? 0xfff00000u : (unsigned int)k->bytes);
    *key = p;
    return rc;
}
static CUresult free_alloc_v1(const struct kind *k, uint64_t key)
{
    (void)k;
    return A.free_v1((CUdeviceptr_v1)key);
}
static CUresult make_pitch(const struct kind *k, uint64_t *key, int huge)
{
    (void)k;
    CUdeviceptr p = 0;
    size_t pitch = 0;
    CUresult rc = A.pitch(&p, &pitch, 1000, huge ? (size_t)1 << 30 : 64, 4);
    if (rc == 0 && !huge && pitch != 1024)
        FAIL("pitch %zu, expected 1024", pitch);
    *key = p;
    return rc;
}
static CUresult make_pitch_v1(const struct kind *k, uint64_t *key, int huge)
{
    (void)k;
    CUdeviceptr_v1 p = 0;
    unsigned int pitch = 0;
    CUresult rc = A.pitch_v1(&p, &pitch, 1000, huge ? 1u << 22 : 64, 4);
    *key = p;
    return rc;
}
static CUresult make_managed(const struct kind *k, uint64_t *key, int huge)
{
    CUdeviceptr p = 0;
    CUresult rc = A.managed(&p, huge ? (size_t)1 << 40 : k->bytes, 1);
    *key = p;
    return rc;
}
static CUresult make_async(const struct kind *k, uint64_t *key, int huge)
{
    CUdeviceptr p = 0;
    CUresult rc = A.alloc_async(&p, huge ? (size_t)1 << 40 : k->bytes, NULL);
    *key = p;
    return rc;
}
static CUresult free_async(const struct kind *k, uint64_t key)
{
    (void)k;
    return A.free_async(key, NULL);
}
static CUresult make_pool(const struct kind *k, uint64_t *key, int huge)
{
    CUmemoryPool pool;
    CHECK(A.default_pool(&pool, 0), "cuDeviceGetDefaultMemPool");
    CUdeviceptr p = 0;
    CUresult rc = A.alloc_pool(&p, huge ? (size_t)1 << 40 : k->bytes, pool, NULL);
    *key = p;
    return rc;
}
static CUresult make_vmm(const struct kind *k, uint64_t *key, int huge)
{
    PROP prop;
    memset(&prop, 0, sizeof(prop));
    prop.type = 1;
    prop.location.type = 1;
    prop.location.id = 0;
    CUmemGenericAllocationHandle h = 0;
    CUresult rc = A.create(&h, huge ? (size_t)1 << 40 : k->bytes, &prop, 0);
    *key = h;
    return rc;
}
static CUresult free_vmm(const struct kind *k, uint64_t key)
{
    (void)k;
    return A.release(key);
}
static CUresult make_array(const struct kind *k, uint64_t *key, int huge)
{
    (void)k;
    DESC d = {huge ? (size_t)1 << 20 : 64, huge ? (size_t)1 << 20 : 32, FMT_FLOAT, 4};
    CUarray a = NULL;
    CUresult rc = A.array(&a, &d);
    *key = (uint64_t)(uintptr_t)a;
    return rc;
}
static CUresult make_array_v1(const struct kind *k, uint64_t *key, int huge)
{
    (void)k;
    DESC_v1 d = {huge ? 1u << 20 : 64, huge ? 1u << 20 : 32, FMT_FLOAT, 4};
    CUarray a = NULL;
    CUresult rc = A.array_v1(&a, &d);
    *key = (uint64_t)(uintptr_t)a;
    return rc;
}
static CUresult make_array3d(const struct kind *k, uint64_t *key, int huge)
{
    (void)k;
    DESC3D d = {16, 16, huge ? (size_t)1 << 30 : 8, FMT_HALF, 2, 0};
    CUarray a = NULL;
    CUresult rc = A.array3d(&a, &d);
    *key = (uint64_t)(uintptr_t)a;
    return rc;
}
static CUresult make_array3d_v1(const struct kind *k, uint64_t *key, int huge)
{
    (void)k;
    DESC3D_v1 d = {16, 16, huge ? 1u << 30 : 8, FMT_HALF, 2, LAYERED};
    CUarray a = NULL;
    CUresult rc = A.array3d_v1(&a, &d);
    *key = (uint64_t)(uintptr_t)a;
    return rc;
}
static CUresult free_array(const struct kind *k, uint64_t key)
{
    (void)k;
    return A.array_destroy((CUarray)(uintptr_t)key);
}
static CUresult make_mipmap(const struct kind *k, uint64_t *key, int huge)
{
    (void)k;
    DESC3D d = {huge ? (size_t)1 << 20 : 64, huge ? (size_t)1 << 20 : 64, 0, FMT_U32, 1, 0};
    CUmipmappedArray a = NULL;
    CUresult rc = A.mipmap(&a, &d, 3);
    *key = (uint64_t)(uintptr_t)a;
    return rc;
}
static CUresult free_mipmap(const struct kind *k, uint64_t key)
{
    (void)k;
    return A.mipmap_destroy((CUmipmappedArray)(uintptr_t)key);
}

static int scenario_kinds(unsigned long long limit)
{
    start(0);
    struct kind kinds[] = {
        {"alloc", "cuMemAlloc_v2", 3 << 20, make_alloc, free_alloc},
        {"alloc_v1", "cuMemAlloc", 1 << 20, make_alloc_v1, free_alloc_v1},
        {"pitch", "cuMemAllocPitch_v2", 1024 * 64, make_pitch, free_alloc},
        {"pitch_v1", "cuMemAllocPitch", 1024 * 64, make_pitch_v1, free_alloc_v1},
        {"managed", "cuMemAllocManaged", 5 << 20, make_managed, free_alloc},
        {"async", A.async_name, 7 << 20, make_async, free_async},
        {"pool", A.pool_name, 9 << 20, make_pool, free_async},
        {"vmm", "cuMemCreate", 2 << 20, make_vmm, free_vmm},
        {"array", "cuArrayCreate_v2", 64 * 32 * 4 * 4, make_array, free_array},
        {"array_v1", "cuArrayCreate", 64 * 32 * 4 * 4, make_array_v1, free_array},
        {"array3d", "cuArray3DCreate_v2", 16 * 16 * 8 * 2 * 2, make_array3d, free_array},
        {"array3d_v1_layered", "cuArray3DCreate", 16 * 16 * 8 * 2 * 2, make_array3d_v1, free_array},
        {"mipmap", "cuMipmappedArrayCreate", (64 * 64 + 32 * 32 + 16 * 16) * 4, make_mipmap, free_mipmap},
    };
    for (size_t i = 0; i < sizeof(kinds) / sizeof(kinds[0]); i++) {
        const struct kind *k = &kinds[i];
        size_t before = free_now();
        unsigned long long driver_before = A.used(0);
        uint64_t key = 0;
        CUresult rc = k->make(k, &key, 0);
        if (rc != 0)
            FAIL("%s: create returned %d", k->name, rc);
        if (before - free_now() != k->bytes)
            FAIL("%s: %zu bytes accounted, expected %llu", k->name, before - free_now(), k->bytes);
        if (A.used(0) - driver_before != k->bytes)
            FAIL("%s: the driver allocated %llu bytes, expected %llu", k->name, A.used(0) - driver_before, k->bytes);
        uint64_t other = 0;
        unsigned long long calls_before = A.calls(k->driver_fn);
        rc = k->make(k, &other, 1);
        if (rc != OOM)
            FAIL("%s: a creation past the cap returned %d", k->name, rc);
        if (A.calls(k->driver_fn) != calls_before)
            FAIL("%s: the refused creation reached the driver's %s", k->name, k->driver_fn);
        CHECK(k->destroy(k, key), k->name);
        if (free_now() != before)
            FAIL("%s: free is %zu after destroy, expected %zu", k->name, free_now(), before);
    }
    EXPECT_EQ(free_now(), limit, "free at the end");
    printf("ok kinds %s\n", mode);
    return 0;
}

/* The driver picks the pitch: the interposer reserves an estimate (rows of
 * 512 bytes), then settles on pitch * height; if the real pitch does not
 * fit under the cap the allocation is undone and refused. */
static int scenario_pitch(unsigned long long limit, unsigned long long align)
{
    start(0);
    unsigned long long pitch_expected = (1000 + align - 1) / align * align;
    CUdeviceptr p = 0, q = 0;
    size_t pitch = 0;
    CHECK(A.pitch(&p, &pitch, 1000, 64, 4), "cuMemAllocPitch_v2");
    EXPECT_EQ(pitch, pitch_expected, "pitch");
    EXPECT_EQ(limit - free_now(), pitch * 64, "bytes accounted for a pitched allocation");
    unsigned long long remaining = free_now();
    size_t height = remaining / 1024; /* fits the estimate, not the real pitch when align > 1024 */
    unsigned long long driver_before = A.used(0), calls_before = A.calls("cuMemAllocPitch_v2");
    CUresult rc = A.pitch(&q, &pitch, 1000, height, 4);
    if (pitch_expected > 1024) {
        if (rc != OOM)
            FAIL("a pitched allocation past the cap returned %d", rc);
        EXPECT_EQ(A.calls("cuMemAllocPitch_v2"), calls_before + 1, "driver calls (the estimate fitted)");
        EXPECT_EQ(A.used(0), driver_before, "driver memory after the rollback");
    } else {
        CHECK(rc, "cuMemAllocPitch_v2 up to the cap");
        CHECK(A.free_(q), "cuMemFree_v2");
    }
    EXPECT_EQ(free_now(), remaining, "free after the refused allocation");
    CHECK(A.free_(p), "cuMemFree_v2");
    EXPECT_EQ(free_now(), limit, "free at the end");
    printf("ok pitch %llu\n", pitch_expected);
    return 0;
}

static int scenario_expect(int expected, unsigned long long bytes)
{
    start(0);
    CUdeviceptr p = 0;
    unsigned long long before = A.calls("cuMemAlloc_v2");
    CUresult rc = A.alloc(&p, bytes);
    if (rc != expected)
        FAIL("cuMemAlloc_v2(%llu) returned %d, expected %d", bytes, rc, expected);
    if (rc == OOM && A.calls("cuMemAlloc_v2") != before)
        FAIL("the refused call reached the driver");
    if (rc == 0)
        CHECK(A.free_(p), "cuMemFree_v2");
    size_t f = 0, t = 0;
    CHECK(A.mem_info(&f, &t), "cuMemGetInfo_v2");
    printf("ok expect %d free=%zu total=%zu\n", rc, f, t);
    return 0;
}

static int scenario_hold(unsigned long long bytes)
{
    start(0);
    CUdeviceptr p = 0;
    CHECK(A.alloc(&p, bytes), "cuMemAlloc_v2");
    printf("ready\n");
    fflush(stdout);
    for (;;)
        pause();
}

/* Threads allocating and freeing at random: after every successful
 * allocation, the driver's memory in use (node-wide, through the fake's
 * shared state) must not exceed the cap. */
struct stress {
    unsigned seed;
    int iters;
    unsigned long long limit, max_chunk;
    unsigned long long allocs, refused;
};

static unsigned next_rand(unsigned *s)
{
    *s = *s * 1103515245u + 12345u;
    return *s >> 8;
}

static void *stress_thread(void *arg)
{
    struct stress *st = arg;
    CUcontext ctx;
    CHECK(A.ctx_retain(&ctx, 0), "cuDevicePrimaryCtxRetain");
    CHECK(A.ctx_set(ctx), "cuCtxSetCurrent");
    enum { SLOTS = 16 };
    uint64_t keys[SLOTS] = {0};
    int kinds[SLOTS] = {0};
    for (int i = 0; i < st->iters; i++) {
        unsigned r = next_rand(&st->seed);
        int slot = (int)(r % SLOTS);
        if (keys[slot]) {
            CUresult rc = kinds[slot] == 0 ? A.free_(keys[slot])
                          : kinds[slot] == 1 ? A.free_async(keys[slot], NULL)
                                             : A.release(keys[slot]);
            CHECK(rc, "free");
            keys[slot] = 0;
            continue;
        }
        unsigned long long bytes = 1 + next_rand(&st->seed) % st->max_chunk;
        int kind = (int)(next_rand(&st->seed) % 3);
        CUresult rc;
        uint64_t key = 0;
        if (kind == 0) {
            CUdeviceptr p;
            rc = A.alloc(&p, bytes);
            key = p;
        } else if (kind == 1) {
            CUdeviceptr p;
            rc = A.alloc_async(&p, bytes, NULL);
            key = p;
        } else {
            PROP prop;
            memset(&prop, 0, sizeof(prop));
            prop.type = 1;
            prop.location.type = 1;
            CUmemGenericAllocationHandle h;
            rc = A.create(&h, bytes, &prop, 0);
            key = h;
        }
        if (rc == OOM) {
            st->refused++;
            continue;
        }
        CHECK(rc, "alloc");
        unsigned long long in_use = A.used(0);
        if (in_use > st->limit)
            FAIL("the driver has %llu bytes in use, over the %llu cap", in_use, st->limit);
        keys[slot] = key;
        kinds[slot] = kind;
        st->allocs++;
    }
    for (int s = 0; s < SLOTS; s++) {
        if (!keys[s])
            continue;
        CHECK(kinds[s] == 0 ? A.free_(keys[s]) : kinds[s] == 1 ? A.free_async(keys[s], NULL) : A.release(keys[s]),
              "final free");
    }
    return NULL;
}

static int scenario_stress(int threads, int iters, unsigned seed, unsigned long long limit,
                           unsigned long long max_chunk)
{
    start(0);
    pthread_t tids[64];
    struct stress st[64];
    if (threads > 64)
        threads = 64;
    for (int t = 0; t < threads; t++) {
        st[t] = (struct stress){seed * 7919u + (unsigned)t * 104729u, iters, limit, max_chunk, 0, 0};
        if (pthread_create(&tids[t], NULL, stress_thread, &st[t]) != 0)
            FAIL("pthread_create");
    }
    unsigned long long allocs = 0, refused = 0;
    for (int t = 0; t < threads; t++) {
        pthread_join(tids[t], NULL);
        allocs += st[t].allocs;
        refused += st[t].refused;
    }
    printf("ok stress allocs=%llu refused=%llu\n", allocs, refused);
    return 0;
}

/* Two devices, each with its own cap; VMM names its device explicitly. */
static int scenario_multidev(unsigned long long limit0, unsigned long long limit1)
{
    CUcontext c0, c1;
    CHECK(A.init(0), "cuInit");
    CHECK(A.ctx_retain(&c0, 0), "retain 0");
    CHECK(A.ctx_retain(&c1, 1), "retain 1");
    CHECK(A.ctx_set(c0), "set 0");
    EXPECT_EQ(total_now(), limit0, "device 0 total");
    CUdeviceptr p0, p1;
    CHECK(A.alloc(&p0, limit0), "alloc the whole cap on device 0");
    EXPECT_REFUSED(A.alloc(&p1, 1), "cuMemAlloc_v2");
    CHECK(A.ctx_set(c1), "set 1");
    EXPECT_EQ(total_now(), limit1, "device 1 total");
    EXPECT_EQ(free_now(), limit1, "device 1 untouched by device 0's usage");
    CHECK(A.alloc(&p1, limit1 / 2), "alloc on device 1");
    PROP prop;
    memset(&prop, 0, sizeof(prop));
    prop.type = 1;
    prop.location.type = 1;
    prop.location.id = 1;
    CUmemGenericAllocationHandle h;
    EXPECT_REFUSED(A.create(&h, limit1 - limit1 / 2 + 1, &prop, 0), "cuMemCreate");
    CHECK(A.create(&h, limit1 - limit1 / 2, &prop, 0), "cuMemCreate on device 1");
    EXPECT_EQ(free_now(), 0, "device 1 full");
    size_t tm = 0;
    CHECK(A.total_mem(&tm, 1), "cuDeviceTotalMem 1");
    EXPECT_EQ(tm, limit1, "cuDeviceTotalMem device 1");
    CHECK(A.release(h), "release");
    CHECK(A.free_(p1), "free 1");
    CHECK(A.ctx_set(c0), "set 0");
    CHECK(A.free_(p0), "free 0");
    EXPECT_EQ(free_now(), limit0, "device 0 free at the end");
    printf("ok multidev %s\n", mode);
    return 0;
}

/* A forked child is its own process with its own slot: its usage counts
 * while it lives and is reclaimed once it is killed. */
static int scenario_fork(unsigned long long limit)
{
    start(0);
    unsigned long long half = limit / 2;
    CUdeviceptr p;
    CHECK(A.alloc(&p, half), "parent alloc");
    int fds[2];
    if (pipe(fds) != 0)
        FAIL("pipe");
    pid_t child = fork();
    if (child < 0)
        FAIL("fork");
    if (child == 0) {
        CUdeviceptr q;
        CHECK(A.alloc(&q, limit - half), "child alloc");
        if (write(fds[1], "x", 1) != 1)
            _exit(3);
        for (;;)
            pause();
    }
    char c;
    if (read(fds[0], &c, 1) != 1)
        FAIL("child did not report");
    CUdeviceptr r;
    EXPECT_REFUSED(A.alloc(&r, limit - half), "cuMemAlloc_v2");
    kill(child, SIGKILL);
    waitpid(child, NULL, 0);
    CUresult rc = OOM;
    for (int attempt = 0; attempt < 150 && rc == OOM; attempt++) {
        rc = A.alloc(&r, limit - half);
        if (rc == OOM) {
            struct timespec ts = {0, 20 * 1000 * 1000};
            nanosleep(&ts, NULL);
        }
    }
    CHECK(rc, "parent alloc after the child was killed");
    CHECK(A.free_(r), "free");
    CHECK(A.free_(p), "free");
    EXPECT_EQ(free_now(), limit, "free at the end");
    printf("ok fork %s\n", mode);
    return 0;
}

/* dlsym(RTLD_NEXT/RTLD_DEFAULT) keeps working for everything else, and
 * finds the hooks for hooked names. */
static int scenario_dlsym(void)
{
    void *next_getpid = dlsym(RTLD_NEXT, "getpid");
    if (next_getpid != (void *)getpid)
        FAIL("dlsym(RTLD_NEXT, getpid) = %p, expected libc's %p", next_getpid, (void *)getpid);
    void *next_alloc = dlsym(RTLD_NEXT, "cuMemAlloc_v2");
    void *default_alloc = dlsym(RTLD_DEFAULT, "cuMemAlloc_v2");
    Dl_info a, b;
    if (!next_alloc || !dladdr(next_alloc, &a) || !strstr(a.dli_fname, "preload"))
        FAIL("dlsym(RTLD_NEXT, cuMemAlloc_v2) is not the hook (%s)", next_alloc ? a.dli_fname : "NULL");
    if (!default_alloc || !dladdr(default_alloc, &b) || !strstr(b.dli_fname, "preload"))
        FAIL("dlsym(RTLD_DEFAULT, cuMemAlloc_v2) is not the hook");
    if (dlsym(RTLD_NEXT, "no_such_symbol_anywhere") != NULL)
        FAIL("dlsym of a missing symbol found something");
    printf("ok dlsym\n");
    return 0;
}

static void usage(void)
{
    fprintf(stderr, "usage: snippet MODE SCENARIO ARGS\n"
                    "  cap LIMIT | kinds LIMIT | pitch LIMIT ALIGN | expect CODE BYTES | hold BYTES | fork LIMIT\n"
                    "  stress THREADS ITERS SEED LIMIT MAX_CHUNK | multidev LIMIT0 LIMIT1 | dlsym\n");
    exit(2);
}

int main(int argc, char **argv)
{
    if (argc < 3)
        usage();
    mode = argv[1];
    setvbuf(stdout, NULL, _IOLBF, 0);
    if (strcmp(mode, "direct") == 0) {
#ifdef LINKED
        bind_direct();
#else
        FAIL("this build is not linked against libcuda; use the linked build for direct mode");
#endif
    } else if (strcmp(mode, "dlopen") == 0) {
        bind_dlopen();
    } else if (strcmp(mode, "procaddr") == 0) {
        bind_procaddr(0, 0);
    } else if (strcmp(mode, "procaddr-ptds") == 0) {
        bind_procaddr(1, 0);
    } else if (strcmp(mode, "procaddr-v1") == 0) {
        bind_procaddr(0, 1);
    } else {
        usage();
    }
    const char *s = argv[2];
    unsigned long long a3 = argc > 3 ? strtoull(argv[3], NULL, 0) : 0;
    unsigned long long a4 = argc > 4 ? strtoull(argv[4], NULL, 0) : 0;
    if (strcmp(s, "cap") == 0 && argc == 4)
        return scenario_cap(a3);
    if (strcmp(s, "kinds") == 0 && argc == 4)
        return scenario_kinds(a3);
    if (strcmp(s, "expect") == 0 && argc == 5)
        return scenario_expect((int)a3, a4);
    if (strcmp(s, "hold") == 0 && argc == 4)
        return scenario_hold(a3);
    if (strcmp(s, "fork") == 0 && argc == 4)
        return scenario_fork(a3);
    if (strcmp(s, "multidev") == 0 && argc == 5)
        return scenario_multidev(a3, a4);
    if (strcmp(s, "pitch") == 0 && argc == 5)
        return scenario_pitch(a3, a4);
    if (strcmp(s, "dlsym") == 0)
        return scenario_dlsym();
    if (strcmp(s, "stress") == 0 && argc == 8)
        return scenario_stress((int)a3, (int)a4, (unsigned)strtoul(argv[5], NULL, 0), strtoull(argv[6], NULL, 0),
                               strtoull(argv[7], NULL, 0));
    usage();
    return 2;
}
