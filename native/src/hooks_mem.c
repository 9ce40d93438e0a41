/*
 * hooks_mem.c: the linear-memory allocators and their frees: cuMemAlloc,
 * pitched, managed, stream-ordered (async and pool) allocations, and the
 * virtual-memory-management physical allocations (cuMemCreate/Release);
 * and the cold half of the allocation body every hook shares (preload.h):
 * undoing an allocation that cannot be kept.
 *
 * Each allocation reserves its bytes before the driver is called, rolls the
 * reservation back if the driver fails, and records the pointer (or handle)
 * so the matching free returns exactly what was reserved.
 *
 * Must not: make a syscall or take a lock on these paths.
 */
#define _GNU_SOURCE
#include "preload.h"

static CUresult gn_undo_mem(CUdeviceptr ptr)
{
    __typeof__(&cuMemFree_v2) free_v2 = GN_REAL(cuMemFree_v2);
    if (free_v2)
        return free_v2(ptr);
    __typeof__(&cuMemFree) free_v1 = GN_REAL(cuMemFree);
    return free_v1 ? free_v1((CUdeviceptr_v1)ptr) : CUDA_ERROR_NOT_INITIALIZED;
}

GN_COLD CUresult gn_alloc_undo(uint64_t key, uint64_t val)
{
    switch (gn_val_kind(val)) {
    case GN_KIND_MEM:
        gn_undo_mem(key);
        break;
    case GN_KIND_VMM: {
        __typeof__(&cuMemRelease) release = GN_REAL(cuMemRelease);
        if (release)
            release(key);
        break;
    }
    case GN_KIND_ARRAY: {
        __typeof__(&cuArrayDestroy) destroy = GN_REAL(cuArrayDestroy);
        if (destroy)
            destroy((CUarray)(uintptr_t)key);
        break;
    }
    case GN_KIND_MIPMAP: {
        __typeof__(&cuMipmappedArrayDestroy) destroy = GN_REAL(cuMipmappedArrayDestroy);
        if (destroy)
            destroy((CUmipmappedArray)(uintptr_t)key);
        break;
    }
    }
    gn_unreserve(gn_val_dev(val), gn_val_bytes(val));
    return CUDA_ERROR_OUT_OF_MEMORY;
}

/* The pointer table had no room for the allocation: say so, then undo it. */
GN_COLD CUresult gn_alloc_lost(const char *what, uint64_t key, uint64_t val)
{
    gn_lost_tracking(what, key, gn_val_bytes(val));
    return gn_alloc_undo(key, val);
}

GN_EXPORT CUresult cuMemAlloc_v2(CUdeviceptr *dptr, size_t bytesize)
{
    __typeof__(&cuMemAlloc_v2) real = GN_REAL(cuMemAlloc_v2);
    if (GN_UNLIKELY(!real))
        return gn_missing(GN_ID_cuMemAlloc_v2);
    struct gn_alloc a;
    if (GN_UNLIKELY(!gn_alloc_begin(&a, GN_KIND_MEM, bytesize, -1, __func__)))
        return a.refused;
    return gn_alloc_end(&a, real(dptr, bytesize), dptr, sizeof *dptr);
}

GN_EXPORT CUresult cuMemFree_v2(CUdeviceptr dptr)
{
    __typeof__(&cuMemFree_v2) real = GN_REAL(cuMemFree_v2);
    if (GN_UNLIKELY(!real))
        return gn_missing(GN_ID_cuMemFree_v2);
    uint64_t val = gn_free_begin(dptr, GN_KIND_MEM);
    return gn_free_end(real(dptr), dptr, val);
}

GN_EXPORT CUresult cuMemAlloc(CUdeviceptr_v1 *dptr, unsigned int bytesize)
{
    __typeof__(&cuMemAlloc) real = GN_REAL(cuMemAlloc);
    if (GN_UNLIKELY(!real))
        return gn_missing(GN_ID_cuMemAlloc);
    struct gn_alloc a;
    if (GN_UNLIKELY(!gn_alloc_begin(&a, GN_KIND_MEM, bytesize, -1, __func__)))
        return a.refused;
    return gn_alloc_end(&a, real(dptr, bytesize), dptr, sizeof *dptr);
}

