/*
 * hooks_launch.c: every way work reaches the GPU: cuLaunchKernel,
 * cuLaunchKernelEx, cuLaunchCooperativeKernel, cuGraphLaunch, and their
 * per-thread-default-stream (_ptsz) variants. Each launch is charged against
 * the container's compute budget before the driver sees it and measured
 * with events around it (compute.c); a launch into a stream being captured
 * into a graph is not (the graph's launch is).
 *
 * Every hook is
 *
 *     struct gn_launch l;
 *     gn_launch_begin(&l, stream, ptsz);
 *     return gn_launch_end(&l, real(...));
 *
 * Must not: take a lock or make a system call while the budget is in credit
 * (the fast path, in gn_pair_open, is an atomic subtraction and a compare).
 */
#define _GNU_SOURCE
#include "preload.h"

struct gn_launch {
    uint64_t ticket; /* 0: not measured */
    CUstream stream;
    int ptsz;
};

static inline void gn_launch_begin(struct gn_launch *l, CUstream stream, int ptsz)
{
    l->ticket = 0;
    l->stream = stream;
    l->ptsz = ptsz;
    int phase = atomic_load_explicit(&gn_hot.phase, memory_order_acquire);
    if (GN_UNLIKELY(phase != GN_PHASE_READY)) {
        if (phase == GN_PHASE_OPEN || phase == GN_PHASE_CLOSED || gn_enter_slow() != GN_TRACK)
            return; /* no usable region, or no slot in it: the launch passes unmeasured */
    }
    if (GN_UNLIKELY(!atomic_load_explicit(&gn_compute_on, memory_order_acquire)) && !gn_compute_start())
        return;
    l->ticket = gn_pair_open(stream, ptsz, atomic_load_explicit(&gn_estimate_ns, memory_order_relaxed));
}

static inline CUresult gn_launch_end(const struct gn_launch *l, CUresult r)
{
    if (GN_LIKELY(l->ticket))
        gn_pair_close(l->ticket, l->stream, l->ptsz);
    return r;
}

GN_EXPORT CUresult cuLaunchKernel(CUfunction f, unsigned int gx, unsigned int gy, unsigned int gz, unsigned int bx,
                                  unsigned int by, unsigned int bz, unsigned int shared_bytes, CUstream stream,
                                  void **params, void **extra)
{
    __typeof__(&cuLaunchKernel) real = GN_REAL(cuLaunchKernel);
    if (GN_UNLIKELY(!real))
        return gn_missing(GN_ID_cuLaunchKernel);
    struct gn_launch l;
    gn_launch_begin(&l, stream, 0);
    return gn_launch_end(&l, real(f, gx, gy, gz, bx, by, bz, shared_bytes, stream, params, extra));
}

GN_EXPORT CUresult cuLaunchKernel_ptsz(CUfunction f, unsigned int gx, unsigned int gy, unsigned int gz,
                                       unsigned int bx, unsigned int by, unsigned int bz, unsigned int shared_bytes,
                                       CUstream stream, void **params, void **extra)
{
    __typeof__(&cuLaunchKernel_ptsz) real = GN_REAL(cuLaunchKernel_ptsz);
    if (GN_UNLIKELY(!real))
        return gn_missing(GN_ID_cuLaunchKernel_ptsz);
    struct gn_launch l;
    gn_launch_begin(&l, stream, 1);
    return gn_launch_end(&l, real(f, gx, gy, gz, bx, by, bz, shared_bytes, stream, params, extra));
}

GN_EXPORT CUresult cuLaunchKernelEx(const CUlaunchConfig *config, CUfunction f, void **params, void **extra)
{
    __typeof__(&cuLaunchKernelEx) real = GN_REAL(cuLaunchKernelEx);
    if (GN_UNLIKELY(!real))
        return gn_missing(GN_ID_cuLaunchKernelEx);
    if (GN_UNLIKELY(!config))
        return real(config, f, params, extra);
    struct gn_launch l;
    gn_launch_begin(&l, config->hStream, 0);
    return gn_launch_end(&l, real(config, f, params, extra));
}

GN_EXPORT CUresult cuLaunchKernelEx_ptsz(const CUlaunchConfig *config, CUfunction f, void **params, void **extra)
{
    __typeof__(&cuLaunchKernelEx_ptsz) real = GN_REAL(cuLaunchKernelEx_ptsz);
    if (GN_UNLIKELY(!real))
        return gn_missing(GN_ID_cuLaunchKernelEx_ptsz);
    if (GN_UNLIKELY(!config))
        return real(config, f, params, extra);
    struct gn_launch l;
    gn_launch_begin(&l, config->hStream, 1);
    return gn_launch_end(&l, real(config, f, params, extra));
}

GN_EXPORT CUresult cuLaunchCooperativeKernel(CUfunction f, unsigned int gx, unsigned int gy, unsigned int gz,
                                             unsigned int bx, unsigned int by, unsigned int bz,
                                             unsigned int shared_bytes, CUstream stream, void **params)
{
    __typeof__(&cuLaunchCooperativeKernel) real = GN_REAL(cuLaunchCooperativeKernel);
    if (GN_UNLIKELY(!real))
        return gn_missing(GN_ID_cuLaunchCooperativeKernel);
    struct gn_launch l;
    gn_launch_begin(&l, stream, 0);
    return gn_launch_end(&l, real(f, gx, gy, gz, bx, by, bz, shared_bytes, stream, params));
}

GN_EXPORT CUresult cuLaunchCooperativeKernel_ptsz(CUfunction f, unsigned int gx, unsigned int gy, unsigned int gz,
                                                  unsigned int bx, unsigned int by, unsigned int bz,
                                                  unsigned int shared_bytes, CUstream stream, void **params)
{
    __typeof__(&cuLaunchCooperativeKernel_ptsz) real = GN_REAL(cuLaunchCooperativeKernel_ptsz);
    if (GN_UNLIKELY(!real))
        return gn_missing(GN_ID_cuLaunchCooperativeKernel_ptsz);
    struct gn_launch l;
    gn_launch_begin(&l, stream, 1);
    return gn_launch_end(&l, real(f, gx, gy, gz, bx, by, bz, shared_bytes, stream, params));
}

GN_EXPORT CUresult cuGraphLaunch(CUgraphExec graph, CUstream stream)
{
    __typeof__(&cuGraphLaunch) real = GN_REAL(cuGraphLaunch);
    if (GN_UNLIKELY(!real))
        return gn_missing(GN_ID_cuGraphLaunch);
    struct gn_launch l;
    gn_launch_begin(&l, stream, 0);
    return gn_launch_end(&l, real(graph, stream));
}

GN_EXPORT CUresult cuGraphLaunch_ptsz(CUgraphExec graph, CUstream stream)
{
    __typeof__(&cuGraphLaunch_ptsz) real = GN_REAL(cuGraphLaunch_ptsz);
    if (GN_UNLIKELY(!real))
        return gn_missing(GN_ID_cuGraphLaunch_ptsz);
    struct gn_launch l;
    gn_launch_begin(&l, stream, 1);
    return gn_launch_end(&l, real(graph, stream));
}
