/*
 * hooks_mem.c: the linear-memory allocators and their frees: cuMemAlloc,
 * pitched, managed, stream-ordered (async and pool) allocations, and the
 * virtual-memory-management physical allocations (cuMemCreate/Release).
 *
 * Each allocation reserves its bytes before the driver is called, rolls the
 * reservation back if the driver fails, and records the pointer (or handle)
 * so the matching free returns exactly what was reserved.
 *
 * Must not: make a syscall or take a lock on these paths.
 */
#define _GNU_SOURCE
#include "preload.h"

/* Record a new allocation; if the table is full, undo it with `undo` and
 * refuse, so nothing is ever allocated uncounted. */
#define GN_TRACK_OR_UNDO(key, bytes, dev, kind, undo)                                                              \
    do {                                                                                                           \
        if (GN_UNLIKELY(!gn_table_put((key), gn_pack((bytes), (dev), (kind))))) {                                  \
            gn_lost_tracking(__func__, (key), (bytes));                                                            \
            undo;                                                                                                  \
            gn_unreserve((dev), (bytes));                                                                          \
            return CUDA_ERROR_OUT_OF_MEMORY;                                                                       \
        }                                                                                                          \
    } while (0)

static CUresult gn_undo_mem(CUdeviceptr ptr)
{
    __typeof__(&cuMemFree_v2) free_v2 = GN_REAL(cuMemFree_v2);
    if (free_v2)
        return free_v2(ptr);
    __typeof__(&cuMemFree) free_v1 = GN_REAL(cuMemFree);
    return free_v1 ? free_v1((CUdeviceptr_v1)ptr) : CUDA_ERROR_NOT_INITIALIZED;
}

GN_EXPORT CUresult cuMemAlloc_v2(CUdeviceptr *dptr, size_t bytesize)
{
    __typeof__(&cuMemAlloc_v2) real = GN_REAL(cuMemAlloc_v2);
    if (GN_UNLIKELY(!real))
        return gn_missing(GN_ID_cuMemAlloc_v2);
    unsigned dev;
    CUresult err = CUDA_SUCCESS;
    int verdict = gn_reserve(bytesize, -1, &dev, &err);
    if (GN_UNLIKELY(verdict != GN_TRACK))
        return verdict == GN_PASS ? real(dptr, bytesize) : gn_denied(verdict, err, __func__, bytesize);
    CUresult r = real(dptr, bytesize);
    if (GN_UNLIKELY(r != CUDA_SUCCESS)) {
        gn_unreserve(dev, bytesize);
        return r;
    }
    GN_TRACK_OR_UNDO(*dptr, bytesize, dev, GN_KIND_MEM, gn_undo_mem(*dptr));
    return r;
}

GN_EXPORT CUresult cuMemFree_v2(CUdeviceptr dptr)
{
    __typeof__(&cuMemFree_v2) real = GN_REAL(cuMemFree_v2);
    if (GN_UNLIKELY(!real))
        return gn_missing(GN_ID_cuMemFree_v2);
    uint64_t val;
    if (!gn_table_take(dptr, GN_KIND_MEM, &val))
        return real(dptr);
    CUresult r = real(dptr);
    gn_settle_free(r, dptr, val);
    return r;
}

GN_EXPORT CUresult cuMemAlloc(CUdeviceptr_v1 *dptr, unsigned int bytesize)
{
    __typeof__(&cuMemAlloc) real = GN_REAL(cuMemAlloc);
    if (GN_UNLIKELY(!real))
        return gn_missing(GN_ID_cuMemAlloc);
    unsigned dev;
    CUresult err = CUDA_SUCCESS;
    int verdict = gn_reserve(bytesize, -1, &dev, &err);
    if (GN_UNLIKELY(verdict != GN_TRACK))
        return verdict == GN_PASS ? real(dptr, bytesize) : gn_denied(verdict, err, __func__, bytesize);
    CUresult r = real(dptr, bytesize);
    if (r != CUDA_SUCCESS) {
        gn_unreserve(dev, bytesize);
        return r;
    }
    GN_TRACK_OR_UNDO(*dptr, bytesize, dev, GN_KIND_MEM, gn_undo_mem(*dptr));
    return r;
}

