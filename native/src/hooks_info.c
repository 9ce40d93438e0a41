/*
 * hooks_info.c: what a capped container is told about its GPU's memory.
 * cuMemGetInfo, cuDeviceTotalMem and NVML's nvmlDeviceGetMemoryInfo report
 * the cap as the total, and as free the smaller of the driver's free memory
 * and what is left under the cap (never below zero), so frameworks size
 * their pools to the cap and nvidia-smi inside the container agrees.
 *
 * Must not: change anything but the reported numbers, or report for devices
 * outside the region.
 */
#define _GNU_SOURCE
#include "preload.h"

#include <limits.h>

/* Cap *free_bytes and *total_bytes for region device `dev`; *used_bytes
 * (optional) receives the container's usage. */
static void gn_cap_numbers(unsigned dev, uint64_t *free_bytes, uint64_t *total_bytes, uint64_t *used_bytes)
{
    uint64_t cap = gn_hot.limit_bytes[dev];
    if (cap > *total_bytes)
        cap = *total_bytes;
    uint64_t used = atomic_load_explicit(&gn_hot.usage->used_bytes[dev], memory_order_relaxed);
    uint64_t left = used >= cap ? 0 : cap - used;
    if (*free_bytes > left)
        *free_bytes = left;
    *total_bytes = cap;
    if (used_bytes)
        *used_bytes = used > cap ? cap : used;
}

/* Apply the cap for CUDA device `ordinal` (-1: current); 0 if not capped. */
static int gn_cap_cuda(int ordinal, uint64_t *free_bytes, uint64_t *total_bytes)
{
    unsigned dev = 0;
    int verdict = gn_query_device(ordinal, &dev);
    if (verdict == GN_PASS)
        return 0;
    if (verdict == GN_DENY) {
        *free_bytes = 0;
        return 1;
    }
    gn_cap_numbers(dev, free_bytes, total_bytes, NULL);
    return 1;
}

static unsigned int gn_clamp_u32(uint64_t v)
{
    return v > UINT_MAX ? UINT_MAX : (unsigned int)v;
}

GN_EXPORT CUresult cuMemGetInfo_v2(size_t *free_bytes, size_t *total_bytes)
{
    __typeof__(&cuMemGetInfo_v2) real = GN_REAL(cuMemGetInfo_v2);
    if (GN_UNLIKELY(!real))
        return gn_missing(GN_ID_cuMemGetInfo_v2);
    CUresult r = real(free_bytes, total_bytes);
    if (r != CUDA_SUCCESS || !free_bytes || !total_bytes)
        return r;
    uint64_t f = *free_bytes, t = *total_bytes;
    if (gn_cap_cuda(-1, &f, &t)) {
        *free_bytes = (size_t)f;
        *total_bytes = (size_t)t;
    }
    return r;
}

GN_EXPORT CUresult cuMemGetInfo(unsigned int *free_bytes, unsigned int *total_bytes)
{
    __typeof__(&cuMemGetInfo) real = GN_REAL(cuMemGetInfo);
    if (GN_UNLIKELY(!real))
        return gn_missing(GN_ID_cuMemGetInfo);
    CUresult r = real(free_bytes, total_bytes);
    if (r != CUDA_SUCCESS || !free_bytes || !total_bytes)
        return r;
    uint64_t f = *free_bytes, t = *total_bytes;
    if (gn_cap_cuda(-1, &f, &t)) {
        *free_bytes = gn_clamp_u32(f);
        *total_bytes = gn_clamp_u32(t);
    }
    return r;
}

GN_EXPORT CUresult cuDeviceTotalMem_v2(size_t *bytes, CUdevice dev)
{
    __typeof__(&cuDeviceTotalMem_v2) real = GN_REAL(cuDeviceTotalMem_v2);
    if (GN_UNLIKELY(!real))
        return gn_missing(GN_ID_cuDeviceTotalMem_v2);
    CUresult r = real(bytes, dev);
    if (r != CUDA_SUCCESS || !bytes)
        return r;
    uint64_t f = 0, t = *bytes;
    if (gn_cap_cuda(dev, &f, &t))
        *bytes = (size_t)t;
    return r;
}

GN_EXPORT CUresult cuDeviceTotalMem(unsigned int *bytes, CUdevice dev)
{
    __typeof__(&cuDeviceTotalMem) real = GN_REAL(cuDeviceTotalMem);
    if (GN_UNLIKELY(!real))
        return gn_missing(GN_ID_cuDeviceTotalMem);
    CUresult r = real(bytes, dev);
    if (r != CUDA_SUCCESS || !bytes)
        return r;
    uint64_t f = 0, t = *bytes;
    if (gn_cap_cuda(dev, &f, &t))
        *bytes = gn_clamp_u32(t);
    return r;
}

/* NVML: used is the container's usage; reserved memory is not the
 * container's, so it is reported as zero under a cap. */
static int gn_cap_nvml(nvmlDevice_t device, uint64_t *free_bytes, uint64_t *total_bytes, uint64_t *used_bytes)
{
    unsigned dev = 0;
    int verdict = gn_query_nvml_device(device, &dev);
    if (verdict == GN_PASS)
        return 0;
    if (verdict == GN_DENY) {
        *free_bytes = 0;
        return 1;
    }
    gn_cap_numbers(dev, free_bytes, total_bytes, used_bytes);
    return 1;
}

GN_EXPORT nvmlReturn_t nvmlDeviceGetMemoryInfo(nvmlDevice_t device, nvmlMemory_t *memory)
{
    __typeof__(&nvmlDeviceGetMemoryInfo) real = GN_REAL(nvmlDeviceGetMemoryInfo);
    if (GN_UNLIKELY(!real))
        return gn_missing(GN_ID_nvmlDeviceGetMemoryInfo);
    nvmlReturn_t r = real(device, memory);
    if (r != NVML_SUCCESS || !memory)
        return r;
    uint64_t f = memory->free, t = memory->total, u = memory->used;
    if (gn_cap_nvml(device, &f, &t, &u)) {
        memory->free = f;
        memory->total = t;
        memory->used = u;
    }
    return r;
}

GN_EXPORT nvmlReturn_t nvmlDeviceGetMemoryInfo_v2(nvmlDevice_t device, nvmlMemory_v2_t *memory)
{
    __typeof__(&nvmlDeviceGetMemoryInfo_v2) real = GN_REAL(nvmlDeviceGetMemoryInfo_v2);
    if (GN_UNLIKELY(!real))
        return gn_missing(GN_ID_nvmlDeviceGetMemoryInfo_v2);
    nvmlReturn_t r = real(device, memory);
    if (r != NVML_SUCCESS || !memory)
        return r;
    uint64_t f = memory->free, t = memory->total, u = memory->used;
    if (gn_cap_nvml(device, &f, &t, &u)) {
        memory->free = f;
        memory->total = t;
        memory->used = u;
        memory->reserved = 0;
    }
    return r;
}