GN_EXPORT CUresult cuMemFree(CUdeviceptr_v1 dptr)
{
    __typeof__(&cuMemFree) real = GN_REAL(cuMemFree);
    if (GN_UNLIKELY(!real))
        return gn_missing(GN_ID_cuMemFree);
    uint64_t val = gn_free_begin(dptr, GN_KIND_MEM);
    return gn_free_end(real(dptr), dptr, val);
}

/* Pitched allocations: the driver picks the pitch, so reserve an estimate
 * (rows padded to 512 bytes), then settle on pitch * height. */
static uint64_t gn_pitch_estimate(uint64_t width, uint64_t height)
{
    uint64_t row = width + 511, bytes;
    if (row < width)
        return UINT64_MAX;
    row &= ~(uint64_t)511;
    if (__builtin_mul_overflow(row, height ? height : 1, &bytes))
        return UINT64_MAX;
    return bytes;
}

/* Move a counted reservation from the estimate to `actual` bytes (the
 * product pitch * height, UINT64_MAX when it overflows); 0 if the extra
 * bytes would pass the cap, and then nothing changed. */
static int gn_alloc_resize(struct gn_alloc *a, uint64_t actual)
{
    if (!a->counted)
        return 1;
    if (actual == UINT64_MAX)
        return 0;
    if (actual < a->bytes) {
        gn_unreserve(a->dev, a->bytes - actual);
    } else if (actual > a->bytes) {
        uint64_t extra = actual - a->bytes;
        if (gpunode_memcap_try_add(&gn_hot.usage->used_bytes[a->dev], extra, gn_hot.limit_bytes[a->dev]))
            atomic_fetch_add_explicit(&gn_hot.slot->used_bytes[a->dev], extra, memory_order_relaxed);
        else if (gn_reserve_cold(a->dev, extra) != GN_TRACK)
            return 0;
    }
    a->bytes = actual;
    return 1;
}

static uint64_t gn_pitch_bytes(uint64_t pitch, uint64_t height)
{
    uint64_t bytes;
    return __builtin_mul_overflow(pitch, height, &bytes) ? UINT64_MAX : bytes;
}

GN_EXPORT CUresult cuMemAllocPitch_v2(CUdeviceptr *dptr, size_t *pitch, size_t width_bytes, size_t height,
                                      unsigned int element_bytes)
{
    __typeof__(&cuMemAllocPitch_v2) real = GN_REAL(cuMemAllocPitch_v2);
    if (GN_UNLIKELY(!real))
        return gn_missing(GN_ID_cuMemAllocPitch_v2);
    struct gn_alloc a;
    if (!gn_alloc_begin(&a, GN_KIND_MEM, gn_pitch_estimate(width_bytes, height), -1, __func__))
        return a.refused;
    CUresult r = real(dptr, pitch, width_bytes, height, element_bytes);
    if (r == CUDA_SUCCESS && !gn_alloc_resize(&a, gn_pitch_bytes(*pitch, height)))
        return gn_alloc_undo(*dptr, gn_alloc_val(&a));
    return gn_alloc_end(&a, r, dptr, sizeof *dptr);
}

GN_EXPORT CUresult cuMemAllocPitch(CUdeviceptr_v1 *dptr, unsigned int *pitch, unsigned int width_bytes,
                                   unsigned int height, unsigned int element_bytes)
{
    __typeof__(&cuMemAllocPitch) real = GN_REAL(cuMemAllocPitch);
    if (GN_UNLIKELY(!real))
        return gn_missing(GN_ID_cuMemAllocPitch);
    struct gn_alloc a;
    if (!gn_alloc_begin(&a, GN_KIND_MEM, gn_pitch_estimate(width_bytes, height), -1, __func__))
        return a.refused;
    CUresult r = real(dptr, pitch, width_bytes, height, element_bytes);
    if (r == CUDA_SUCCESS && !gn_alloc_resize(&a, gn_pitch_bytes(*pitch, height)))
        return gn_alloc_undo(*dptr, gn_alloc_val(&a));
    return gn_alloc_end(&a, r, dptr, sizeof *dptr);
}