GN_EXPORT CUresult cuMemFree(CUdeviceptr_v1 dptr)
{
    __typeof__(&cuMemFree) real = GN_REAL(cuMemFree);
    if (GN_UNLIKELY(!real))
        return gn_missing(GN_ID_cuMemFree);
    uint64_t val;
    if (!gn_table_take(dptr, GN_KIND_MEM, &val))
        return real(dptr);
    CUresult r = real(dptr);
    gn_settle_free(r, dptr, val);
    return r;
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

/* Adjust a reservation from `estimate` to `actual`; 0 if the extra bytes
 * would pass the cap. */
static int gn_settle_reservation(unsigned dev, uint64_t estimate, uint64_t actual)
{
    if (actual < estimate) {
        gn_unreserve(dev, estimate - actual);
        return 1;
    }
    uint64_t extra = actual - estimate;
    if (extra == 0)
        return 1;
    if (gpunode_memcap_try_add(&gn_hot.usage->used_bytes[dev], extra, gn_hot.limit_bytes[dev])) {
        atomic_fetch_add_explicit(&gn_hot.slot->used_bytes[dev], extra, memory_order_relaxed);
        return 1;
    }
    return gn_reserve_cold(dev, extra) == GN_TRACK;
}

GN_EXPORT CUresult cuMemAllocPitch_v2(CUdeviceptr *dptr, size_t *pitch, size_t width_bytes, size_t height,
                                      unsigned int element_bytes)
{
    __typeof__(&cuMemAllocPitch_v2) real = GN_REAL(cuMemAllocPitch_v2);
    if (GN_UNLIKELY(!real))
        return gn_missing(GN_ID_cuMemAllocPitch_v2);
    uint64_t estimate = gn_pitch_estimate(width_bytes, height);
    unsigned dev;
    CUresult err = CUDA_SUCCESS;
    int verdict = gn_reserve(estimate, -1, &dev, &err);
    if (verdict != GN_TRACK)
        return verdict == GN_PASS ? real(dptr, pitch, width_bytes, height, element_bytes)
                                  : gn_denied(verdict, err, __func__, estimate);
    CUresult r = real(dptr, pitch, width_bytes, height, element_bytes);
    if (r != CUDA_SUCCESS) {
        gn_unreserve(dev, estimate);
        return r;
    }
    uint64_t actual;
    if (__builtin_mul_overflow((uint64_t)*pitch, (uint64_t)height, &actual) ||
        !gn_settle_reservation(dev, estimate, actual)) {
        gn_undo_mem(*dptr);
        gn_unreserve(dev, estimate);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    GN_TRACK_OR_UNDO(*dptr, actual, dev, GN_KIND_MEM, gn_undo_mem(*dptr));
    return r;
}

GN_EXPORT CUresult cuMemAllocPitch(CUdeviceptr_v1 *dptr, unsigned int *pitch, unsigned int width_bytes,
                                   unsigned int height, unsigned int element_bytes)
{
    __typeof__(&cuMemAllocPitch) real = GN_REAL(cuMemAllocPitch);
    if (GN_UNLIKELY(!real))
        return gn_missing(GN_ID_cuMemAllocPitch);
    uint64_t estimate = gn_pitch_estimate(width_bytes, height);
    unsigned dev;
    CUresult err = CUDA_SUCCESS;
    int verdict = gn_reserve(estimate, -1, &dev, &err);
    if (verdict != GN_TRACK)
        return verdict == GN_PASS ? real(dptr, pitch, width_bytes, height, element_bytes)
                                  : gn_denied(verdict, err, __func__, estimate);
    CUresult r = real(dptr, pitch, width_bytes, height, element_bytes);
    if (r != CUDA_SUCCESS) {
        gn_unreserve(dev, estimate);
        return r;
    }
    uint64_t actual = (uint64_t)*pitch * (uint64_t)height;
    if (!gn_settle_reservation(dev, estimate, actual)) {
        gn_undo_mem(*dptr);
        gn_unreserve(dev, estimate);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    GN_TRACK_OR_UNDO(*dptr, actual, dev, GN_KIND_MEM, gn_undo_mem(*dptr));
    return r;
}

GN_EXPORT CUresult cuMemAllocManaged(CUdeviceptr *dptr, size_t bytesize, unsigned int flags)
{
    __typeof__(&cuMemAllocManaged) real = GN_REAL(cuMemAllocManaged);
    if (GN_UNLIKELY(!real))
        return gn_missing(GN_ID_cuMemAllocManaged);
    unsigned dev;
    CUresult err = CUDA_SUCCESS;
    int verdict = gn_reserve(bytesize, -1, &dev, &err);
    if (verdict != GN_TRACK)
        return verdict == GN_PASS ? real(dptr, bytesize, flags) : gn_denied(verdict, err, __func__, bytesize);
    CUresult r = real(dptr, bytesize, flags);
    if (r != CUDA_SUCCESS) {
        gn_unreserve(dev, bytesize);
        return r;
    }
    GN_TRACK_OR_UNDO(*dptr, bytesize, dev, GN_KIND_MEM, gn_undo_mem(*dptr));
    return r;
}

/* Stream-ordered allocations: one body for the four entry points. */
#define GN_ALLOC_ASYNC(name, params, args)                                                                         \
    GN_EXPORT CUresult name params                                                                                 \
    {                                                                                                              \
        __typeof__(&name) real = GN_REAL(name);                                                                    \
        if (GN_UNLIKELY(!real))                                                                                    \
            return gn_missing(GN_ID_##name);                                                                       \
        unsigned dev;                                                                                              \
        CUresult err = CUDA_SUCCESS;                                                                               \
        int verdict = gn_reserve(bytesize, -1, &dev, &err);                                                        \
        if (GN_UNLIKELY(verdict != GN_TRACK))                                                                      \
            return verdict == GN_PASS ? real args : gn_denied(verdict, err, #name, bytesize);                      \
        CUresult r = real args;                                                                                    \
        if (GN_UNLIKELY(r != CUDA_SUCCESS)) {                                                                      \
            gn_unreserve(dev, bytesize);                                                                           \
            return r;                                                                                              \
        }                                                                                                          \
        GN_TRACK_OR_UNDO(*dptr, bytesize, dev, GN_KIND_MEM, gn_undo_mem(*dptr));                                   \
        return r;                                                                                                  \
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
        uint64_t val;                                                                                              \
        if (!gn_table_take(dptr, GN_KIND_MEM, &val))                                                               \
            return real(dptr, stream);                                                                             \
        CUresult r = real(dptr, stream);                                                                           \
        gn_settle_free(r, dptr, val);                                                                              \
        return r;                                                                                                  \
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
    unsigned dev;
    CUresult err = CUDA_SUCCESS;
    int verdict = gn_reserve(size, prop->location.id, &dev, &err);
    if (verdict != GN_TRACK)
        return verdict == GN_PASS ? real(handle, size, prop, flags) : gn_denied(verdict, err, __func__, size);
    CUresult r = real(handle, size, prop, flags);
    if (r != CUDA_SUCCESS) {
        gn_unreserve(dev, size);
        return r;
    }
    __typeof__(&cuMemRelease) release = GN_REAL(cuMemRelease);
    GN_TRACK_OR_UNDO(*handle, size, dev, GN_KIND_VMM, if (release) release(*handle));
    return r;
}

GN_EXPORT CUresult cuMemRelease(CUmemGenericAllocationHandle handle)
{
    __typeof__(&cuMemRelease) real = GN_REAL(cuMemRelease);
    if (GN_UNLIKELY(!real))
        return gn_missing(GN_ID_cuMemRelease);
    uint64_t val;
    if (!gn_table_take(handle, GN_KIND_VMM, &val))
        return real(handle);
    CUresult r = real(handle);
    gn_settle_free(r, handle, val);
    return r;
}
