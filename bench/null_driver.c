/*
 * null_driver.c: a libcuda.so.1 that does as little as a driver entry point
 * can, for bench/compute_share.py's launch cost: a launch, an event record
 * and an event query each return at once (events are complete as soon as
 * they are recorded, 1 us apart), so what a timed launch costs under the
 * preload library is the library's own work plus the bare calls it makes.
 *
 * Bench infrastructure only; never part of gpunode.
 */
#define _GNU_SOURCE
#include <stdint.h>
#include <stdlib.h>

#define API __attribute__((visibility("default")))

typedef int CUresult;
typedef int CUdevice;
typedef struct CUctx_st *CUcontext;
typedef struct CUstream_st *CUstream;
typedef struct CUfunc_st *CUfunction;

struct CUevent_st {
    uint64_t t;
};
typedef struct CUevent_st *CUevent;

static struct CUctx_st {
    int dev;
} context;
static __thread CUcontext current;
static uint64_t ticks;

API CUresult cuInit(unsigned int flags)
{
    (void)flags;
    return 0;
}

API CUresult cuDevicePrimaryCtxRetain(CUcontext *ctx, CUdevice dev)
{
    (void)dev;
    *ctx = &context;
    return 0;
}

API CUresult cuCtxSetCurrent(CUcontext ctx)
{
    current = ctx;
    return 0;
}

API CUresult cuCtxGetCurrent(CUcontext *ctx)
{
    *ctx = current;
    return 0;
}

API CUresult cuCtxGetDevice(CUdevice *dev)
{
    *dev = 0;
    return 0;
}

API CUresult cuCtxSynchronize(void)
{
    return 0;
}

API CUresult cuLaunchKernel(CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,
                            unsigned shmem, CUstream stream, void **params, void **extra)
{
    (void)f, (void)gx, (void)gy, (void)gz, (void)bx, (void)by, (void)bz, (void)shmem, (void)stream, (void)params;
    (void)extra;
    return 0;
}

API CUresult cuStreamIsCapturing(CUstream stream, int *status)
{
    (void)stream;
    *status = 0;
    return 0;
}

API CUresult cuEventCreate(CUevent *event, unsigned int flags)
{
    (void)flags;
    *event = calloc(1, sizeof(struct CUevent_st));
    return *event ? 0 : 2;
}

API CUresult cuEventDestroy_v2(CUevent event)
{
    free(event);
    return 0;
}

API CUresult cuEventRecord(CUevent event, CUstream stream)
{
    (void)stream;
    event->t = __atomic_add_fetch(&ticks, 1000, __ATOMIC_RELAXED);
    return 0;
}

API CUresult cuEventQuery(CUevent event)
{
    (void)event;
    return 0;
}

API CUresult cuEventElapsedTime(float *ms, CUevent start, CUevent end)
{
    *ms = (float)((double)(int64_t)(end->t - start->t) / 1e6);
    return 0;
}