GN_EXPORT CUresult cuMemAllocManaged(CUdeviceptr *dptr, size_t bytesize, unsigned int flags)
{
    __typeof__(&cuMemAllocManaged) real = GN_REAL(cuMemAllocManaged);
    if (GN_UNLIKELY(!real))
        return gn_missing(GN_ID_cuMemAllocManaged);
    struct gn_alloc a;
    if (!gn_alloc_begin(&a, GN_KIND_MEM, bytesize, -1, __func__))
        return a.refused;
    return gn_alloc_end(&a, real(dptr, bytesize, flags), dptr, sizeof *dptr);
}

/* Stream-ordered allocations and frees: one definition for the legacy and
 * per-thread-stream entry points of each. */
#define GN_ALLOC_ASYNC(name, params, args)                                                                         \
    GN_EXPORT CUresult name params                                                                                 \
    {                                                                                                              \
        __typeof__(&name) real = GN_REAL(name);                                                                    \
        if (GN_UNLIKELY(!real))                                                                                    \
            return gn_missing(GN_ID_##name);                                                                       \
        struct gn_alloc a;                                                                                         \
        if (GN_UNLIKELY(!gn_alloc_begin(&a, GN_KIND_MEM, bytesize, -1, __func__)))                                 \
            return a.refused;                                                                                      \
        return gn_alloc_end(&a, real args, dptr, sizeof *dptr);                                                    \
    }

GN_ALLOC_ASYNC(cuMemAllocAsync, (CUdeviceptr * dptr, size_t bytesize, CUstream stream), (dptr, bytesize, stream))
GN_ALLOC_ASYNC(cuMemAllocAsync_ptsz, (CUdeviceptr * dptr, size_t bytesize, CUstream stream),
               (dptr, bytesize, stream))
GN_ALLOC_ASYNC(cuMemAllocFromPoolAsync, (CUdeviceptr * dptr, size_t bytesize, CUmemoryPool pool, CUstream stream),
               (dptr, bytesize, pool, stream))
GN_ALLOC_ASYNC(cuMemAllocFromPoolAsync_ptsz,
               (CUdeviceptr * dptr, size_t bytesize, CUmemoryPool pool, CUstream stream),
               (dptr, bytesize, pool, stream))

#define GN_FREE_ASYNC(name)                                                                                        \
    GN_EXPORT CUresult name(CUdeviceptr dptr, CUstream stream)                                                     \
    {                                                                                                              \
        __typeof__(&name) real = GN_REAL(name);                                                                    \
        if (GN_UNLIKELY(!real))                                                                                    \
            return gn_missing(GN_ID_##name);                                                                       \
        uint64_t val = gn_free_begin(dptr, GN_KIND_MEM);                                                           \
        return gn_free_end(real(dptr, stream), dptr, val);                                                         \
    }

GN_FREE_ASYNC(cuMemFreeAsync)
GN_FREE_ASYNC(cuMemFreeAsync_ptsz)

/* Virtual memory management: cuMemCreate makes the physical allocation (on
 * the device named in prop->location); mapping it costs nothing more. */
GN_EXPORT CUresult cuMemCreate(CUmemGenericAllocationHandle *handle, size_t size, const CUmemAllocationProp *prop,
                               unsigned long long flags)
{
    __typeof__(&cuMemCreate) real = GN_REAL(cuMemCreate);
    if (GN_UNLIKELY(!real))
        return gn_missing(GN_ID_cuMemCreate);
    if (!prop || prop->location.type != CU_MEM_LOCATION_TYPE_DEVICE)
        return real(handle, size, prop, flags); /* host memory, or invalid: not ours to count */
    struct gn_alloc a;
    if (!gn_alloc_begin(&a, GN_KIND_VMM, size, prop->location.id, __func__))
        return a.refused;
    return gn_alloc_end(&a, real(handle, size, prop, flags), handle, sizeof *handle);
}

GN_EXPORT CUresult cuMemRelease(CUmemGenericAllocationHandle handle)
{
    __typeof__(&cuMemRelease) real = GN_REAL(cuMemRelease);
    if (GN_UNLIKELY(!real))
        return gn_missing(GN_ID_cuMemRelease);
    uint64_t val = gn_free_begin(handle, GN_KIND_VMM);
    return gn_free_end(real(handle), handle, val);
}
